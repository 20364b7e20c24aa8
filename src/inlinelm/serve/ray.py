"""Many engines behind one OpenAI endpoint, on Ray Serve (``pip install 'inlinelm[ray]'``).

Each Serve replica of :class:`EngineServer` embeds one :class:`~inlinelm.Engine` and serves
:func:`~inlinelm.api.create_app` through Serve's ASGI integration, exactly as an app would
in one process. Serve does the HTTP ingress, the replicas, autoscaling and restarts; what
inlinelm adds is what a generic balancer cannot know:

- **Prefix-aware routing** (``routing="prefix"``, the default): a thin
  :class:`PrefixIngress` reads each request's body, takes its prompt's prefix key
  (:func:`~inlinelm.serve.prefix.prefix_key`), and forwards it through a deployment handle
  whose :class:`~inlinelm.serve.ray_router.PrefixAffinityRouter` sends every request that
  shares the key to one replica (within a load bound), so its prefix cache holds the
  shared prompt once. ``routing="serve"`` serves the engine deployment directly behind
  Serve's proxy and its default (power-of-two-choices) routing.
- **Health**: a replica whose engine is dead, stuck or closed fails Serve's health check
  (:meth:`EngineServer.check_health`), so Serve replaces it.
- **Load**: each replica reports its engine's queued and running requests to Serve
  (``record_autoscaling_stats``, ``record_routing_stats``); :func:`engine_load_policy`
  scales on them.

Streaming keeps the one-process guarantees: SSE frames go out as the engine releases them;
a client that leaves aborts its request on its replica (freeing its blocks); a bad request
is a 400 and a full replica a 429 with ``Retry-After``, both before any 200. A replica
that dies mid-stream ends its streams with an error frame (``replica_failed``); the other
replica's streams go on.

Three lines from an embedded engine to a Serve app::

    from ray import serve
    from inlinelm.serve.ray import build_app
    serve.run(build_app(EngineConfig(model="default"), num_replicas=2))
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

try:
    import ray
    from ray import serve
    from ray.serve.config import AutoscalingContext
    from ray.serve.exceptions import BackPressureError
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("inlinelm.serve.ray needs Ray Serve: pip install 'inlinelm[ray]'") from exc

from inlinelm.api.app import create_app
from inlinelm.api.errors import APIError
from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.runtime.engine import Engine
from inlinelm.serve.forward import ForwardedRequest, ForwardingApp, MessageBatch, serve_forwarded
from inlinelm.serve.prefix import DEFAULT_MAX_IMBALANCE, DEFAULT_PREFIX_CHARS

logger = logging.getLogger("inlinelm.serve")

Routing = Literal["prefix", "serve"]

# The ingress only relays, so Serve's cap on requests in flight at one ingress replica
# (5 by default) would hold streams back at the proxy; it sits far above any engine's.
_INGRESS_MAX_ONGOING = 4096
REPLICA_HEADER = b"x-inlinelm-replica"
# A Ray streaming item costs replica and ingress a fixed CPU price; gathering a stream's
# frames for 50 ms bounds that to 20 items a second per stream (see build_app). Ray Serve
# LLM batches its streams over the same 50 ms by default.
DEFAULT_STREAM_BATCH_S = 0.05


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """What :func:`~inlinelm.api.create_app` takes besides the engine."""

    model_name: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    sse_ping_s: float = DEFAULT_SSE_PING_S
    max_fanout: int = DEFAULT_MAX_FANOUT
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None


class EngineReplica:
    """One Serve replica: one engine, with the OpenAI router run on forwarded requests."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, config: EngineConfig, api: ApiOptions, stream_batch_s: float = 0.0
    ) -> None:
        self.stream_batch_s = stream_batch_s
        self.engine = Engine(replica_config(config, _assigned_cpus()))
        await self.engine.start()  # NOTE: a model that fails to load fails the replica's start
        self.api_app = create_app(
            self.engine,
            model_name=api.model_name,
            max_request_bytes=api.max_request_bytes,
            sse_ping_s=api.sse_ping_s,
            max_fanout=api.max_fanout,
            api_key=api.api_key,
            allowed_hosts=api.allowed_hosts,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[MessageBatch]:
        """Serve one request an ingress read whole; yield its response messages in batches.

        The response names the replica that served it in ``x-inlinelm-replica``.
        """
        async for batch in serve_forwarded(self.api_app, request, self.stream_batch_s):
            for message in batch:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    headers.append((REPLICA_HEADER, self.replica_id.encode()))
                    message["headers"] = headers
            yield batch

    def check_health(self) -> None:
        """Serve's health check: raises when the engine is dead, stuck or closed."""
        ok, reason = self.engine.health()
        if not ok:
            raise RuntimeError(f"the engine cannot serve: {reason}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's load for :func:`engine_load_policy`."""
        stats = self.engine.stats()
        return {"queued": stats["num_queued"], "running": stats["num_running"]}

    def record_routing_stats(self) -> dict[str, Any]:
        """What this replica holds: its id, its load and its KV cache (also read by tests)."""
        stats = self.engine.stats()
        return {
            "replica_id": self.replica_id,
            "queued": stats["num_queued"],
            "running": stats["num_running"],
            "kv_blocks_used": stats["kv_blocks_used"],
            "kv_blocks_total": stats["kv_blocks_total"],
            "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
            "prefix_cache_queried_tokens": stats["prefix_cache_queried_tokens"],
            "finished": stats["finished"],
        }

    def __del__(self) -> None:
        """Serve's shutdown hook for a replica: stop the engine thread and free its memory."""
        engine = getattr(self, "engine", None)  # NOTE: absent when the constructor failed
        if engine is not None:
            engine.close()


class _TakesHTTP:
    """Mixed into a replica class: Serve's proxy sends it HTTP (``routing="serve"``)."""

    api_app: Any

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app Serve's proxy sends this replica's HTTP requests to."""
        return self.api_app


@serve.ingress()
class EngineServer(_TakesHTTP, EngineReplica):
    """An :class:`EngineReplica` that also takes HTTP from Serve's proxy (``routing="serve"``)."""


def _http_server(replica_class: type[EngineReplica]) -> type[EngineReplica]:
    """``replica_class`` with Serve's ASGI integration (:class:`EngineServer` for ours)."""
    if replica_class is EngineReplica:
        return EngineServer
    server: type[EngineReplica] = serve.ingress()(
        type(f"{replica_class.__name__}Server", (_TakesHTTP, replica_class), {})
    )
    return server


@serve.ingress()
class PrefixIngress:
    """Reads each request whole, keys it by prompt prefix, and forwards it to an engine."""

    def __init__(self, engines: DeploymentHandle[Any], max_request_bytes: int, prefix_chars: int):
        self.engines = engines.options(stream=True, method_name="forward")
        self.max_request_bytes = max_request_bytes
        self.prefix_chars = prefix_chars

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app Serve's proxy sends every HTTP request to."""
        return ForwardingApp(
            self._batches, self.max_request_bytes, self.prefix_chars, replica_failure
        )

    async def _batches(self, request: ForwardedRequest) -> AsyncIterator[MessageBatch]:
        response = cast("DeploymentResponseGenerator[MessageBatch]", self.engines.remote(request))
        done = False
        try:
            async for batch in response:
                yield batch
            done = True
        finally:
            if not done:
                response.cancel()  # type: ignore[no-untyped-call]  # NOTE: the replica's stream sees a disconnect and aborts


def replica_failure(exc: BaseException) -> APIError:
    """What a client is told when its request cannot be served by a replica.

    Serve refusing it (every replica full and the handle's queue too) is a 429, like a
    full engine; a replica that died or cannot be reached is a 503; both say when to retry.
    """
    if isinstance(exc, BackPressureError):
        return APIError(
            429,
            "every replica is full; retry later",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return APIError(
            503,
            f"the replica serving this request stopped ({type(exc).__name__}); retry",
            type="server_error",
            code="replica_failed",
            headers={"Retry-After": "1"},
        )
    return APIError(
        500,
        f"the replica serving this request failed ({type(exc).__name__})",
        type="server_error",
        code="replica_error",
    )


def build_app(
    config: EngineConfig,
    *,
    num_replicas: int | Literal["auto"] = 1,
    ray_actor_options: Mapping[str, Any] | None = None,
    routing: Routing = "prefix",
    max_imbalance: float = DEFAULT_MAX_IMBALANCE,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    autoscaling_config: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    health_check_period_s: float = 5.0,
    num_ingress_replicas: int = 1,
    stream_batch_s: float = DEFAULT_STREAM_BATCH_S,
    api: ApiOptions | None = None,
    replica_class: type[EngineReplica] = EngineReplica,
) -> serve.Application:
    """A Serve application of ``num_replicas`` engines behind one OpenAI endpoint.

    ``ray_actor_options`` default to :func:`replica_resources` (one GPU per replica on
    CUDA, the engine's CPU threads otherwise). ``routing="prefix"`` puts a
    :class:`PrefixIngress` in front (``max_imbalance``: requests above the mean load a
    preferred replica may hold; ``prefix_chars``: how much of a prompt keys it);
    ``routing="serve"`` leaves routing to Serve. ``stream_batch_s``: how long a stream's
    frames are gathered into one item on their way from a replica to the ingress (every
    item costs both a fixed CPU price; the first token is never held). ``autoscaling_config`` is Serve's (its
    policy defaults to :func:`engine_load_policy`); ``max_ongoing_requests`` is Serve's cap
    per replica (default: the engine's running plus queued capacity, so Serve spills to
    another replica rather than overfill one). With the engine's ``max_queued_requests``
    set, Serve queues as many per handle and answers past them with a 429 and
    ``Retry-After``; without it, nothing is refused. ``api`` holds
    :func:`~inlinelm.api.create_app`'s options. ``replica_class`` is a subclass of
    :class:`EngineReplica` to run instead (with methods of your own to call through a
    handle; the tests use one to break an engine).
    """
    api = api or ApiOptions()
    queued = config.max_queued_requests
    options: dict[str, Any] = {
        "ray_actor_options": dict(ray_actor_options or replica_resources(config)),
        "max_ongoing_requests": max_ongoing_requests or default_max_ongoing(config),
        # NOTE: with a bounded engine queue, Serve's own queue is bounded too, and what it
        # refuses is a 429 with Retry-After, as a full engine's refusal is.
        "max_queued_requests": queued if queued is not None else -1,
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "health_check_period_s": health_check_period_s,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = _with_load_policy(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas
    if routing == "prefix":
        options["request_router_config"] = {
            "request_router_class": "inlinelm.serve.ray_router:PrefixAffinityRouter",
            "request_router_kwargs": {"max_imbalance": max_imbalance},
        }
    elif routing != "serve":
        raise ValueError(f"routing must be 'prefix' or 'serve', got {routing!r}")
    if routing == "serve":
        server = serve.deployment(name="InlineLMServer")(_http_server(replica_class))
        return server.options(**options).bind(config, api)
    engines = serve.deployment(name="InlineLMReplica")(replica_class).options(**options)
    ingress = serve.deployment(name="InlineLMIngress")(PrefixIngress).options(
        num_replicas=num_ingress_replicas,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    replicas = engines.bind(config, api, stream_batch_s)
    return ingress.bind(replicas, api.max_request_bytes, prefix_chars)


def replica_resources(config: EngineConfig) -> dict[str, Any]:
    """What one replica asks Ray for: a GPU on CUDA, else its engine's CPU threads."""
    if config.device.startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": config.num_threads or 1}


def default_max_ongoing(config: EngineConfig) -> int:
    """Serve's per-replica cap: what the engine runs plus what it queues before a 429."""
    queued = config.max_queued_requests
    return config.max_num_seqs + (queued if queued is not None else config.max_num_seqs)


def replica_config(config: EngineConfig, assigned_cpus: int | None) -> EngineConfig:
    """``config`` as one replica runs it.

    On CUDA, Ray shows each replica only its own GPU, as device 0. On a CPU, an engine
    that would use every core uses the cores Ray assigned it, so replicas sharing a
    machine do not oversubscribe it.
    """
    if config.device.startswith("cuda"):
        return replace(config, device="cuda")
    if config.num_threads is None and assigned_cpus:
        return replace(config, num_threads=assigned_cpus)
    return config


def engine_load_policy(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    """Serve autoscaling on the engines' own load: queued plus running requests.

    The replicas wanted are the total load over the config's ``target_ongoing_requests``,
    kept within ``min_replicas`` and ``max_replicas``. Before any replica has reported, the
    current target stands.
    """
    metrics = ctx.aggregated_metrics or {}
    if "running" not in metrics and "queued" not in metrics:
        return ctx.target_num_replicas, {}
    load = sum(metrics.get("running", {}).values()) + sum(metrics.get("queued", {}).values())
    target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 2.0
    wanted = math.ceil(load / target) if load else ctx.capacity_adjusted_min_replicas
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    return max(low, min(high, wanted)), {}


def _with_load_policy(autoscaling_config: Mapping[str, Any]) -> dict[str, Any]:
    config = dict(autoscaling_config)
    config.setdefault("policy", {"policy_function": engine_load_policy})
    return config


def _assigned_cpus() -> int | None:
    """The whole CPUs Ray assigned this replica, if any."""
    resources = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
    cpus = resources.get("CPU")
    return int(cpus) if cpus and cpus >= 1 else None


def run(
    app: serve.Application,
    *,
    host: str,
    port: int,
    name: str = "inlinelm",
    dashboard: bool = False,
) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (``inlinelm serve --ray``).

    Ray is the cluster at ``RAY_ADDRESS`` when that is set (``ray start --head`` on a
    machine, or KubeRay), else a new local instance on this machine. An interrupt, SIGINT
    or SIGTERM (what systemd, Docker and Kubernetes send), deletes the app; a local
    instance is then shut down with every process it started, a cluster's Serve is left
    running (where a Serve already runs, its own HTTP address stands and ``host``/``port``
    are not applied).

    A local instance listens on loopback only, and runs Ray's dashboard (on 127.0.0.1)
    only with ``dashboard``: anyone who reaches Ray's ports can run code in it. Ray picks
    the address its processes listen on when it is imported, from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``inlinelm serve --ray`` sets it first); in
    a process where Ray would listen on the network, a local instance is a
    ``ConfigError``, not started.
    """
    local = not os.environ.get("RAY_ADDRESS")
    if local:
        check_loopback_ray()
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    try:
        ray.init(**(local_ray_options(dashboard) if local else {}))
        _stop_on_signals(stop)  # NOTE: ray.init sets a SIGTERM handler of its own
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=name, route_prefix="/", blocking=False)
        # NOTE: serve.run can swallow the KeyboardInterrupt of a signal that lands while
        # it waits for the app (it then served on, deaf to that signal): the event keeps it.
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        with _interrupts_ignored():
            _stop_ray(name, local)
        _restore_signals(previous)


def local_ray_options(dashboard: bool) -> dict[str, Any]:
    """``ray.init``'s options for a local instance: Ray's dashboard only when asked, and
    then on 127.0.0.1."""
    return {"include_dashboard": dashboard, "dashboard_host": "127.0.0.1"}


def check_loopback_ray() -> None:
    """A ``ConfigError`` unless a local Ray instance started now listens on loopback only
    and keeps Ray's token authentication.

    Ray Serve (2.60) opens one port per replica on every interface, whatever Ray's own
    address (``ray/serve/_private/replica.py``: its inter-deployment gRPC server on
    ``[::]:0``); it takes pickled calls, so only Ray's token (on by default for a local
    instance) keeps others out, and ``RAY_AUTH_MODE`` may not turn it off.
    """
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
    if not _is_loopback(address):
        raise ConfigError(
            f"a local Ray instance would listen on {address}, where anyone who reaches it "
            "can run code; set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported "
            "(inlinelm serve --ray does) for a loopback-only instance, or RAY_ADDRESS for a "
            "cluster",
            option="ray",
        )
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ConfigError(
            f"RAY_AUTH_MODE={mode}: Ray Serve's replicas take calls on every interface, and "
            "without Ray's token anyone who reaches them can run code; unset RAY_AUTH_MODE",
            option="ray",
        )


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address == "localhost"
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _stop_ray(name: str, local: bool) -> None:
    """Delete the app; with a local instance, shut Serve and Ray down (their processes end)."""
    if not ray.is_initialized():
        return
    logger.info("stopping: %s", "shutting Ray down" if local else f"deleting the app {name!r}")
    if local:
        serve.shutdown()  # type: ignore[no-untyped-call]  # unannotated in ray
    else:
        serve.delete(name)
    ray.shutdown()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any] | None:
    """Make SIGINT and SIGTERM set ``stop`` and raise ``KeyboardInterrupt``; returns the old
    handlers (None off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}


def _restore_signals(previous: dict[int, Any] | None) -> None:
    for sig, old in (previous or {}).items():
        signal.signal(sig, old)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block: a second one must not cut Ray's shutdown
    short and leave its processes running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
