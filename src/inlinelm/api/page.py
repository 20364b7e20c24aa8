"""The chat page that ``create_app`` (and so ``inlinelm serve``) shows at ``/``.

One static HTML file shipped with the package (``static/chat.html``): plain JavaScript, no
build step, nothing loaded from elsewhere. It streams ``POST v1/chat/completions`` (URLs
relative to the page), keeps the conversation in the page, and sends the API key the user
pastes as a Bearer token. The router itself has no page: a host app that mounts
:func:`~inlinelm.api.openai_router` shows its own, or none.

The page is served with a Content-Security-Policy that lets only its own inline script and
style run (by hash) and lets it connect only to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

_INLINE = re.compile(rb"<(script|style)>(.*?)</\1>", re.DOTALL)


def chat_page_route(path: str = "/") -> Route:
    """A ``GET`` route serving the chat page at ``path``."""
    html = (files("inlinelm.api") / "static" / "chat.html").read_bytes()
    headers = {
        "Content-Security-Policy": content_security_policy(html),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    async def chat_page(request: Request) -> Response:
        return HTMLResponse(html, headers=headers)

    return Route(path, chat_page, methods=["GET"])


def content_security_policy(html: bytes) -> str:
    """A policy allowing exactly the inline ``<script>`` and ``<style>`` blocks of ``html``."""
    sources: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for tag, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        sources[tag].append(f"'sha256-{digest}'")
    return "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(sources[b"script"]),
            "style-src " + " ".join(sources[b"style"]),
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
