"""One Serve replica: one :class:`~inlinelm.Engine` and the OpenAI router run on it.

:class:`EngineReplica` is the engine deployment's class. Its ``forward`` serves a request
an ingress read whole (:class:`~inlinelm.serve.forward.ForwardedRequest`) and yields the
response's ASGI messages in batches, naming the replica in ``x-inlinelm-replica``; its
``check_health``, ``record_autoscaling_stats`` and ``record_routing_stats`` are what Serve
polls. A subclass may add methods of its own, called through a deployment handle.

Each replica runs ``config`` as :func:`replica_config` adapts it to the resources Ray
assigned the replica (its GPU as device 0, its CPUs as the engine's threads).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve

from inlinelm.api.app import create_app
from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S
from inlinelm.config import EngineConfig
from inlinelm.runtime.engine import Engine
from inlinelm.serve.forward import ForwardedRequest, MessageBatch, serve_forwarded

REPLICA_HEADER = b"x-inlinelm-replica"


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """What :func:`~inlinelm.api.create_app` takes besides the engine."""

    model_name: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    sse_ping_s: float = DEFAULT_SSE_PING_S
    max_fanout: int = DEFAULT_MAX_FANOUT
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    tool_parser: str | None = None


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
            tool_parser=api.tool_parser,
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


def _assigned_cpus() -> int | None:
    """The whole CPUs Ray assigned this replica, if any."""
    resources = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
    cpus = resources.get("CPU")
    return int(cpus) if cpus and cpus >= 1 else None
