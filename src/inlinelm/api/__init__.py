"""The OpenAI-compatible HTTP API: a mountable Starlette router and a ready-made app.

``openai_router(engine)`` returns a router to mount under any prefix of any Starlette or
FastAPI app (the host's middleware and auth apply); ``create_app(engine_or_config)`` builds
an app whose lifespan starts and closes the engine. Both also take a mapping of model names
to engines (``create_app``: or configs), and serve each request with the engine its
``model`` names.
"""

from inlinelm.api.app import create_app
from inlinelm.api.errors import APIError
from inlinelm.api.router import openai_router

__all__ = ["APIError", "create_app", "openai_router"]
