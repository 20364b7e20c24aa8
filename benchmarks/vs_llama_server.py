"""32 requests at once on this CPU: inlinelm with the file's quantized blocks (the default,
``quantization="auto"``) and with float32 (``"none"``) against llama.cpp's own server with
32 parallel slots, on the same GGUF file, side by side in one run (issue 24, item 5).

The default model's GGUF file (Q4_1); e2e_cpu.py's 32 chat prompts (0 to ~500 tokens of
context each, token ids, no shared prefixes), all sent at once, 64 new tokens each, greedy,
EOS ignored; 2 threads each. inlinelm runs its engine (``Engine.stream``) in a process of
its own; llama-server (built from llama-cpp-python's sdist: ``benchmarks/README.md``) in
its own, with ``-np 32``, continuous batching and a context of 32 slots of the longest
request, streaming from ``/completion``. Neither reuses a prompt's cache: the rounds send
the same prompts (inlinelm's prefix cache off, llama-server's ``cache_prompt`` false). Each system is warmed up with one request, then
runs the batch ``--rounds`` times, the three taking turns; medians. Reported: output
tokens/s over the batch's wall time, TTFT p50 and p99 (from sending to the first token).

Prints a table and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, median, percentile, workers, write_json
from e2e_cpu import make_prompts

SYSTEMS = ("llama-server", "inlinelm quantized", "inlinelm float32")


def _summary(ttfts: list[float], wall: float, tokens: int) -> dict[str, float]:
    return {
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "ttft_ms_p50": percentile(ttfts, 50) * 1e3,
        "ttft_ms_p99": percentile(ttfts, 99) * 1e3,
    }


def _inlinelm_child(quantization: str, threads: int, conn: Any) -> None:
    """Answers each ``(prompts, new)`` with one batch's summary; None ends it."""
    from inlinelm import Engine, SamplingParams

    async def one(engine: Any, prompt: list[int], new: int, t0: float) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        first = None
        tokens = 0
        async for out in engine.stream(prompt, params):
            if first is None:
                first = time.perf_counter() - t0
            tokens += len(out.token_ids)
        assert first is not None
        return first, tokens

    async def serve() -> None:
        # NOTE: no prefix cache: each round sends the same prompts, and llama-server's
        # requests ask for none (cache_prompt false)
        engine = Engine(quantization=quantization, num_threads=threads, enable_prefix_caching=False)
        await engine.start()
        conn.send(None)
        while (job := conn.recv()) is not None:
            prompts, new = job
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(engine, p, new, t0) for p in prompts))
            wall = time.perf_counter() - t0
            conn.send(_summary([r[0] for r in results], wall, sum(r[1] for r in results)))
        await engine.aclose()

    asyncio.run(serve())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_child(binary: str, gguf: str, threads: int, context: int, conn: Any) -> None:
    """llama-server's side, as :func:`_inlinelm_child` (the server in a process of its own,
    this child its HTTP client)."""
    import httpx

    port = _free_port()
    server = subprocess.Popen(
        [
            binary,
            "-m",
            gguf,
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            "32",
            "-c",
            str(context),
            "--cont-batching",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--no-webui",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client() as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # NOTE: the server answers /health once loaded
                try:
                    if client.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            else:
                raise RuntimeError("llama-server did not start")
        conn.send(None)

        async def one(client: Any, prompt: list[int], new: int, t0: float) -> tuple[float, int]:
            body = {
                "prompt": prompt,
                "n_predict": new,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "stream": True,
                "cache_prompt": False,
            }
            first, count = 0.0, 0
            async with client.stream("POST", f"{base}/completion", json=body, timeout=600) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[6:])
                    if data.get("content") or data.get("tokens"):
                        if not count:
                            first = time.perf_counter() - t0
                        count += 1
                    if data.get("stop"):
                        count = int(data.get("tokens_predicted", count))
            return first, count

        async def batch(prompts: list[list[int]], new: int) -> dict[str, float]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(limits=limits) as client:
                t0 = time.perf_counter()
                results = await asyncio.gather(*(one(client, p, new, t0) for p in prompts))
                wall = time.perf_counter() - t0
            return _summary([r[0] for r in results], wall, sum(r[1] for r in results))

        while (job := conn.recv()) is not None:
            conn.send(asyncio.run(batch(*job)))
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--server", required=True, help="the llama-server binary")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from inlinelm.gpu.loading.model_files import resolve_model

    files = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(str(files.folder))
    prompts = make_prompts(tokenizer, 32, 500)
    new = args.new_tokens
    context = 32 * (max(map(len, prompts)) + new + 16)
    print(f"vs_llama_server: {args.threads} threads; load average {load_average()}", flush=True)
    targets = {
        "llama-server": (_server_child, (args.server, files.source, args.threads, context)),
        "inlinelm quantized": (_inlinelm_child, ("auto", args.threads)),
        "inlinelm float32": (_inlinelm_child, ("none", args.threads)),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SYSTEMS}
    with workers(targets) as conns:
        for name in SYSTEMS:
            conns[name].recv()  # started
            conns[name].send(([prompts[0]], 8))  # warm-up
            conns[name].recv()
        for _ in range(args.rounds):
            for name in SYSTEMS:
                conns[name].send((prompts, new))
                runs[name].append(conns[name].recv())
                print(f"  {name}: {runs[name][-1]}", flush=True)
    result = {name: {k: median([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    report = {
        "threads": args.threads,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": new,
        "medians": result,
        "runs": runs,
        "load_average": load_average(),
    }
    base = result["llama-server"]["output_tokens_per_s"]
    print(f"\n32 requests, {new} new tokens each, greedy (medians of {args.rounds})")
    print("| system | tokens/s | / llama-server | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|")
    for name in SYSTEMS:
        r = result[name]
        print(
            f"| {name} | {r['output_tokens_per_s']:.1f} | {r['output_tokens_per_s'] / base:.2f}x "
            f"| {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} |"
        )
    print(f"load average {report['load_average']}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
