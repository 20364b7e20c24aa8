"""One router, one app, several engines: each request goes to the engine its ``model`` names.

Two echo engines serve as ``alpha`` and ``beta``; their context lengths differ (2048 and
1024 tokens), so every answer that states a ``max_model_len`` tells which engine gave it,
and each engine's finished-request count tells which engine ran a generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from inlinelm.api import create_app, openai_router
from inlinelm.api.body import JsonBody
from inlinelm.api.model_table import ModelTable
from inlinelm.api.serving import OpenAIServing
from inlinelm.config import EngineConfig
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO, ServerThread, openai_client, serve
from tests.api.test_errors import check_error

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
LENGTHS = {"alpha": 2048, "beta": 1024}
CONFIGS = {name: ECHO.with_options(max_model_len=n) for name, n in LENGTHS.items()}
POSTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
]
LOCAL = "http://localhost"


@pytest.fixture(scope="module")
def app() -> Starlette:
    return create_app(CONFIGS)


@pytest.fixture(scope="module")
def server(app: Starlette) -> Iterator[ServerThread]:
    yield from serve(app)


def finished(engine: Engine) -> int:
    return sum(engine.stats()["finished"].values())


def test_the_app_holds_every_engine_by_name_and_no_single_engine(app: Starlette) -> None:
    engines = app.state.engines
    assert list(engines) == ["alpha", "beta"]
    assert [e.config.max_model_len for e in engines.values()] == [2048, 1024]
    assert not hasattr(app.state, "engine")
    single = create_app(ECHO)
    assert single.state.engines == {"default": single.state.engine}


def test_each_model_answers_its_own_chats_and_completions(
    app: Starlette, server: ServerThread
) -> None:
    engines = app.state.engines
    for name, other in (("alpha", "beta"), ("beta", "alpha")):
        before = {n: finished(e) for n, e in engines.items()}
        with openai_client(server.url) as client:
            chat = client.chat.completions.create(model=name, messages=USER, max_tokens=3)
            stream = client.completions.create(
                model=name, prompt="one two", max_tokens=2, stream=True
            )
            text = "".join(c.choices[0].text for c in stream if c.choices)
            answer = client.responses.create(model=name, input="one two", max_output_tokens=2)
        assert chat.model == name and chat.choices[0].message.content
        assert text == "one two"
        assert answer.model == name and answer.output_text
        assert finished(engines[name]) == before[name] + 3
        assert finished(engines[other]) == before[other]


def test_models_lists_every_model_with_its_context(server: ServerThread) -> None:
    with openai_client(server.url) as client:
        models = client.models.list()
    assert [m.id for m in models.data] == ["alpha", "beta"]
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert {m["id"]: m["max_model_len"] for m in listed} == LENGTHS


def test_tokenize_and_detokenize_go_to_the_model_named(server: ServerThread) -> None:
    for name, length in LENGTHS.items():
        body = {"model": name, "prompt": "Hello world"}
        tokens = httpx.post(f"{server.url}/tokenize", json=body).json()
        assert tokens["max_model_len"] == length and tokens["count"] == 2
        back = httpx.post(
            f"{server.url}/detokenize", json={"model": name, "tokens": tokens["tokens"]}
        )
        assert back.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize(("path", "body"), POSTS)
def test_a_model_not_served_is_a_404_naming_the_served_ones(
    server: ServerThread, path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{server.url}{path}", json={**body, "model": "gpt-4o"})
    assert response.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist; this server serves: alpha, beta",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert response.status_code == 404


def test_the_openai_client_raises_not_found_for_a_model_not_served(server: ServerThread) -> None:
    with openai_client(server.url) as client, pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gamma", messages=USER)
    assert info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize(("path", "body"), POSTS)
@pytest.mark.parametrize("model", [None, "absent"])
def test_with_several_models_a_body_must_name_one(
    server: ServerThread, path: str, body: dict[str, Any], model: str | None
) -> None:
    sent = body if model == "absent" else {**body, "model": None}
    error = check_error(
        httpx.post(f"{server.url}{path}", json=sent),
        400,
        param="model",
        code="missing_required_parameter",
    )
    assert error["message"].endswith("this server serves several models: alpha, beta")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": 7, "prompt": "x"}, "model", "invalid_type"),
        ([{"model": "alpha"}], None, None),
        ("alpha", None, None),
    ],
)
def test_a_body_that_cannot_name_a_model_is_a_400(
    server: ServerThread, body: Any, param: str | None, code: str | None
) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    check_error(response, 400, param=param, code=code)


def test_the_body_limit_and_json_errors_come_before_the_model(server: ServerThread) -> None:
    headers = {"content-type": "application/json"}
    broken = httpx.post(f"{server.url}/v1/completions", content=b"{nope", headers=headers)
    check_error(broken, 400, code="invalid_json")


def test_metrics_label_each_engines_series_with_its_model(
    app: Starlette, server: ServerThread
) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for name, engine in app.state.engines.items():
        assert (
            f'inlinelm_kv_blocks_total{{model_name="{name}"}} {float(engine.num_kv_blocks)}' in text
        )
        assert f'inlinelm_ttft_seconds_count{{model_name="{name}"}}' in text
    assert text.count("# TYPE inlinelm_kv_blocks_total gauge") == 1


def test_health_names_the_engine_that_cannot_serve() -> None:
    app = create_app(CONFIGS)
    with TestClient(app, base_url=LOCAL) as client:
        assert client.get("/health").json() == {"status": "ok"}
        app.state.engines["beta"].close()
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unhealthy", "reason": "beta: closed"}
        alpha = client.post("/v1/completions", json={"model": "alpha", "prompt": "x"})
        beta = client.post("/v1/completions", json={"model": "beta", "prompt": "x"})
    assert alpha.status_code == 200
    check_error(beta, 503, code="engine_closed")


def test_an_engine_that_fails_to_start_fails_the_app_and_every_engine_is_closed(
    tmp_path: Path,
) -> None:
    broken = EngineConfig(model=str(tmp_path / "missing"), num_threads=1)
    app = create_app({"alpha": CONFIGS["alpha"], "broken": broken})
    with pytest.raises(Exception, match="missing"), TestClient(app, base_url=LOCAL):
        pass
    assert [e.health() for e in app.state.engines.values()] == [(False, "closed")] * 2


def test_a_mapping_names_its_engines_itself() -> None:
    engine = Engine(ECHO)
    with pytest.raises(ValueError, match="model_name names a single engine"):
        openai_router({"a": engine}, model_name="b")
    with pytest.raises(ValueError, match="model_name names a single engine"):
        create_app({"a": engine}, model_name="b")
    with pytest.raises(ValueError, match="empty"):
        openai_router({})
    with pytest.raises(ValueError, match="non-empty string"):
        openai_router({"": engine})


def test_a_new_endpoint_is_one_dispatch_of_a_handler_taking_the_parsed_body() -> None:
    """The pattern the module docstring shows (``/v1/embeddings`` and the like): each
    model's handler gets the body read once, parsed, and meant for it."""
    engines = {name: Engine(config) for name, config in CONFIGS.items()}
    table = ModelTable(
        {name: OpenAIServing(e, name, 1000, 0.0, 4) for name, e in engines.items()}, 1000
    )

    class Echoing:
        def __init__(self, serving: OpenAIServing) -> None:
            self.name = serving.model_name

        async def create(self, request: Request, body: JsonBody) -> Response:
            assert body.arrival > 0
            return JSONResponse({"model": self.name, "data": body.data, "size": body.size})

    app = Starlette(
        routes=[Route("/v1/echo", table.dispatch(lambda s: Echoing(s).create), methods=["POST"])]
    )
    with TestClient(app, base_url=LOCAL) as client:
        sent = b'{"model": "beta", "input": [1, 2]}'
        reply = client.post("/v1/echo", content=sent)
        assert reply.json() == {
            "model": "beta",
            "data": {"model": "beta", "input": [1, 2]},
            "size": len(sent),
        }
        assert client.post("/v1/echo", json={"model": "gamma"}).status_code == 404
        assert client.post("/v1/echo", content=b"x" * 1001).status_code == 413
