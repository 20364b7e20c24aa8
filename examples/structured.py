"""Structured output and tool calls: in Python with ``SamplingParams(structured=...)``, and
over HTTP with the official ``openai`` client (``response_format``, ``tools``), including
a follow-up turn that hands the tool's result back.

    python examples/structured.py     # serves the default model in-process

``INLINELM_EXAMPLE_RUNNER=echo`` runs it without weights: the echo answers with its prompt,
which fits no schema, so the answers print as plain text, no calls made up.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from openai import OpenAI

from inlinelm import Engine, EngineConfig, SamplingParams
from inlinelm.api import create_app
from inlinelm.structured import StructuredOutput

RUNNER = os.environ.get("INLINELM_EXAMPLE_RUNNER", "model")
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def in_python() -> None:
    """A JSON Schema on a chat, straight on the engine."""
    async with Engine(model="default", runner=RUNNER) as engine:
        params = SamplingParams(
            structured=StructuredOutput.json_schema(CITY), max_tokens=64, temperature=0
        )
        messages = [{"role": "user", "content": "The largest city of France, as JSON."}]
        final = await engine.chat(messages, params)
        print("python:", final.text, f"[{final.finish_reason}]")


@contextmanager
def in_process_server() -> Iterator[str]:
    """Serve the default model with uvicorn on a free port of 127.0.0.1, in a thread."""
    config = EngineConfig(model="default", runner=RUNNER)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join()


def over_http(base_url: str) -> None:
    """response_format, then a forced tool call, then the follow-up turn with its result."""
    client = OpenAI(base_url=base_url, api_key="unused")
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY},
        },
        max_tokens=64,
        temperature=0,
    )
    print("response_format:", reply.choices[0].message.content)

    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    message = reply.choices[0].message
    print("finish_reason:", reply.choices[0].finish_reason)
    if not message.tool_calls:
        print("no call:", message.content)
        return
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        print("call:", call.function.name, arguments)
        result = {"city": arguments.get("city"), "temperature_c": 12}  # a stand-in tool
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    reply = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER_TOOL], max_tokens=64, temperature=0
    )
    print("answer:", reply.choices[0].message.content)


def main() -> None:
    asyncio.run(in_python())
    with in_process_server() as base_url:
        over_http(base_url)


if __name__ == "__main__":
    main()
