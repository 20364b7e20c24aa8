"""The models one router serves, and the one place a request body picks its model.

:class:`ModelTable` maps each served name to that model's
:class:`~inlinelm.api.serving.OpenAIServing` (its engine, its name, the router's limits and
parsers). Every ``POST`` endpoint is a *body handler* per model,
``async handler(request, body: JsonBody) -> Response``, put behind
:meth:`ModelTable.dispatch`, which:

1. reads the body once, within ``max_request_bytes`` (a 413 past it, a 400 when it is not
   JSON), noting when it began to arrive (a stream's time to first token starts there);
2. picks the model the body's ``model`` names:

   - one model: a body that names none (or ``null``) is that model's, as curl users send it;
   - several: a body that names none is a 400 listing the served models;
   - a name no one serves is a 404 ``model_not_found``, the status and code OpenAI's API
     answers (vLLM's too: 404);

3. calls that model's handler with the parsed body (:class:`JsonBody`): the handler never
   reads the request's body again.

A new endpoint (``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``) is one line in the
router's list of routes (:mod:`inlinelm.api.router`, whose ``post`` puts
``table.dispatch(make)`` behind the access checks); ``dispatch`` takes a function that
makes each model's handler once, when the router is built::

    post("/v1/embeddings", lambda serving: EmbeddingsEndpoint(serving).create)

where ``EmbeddingsEndpoint.create(request, body)`` reads ``body.data`` (the parsed JSON),
``body.size`` and ``body.arrival``, and answers for ``serving.engine`` under
``serving.model_name``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from inlinelm.api.access import Endpoint
from inlinelm.api.body import JsonBody, parse_json, read_body
from inlinelm.api.errors import APIError, bad_request
from inlinelm.api.fields import Fields
from inlinelm.api.serving import error_response

if TYPE_CHECKING:
    from inlinelm.api.serving import OpenAIServing

MAX_SHOWN_NAME_CHARS = 200
"""How much of an unknown model's name a 404 quotes back (the rest is cut)."""


BodyHandler = Callable[[Request, JsonBody], Awaitable[Response]]
"""One model's handler of a ``POST`` endpoint, given the body :meth:`ModelTable.dispatch` read."""


class ModelTable:
    """The served models by name (insertion order is the order ``/v1/models`` lists them),
    and the dispatch of each request body to its model (see the module docstring)."""

    def __init__(self, models: Mapping[str, OpenAIServing], max_request_bytes: int) -> None:
        if not models:
            raise ValueError("a router serves at least one model")
        self.models = dict(models)
        self.max_request_bytes = max_request_bytes

    @property
    def names(self) -> list[str]:
        """The served model names, in order."""
        return list(self.models)

    def dispatch(self, make: Callable[[OpenAIServing], BodyHandler]) -> Endpoint:
        """An endpoint that reads the body once, picks its model (:meth:`pick`) and hands
        the parsed body to that model's handler; ``make`` builds each model's handler,
        once, here."""
        handlers = {name: make(serving) for name, serving in self.models.items()}

        async def endpoint(request: Request) -> Response:
            arrival = time.perf_counter()  # NOTE: before the body is read: TTFT starts here.
            try:
                raw = await read_body(request, self.max_request_bytes)
                data = parse_json(raw)
                name = self.pick(data)
            except Exception as exc:
                return error_response(exc)
            return await handlers[name](request, JsonBody(data, len(raw), arrival))

        return endpoint

    def pick(self, data: Any) -> str:
        """The name of the model a parsed body is for: the one it names, else the only one.

        Raises a 404 for a name not served, a 400 when several are served and the body
        names none. With one model, a body that is not an object, or whose ``model`` is
        not a string, goes to that model, whose parser reports it.
        """
        if len(self.models) == 1:
            (only,) = self.models
            asked = data.get("model") if isinstance(data, dict) else None
            if isinstance(asked, str) and asked != only:
                raise self.not_found(asked)
            return only
        asked = Fields(data).read_str("model", None)
        if asked is None:
            raise bad_request(
                f"model is required: this server serves several models: {self._listed()}",
                "model",
                code="missing_required_parameter",
            )
        if asked not in self.models:
            raise self.not_found(asked)
        return asked

    def not_found(self, asked: str) -> APIError:
        """OpenAI's 404 for a model this router does not serve, naming those it does."""
        shown = asked if len(asked) <= MAX_SHOWN_NAME_CHARS else asked[:MAX_SHOWN_NAME_CHARS] + "…"
        return APIError(
            404,
            f"The model `{shown}` does not exist; this server serves: {self._listed()}",
            param="model",
            code="model_not_found",
        )

    def _listed(self) -> str:
        return ", ".join(self.models)
