"""The official ``openai`` client against inlinelm: a running ``inlinelm serve``, or a server
this script starts in-process.

    inlinelm serve --port 8000 &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

    python examples/openai_client.py      # no --base-url: serves the default model itself

``INLINELM_EXAMPLE_RUNNER=echo`` makes the in-process server echo (tokenizer only);
``inlinelm serve --runner echo`` does the same for the CLI's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from openai import OpenAI

from inlinelm import EngineConfig
from inlinelm.api import create_app


@contextmanager
def in_process_server() -> Iterator[str]:
    """Serve the default model with uvicorn on a free port of 127.0.0.1, in a thread."""
    config = EngineConfig(
        model="default", runner=os.environ.get("INLINELM_EXAMPLE_RUNNER", "model")
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    # `started` turns true once the app's lifespan loaded the model and the socket listens.
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


def talk(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key=os.environ.get("INLINELM_API_KEY", "none"))
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]

    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=64
    )
    print(reply.choices[0].message.content)
    print(
        f"[{reply.usage.completion_tokens} tokens, finish_reason={reply.choices[0].finish_reason}]"
    )

    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0.7, max_tokens=64, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"
    )
    args = parser.parse_args()
    if args.base_url:
        talk(args.base_url)
    else:
        with in_process_server() as base_url:
            talk(base_url)


if __name__ == "__main__":
    main()
