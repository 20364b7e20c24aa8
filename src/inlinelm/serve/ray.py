"""Many engines behind one OpenAI endpoint, on Ray Serve (``pip install 'inlinelm[ray]'``).

Each Serve replica of :class:`EngineServer` embeds one :class:`~inlinelm.Engine` and serves
:func:`~inlinelm.api.create_app` through Serve's ASGI integration, exactly as an app would
in one process. Serve does the HTTP ingress, the replicas, autoscaling and restarts; what
inlinelm adds is what a generic balancer cannot know:

- **Prefix-aware routing** (``routing="prefix"``, the default): a thin
  :class:`~inlinelm.serve.ray_ingress.PrefixIngress` reads each request's body, takes its prompt's prefix key
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

The pieces: :mod:`.ray_replica` (:class:`EngineReplica`, one engine per replica),
:mod:`.ray_ingress` (the ingress, and what a client is told when no replica serves it),
:mod:`.ray_router` (the handle's routing) and :mod:`.ray_local` (:func:`run`, serving an
app until a signal: ``inlinelm serve --ray``). This module builds the deployments
(:func:`build_app`, with their resources, caps and autoscaling policy) and is the public
entry: every name in ``__all__`` is imported from here.

Three lines from an embedded engine to a Serve app::

    from ray import serve
    from inlinelm.serve.ray import build_app
    serve.run(build_app(EngineConfig(model="default"), num_replicas=2))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

try:
    from ray import serve
    from ray.serve.config import AutoscalingContext
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("inlinelm.serve.ray needs Ray Serve: pip install 'inlinelm[ray]'") from exc

from inlinelm.config import EngineConfig
from inlinelm.serve.prefix import DEFAULT_MAX_IMBALANCE, DEFAULT_PREFIX_CHARS
from inlinelm.serve.ray_ingress import PrefixIngress
from inlinelm.serve.ray_local import run
from inlinelm.serve.ray_replica import ApiOptions, EngineReplica

__all__ = [
    "DEFAULT_STREAM_BATCH_S",
    "ApiOptions",
    "EngineReplica",
    "EngineServer",
    "Routing",
    "build_app",
    "default_max_ongoing",
    "engine_load_policy",
    "replica_resources",
    "run",
]

Routing = Literal["prefix", "serve"]

# The ingress only relays, so Serve's cap on requests in flight at one ingress replica
# (5 by default) would hold streams back at the proxy; it sits far above any engine's.
_INGRESS_MAX_ONGOING = 4096
# A Ray streaming item costs replica and ingress a fixed CPU price; gathering a stream's
# frames for 50 ms bounds that to 20 items a second per stream (see build_app). Ray Serve
# LLM batches its streams over the same 50 ms by default.
DEFAULT_STREAM_BATCH_S = 0.05


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
