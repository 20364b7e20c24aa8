"""inlinelm against llama.cpp on the same GGUF file, side by side in one run: one request's
decode speed with llama-cpp-python, and inlinelm's engine with the file's quantized blocks
(the default, ``quantization="auto"``) and with float32 (``"none"``).

The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), the same prompt tokens, greedy,
``--new-tokens`` tokens, the same thread count for both (torch's intra-op threads; llama.cpp's
``n_threads``), each engine in a process of its own (:func:`run` says why). ms per token
counts the decode only (from the first token to the last), the three taking turns for
``--rounds`` rounds; medians. llama-cpp-python is not one of
inlinelm's dependencies: build it for the CPU first (its sdist's llama.cpp, with the
instruction sets spelled out: ``-DGGML_NATIVE=OFF -DGGML_AVX512=ON ...``; a native build
has died with "Illegal instruction" on these VMs)::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DLLAMA_CURL=OFF" \\
      pip install llama-cpp-python

Prints a table and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _common import load_average, median, workers, write_json

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ENGINES = ("llama.cpp", "inlinelm quantized", "inlinelm float32")


def llama_cpp_ms_per_token(llm: Any, prompt: list[int], new: int) -> float:
    """Greedy decode of ``new`` tokens after ``prompt``: ms per token after the first."""
    llm.reset()
    stamps = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == new:
            break
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


async def inlinelm_ms_per_token(engine: Any, prompt: list[int], new: int) -> float:
    from inlinelm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    stamps = []
    async for _ in engine.stream(prompt, params):
        stamps.append(time.perf_counter())
    # NOTE: an output may carry several tokens; the stream's last one is the last token
    return (stamps[-1] - stamps[0]) / (new - 1) * 1e3


def _llama_cpp_child(gguf: str, threads: int, conn: Any) -> None:
    """llama.cpp's side of :func:`run`: answers each ``(prompt, new)`` with a round's ms
    per token; None ends it."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    conn.send(llm.tokenize(PROMPT.encode(), add_bos=False))
    while (job := conn.recv()) is not None:
        conn.send(llama_cpp_ms_per_token(llm, *job))
    llm.close()


def _inlinelm_child(quantization: str, threads: int, conn: Any) -> None:
    """An inlinelm engine's side of :func:`run`, as :func:`_llama_cpp_child`."""
    from inlinelm import Engine

    async def serve() -> None:
        engine = Engine(quantization=quantization, num_threads=threads)
        await engine.start()
        conn.send(None)
        # NOTE: the loop waits on the pipe only while no request is in flight
        while (job := conn.recv()) is not None:
            conn.send(await inlinelm_ms_per_token(engine, *job))
        await engine.aclose()

    asyncio.run(serve())


def run(rounds: int, new: int, threads: int) -> dict[str, Any]:
    """Each engine in a process of its own, taking turns. (Two engines in one process run
    two OpenMP thread teams; with more OpenMP threads than cores, GNU OpenMP stops spinning
    and wakes each team by futex at every op, docs/architecture.md's "CPU threads": the
    default model's step with int8 weights went from 9 to 14 ms here.)"""
    import llama_cpp

    from inlinelm.gpu.loading.model_files import resolve_model

    gguf = resolve_model("default").source
    targets = {
        "llama.cpp": (_llama_cpp_child, (gguf, threads)),
        "inlinelm quantized": (_inlinelm_child, ("auto", threads)),
        "inlinelm float32": (_inlinelm_child, ("none", threads)),
    }
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    with workers(targets) as conns:
        prompt = conns["llama.cpp"].recv()
        for name in ENGINES[1:]:
            conns[name].recv()  # started
        for name in ENGINES:  # warm-up
            conns[name].send((prompt, 8))
            conns[name].recv()
        for _ in range(rounds):
            for name in ENGINES:
                conns[name].send((prompt, new))
                times[name].append(conns[name].recv())
    return {
        "gguf": gguf,
        "prompt_tokens": len(prompt),
        "threads": threads,
        "llama_cpp_python": llama_cpp.__version__,
        "ms_per_token": {name: median(v) for name, v in times.items()},
        "all_ms_per_token": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("vs_llama_cpp.py needs llama-cpp-python (see this script's docstring)")
    threads = torch.get_num_threads()
    print(f"vs_llama_cpp: {threads} threads; load average {load_average()}", flush=True)
    report = run(args.rounds, args.new_tokens, threads)
    ms = report["ms_per_token"]
    base = ms["llama.cpp"]
    print(f"\none request, {args.new_tokens} new tokens, greedy: ms per token (medians)")
    print("| engine | ms per token | / llama.cpp |")
    print("|---|---|---|")
    for name in ENGINES:
        print(f"| {name} | {ms[name]:.2f} | {ms[name] / base:.2f}x |")
    report["load_average"] = load_average()
    print(f"load average {report['load_average']}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
