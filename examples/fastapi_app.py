"""A FastAPI app with its own typed endpoint on the engine, and the OpenAI-compatible API
mounted under ``/llm``.

    python examples/fastapi_app.py --port 8000      # or: uvicorn fastapi_app:app --app-dir examples

    curl http://127.0.0.1:8000/summarize -H 'content-type: application/json' \\
      -d '{"text": "inlinelm runs the model on one thread inside your process."}'
    curl http://127.0.0.1:8000/llm/v1/models

``INLINELM_EXAMPLE_RUNNER=echo`` swaps the model for a scripted echo (tokenizer only).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, Field

from inlinelm import Engine
from inlinelm.api import openai_router

# inlinelm logs on the "inlinelm" logger and configures no handler; uvicorn configures only
# its own loggers. Without these two lines the model's load (seconds) and the "engine
# ready" line are silent (docs/logging.md).
logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("inlinelm").setLevel(logging.INFO)

engine = Engine(model="default", runner=os.environ.get("INLINELM_EXAMPLE_RUNNER", "model"))


class SummarizeRequest(BaseModel):
    text: str = Field(min_length=1, max_length=10_000)
    max_tokens: int = Field(default=64, ge=1, le=256)


class Summary(BaseModel):
    summary: str
    finish_reason: str | None
    num_tokens: int


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine:
        yield


app = FastAPI(title="Summaries", lifespan=lifespan)
app.mount("/llm", openai_router(engine))


@app.post("/summarize")
async def summarize(request: SummarizeRequest) -> Summary:
    messages = [
        {"role": "system", "content": "Summarize the user's text in one sentence."},
        {"role": "user", "content": request.text},
    ]
    out = await engine.chat(messages, temperature=0.0, max_tokens=request.max_tokens)
    return Summary(summary=out.text, finish_reason=out.finish_reason, num_tokens=len(out.token_ids))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
