"""The chat page at ``/``: served by ``create_app`` only, self-contained, script pinned."""

from __future__ import annotations

import re

from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from inlinelm.api import create_app, openai_router
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO

# -- without a browser -----------------------------------------------------------------------


def test_create_app_serves_the_page_and_the_router_alone_has_none() -> None:
    page = TestClient(create_app(ECHO)).get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>inlinelm chat</title>" in page.text
    bare = Starlette(routes=[Mount("/", app=openai_router(Engine(ECHO)))])
    assert TestClient(bare).get("/").status_code == 404


def test_the_page_loads_nothing_from_elsewhere_and_runs_only_its_own_script() -> None:
    page = TestClient(create_app(ECHO)).get("/")
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text) is None
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "connect-src 'self'" in policy
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'(;|$)", policy)
    assert "innerHTML" not in page.text
    assert "insertAdjacentHTML" not in page.text
