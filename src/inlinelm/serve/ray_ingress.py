"""The ingress of ``routing="prefix"``: what Serve's proxy hands every HTTP request to.

A :class:`PrefixIngress` replica holds no engine. Its
:class:`~inlinelm.serve.forward.ForwardingApp` reads each request whole and keys it by its
prompt's prefix; the ingress forwards it through a streaming handle to the engine
deployment (whose :class:`~inlinelm.serve.ray_router.PrefixAffinityRouter` picks the
replica) and relays the replica's message batches. A client that leaves cancels the
handle's stream, so the replica aborts the request. A request no replica could serve is
answered as :func:`replica_failure` says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from inlinelm.api.errors import APIError
from inlinelm.serve.forward import ForwardedRequest, ForwardingApp, MessageBatch


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
