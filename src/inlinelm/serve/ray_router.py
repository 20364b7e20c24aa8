"""Serve's request-router extension point, routing by prompt prefix (see :mod:`.prefix`).

:class:`PrefixAffinityRouter` runs inside every handle to the engine deployment (the
ingress holds one). For each request it reads the ``prefix_key`` the ingress put on the
:class:`~inlinelm.serve.forward.ForwardedRequest`, and ranks the replicas: first the
key's replica by :func:`~inlinelm.serve.prefix.choose` (its preferred one, or the least
loaded when the preferred one is past the load bound), then every replica, so a preferred
replica that is full (at ``max_ongoing_requests``) is passed over rather than waited for.

Loads are Serve's own count of each replica's ongoing requests (queued and running at the
engine), from the handle's queue-length cache, probed when an entry is missing or stale.
No state is shared between handles: rendezvous hashing gives every ingress replica the
same preference for the same key and replica set.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from inlinelm.serve.prefix import DEFAULT_MAX_IMBALANCE, choose


class PrefixAffinityRouter(RequestRouter):
    """Routes requests that share a prompt prefix to one replica, within a load bound."""

    max_imbalance: float = DEFAULT_MAX_IMBALANCE

    def initialize_state(self, max_imbalance: float = DEFAULT_MAX_IMBALANCE, **_: Any) -> None:
        """``max_imbalance``: requests above the mean a preferred replica may hold."""
        self.max_imbalance = max_imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas: the key's chosen replica, then all of them."""
        if not candidate_replicas:
            return []
        loads = await self._loads(candidate_replicas)
        if not loads:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chosen = choose(_key(pending_request), loads, self.max_imbalance)
        return [[by_id[chosen]], candidate_replicas]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, float]:
        """Each replica's ongoing requests: cached, else probed (a replica that does not
        answer in time is left out)."""
        cache = self.replica_queue_len_cache
        loads: dict[str, float] = {}
        missing: list[RunningReplica] = []
        for replica in replicas:
            queue_len = cache.get(replica.replica_id)
            if queue_len is None:
                missing.append(replica)
            else:
                loads[replica.replica_id.unique_id] = queue_len
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    loads[replica.replica_id.unique_id] = queue_len
        return loads


def _key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "prefix_key", None)
    return key if isinstance(key, str) else None
