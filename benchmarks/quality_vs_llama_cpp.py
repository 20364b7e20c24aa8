"""Issue 24 item 3: how often each GGUF type's top-1 token agrees with float32's, for
inlinelm (``quantization="auto"``: the file's blocks, or Q8_0 blocks of a type the kernel does
not compute) and for llama-cpp-python on the same file,
measured the same way, side by side in one run.

The float32 model is the default model's weights as float32 (its Q4_1 file dequantized),
written as an F32 GGUF file; llama.cpp's own quantizer (``llama_model_quantize``) makes a
file of each type from it. Teacher-forced on float32's greedy answers to 32 varied prompts
(64 tokens each, ``_common.quality_prompts``): at each answer position, the top-1 token of
the quantized model given the same prefix, against float32's. inlinelm computes both
from its own loads of the files; llama.cpp returns its logits for every position
(``logits_all``). Also shown: inlinelm with the file dequantized to float32
(``quantization="none"``: the file's own rounding alone) and llama.cpp on the F32 file
(its kernels' own difference from ours).

Needs llama-cpp-python (``benchmarks/README.md`` says how to build it here). Prints a table
and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' GGUF writer

import torch
from tests.gpu.loading.gguf_writer import write_family_gguf
from tests.gpu.reference import load_ours, prefill_logits

from _common import load_average, quality_prompts, write_json
from inlinelm.gpu.loading.model_files import resolve_model

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0")
"""llama.cpp's file types (``LLAMA_FTYPE_MOSTLY_*``), best first. A K-quant needs rows of
256 values: llama.cpp gives the default model's 576-wide matrices a fallback type
(``llama_tensor_get_type``), so its K files are K-quants only where rows allow."""


def quantize(source: Path, out: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {code}")


def top1_ours(
    path: Path, mode: str, sequences: list[list[int]], starts: list[int]
) -> list[torch.Tensor]:
    folder = resolve_model(str(path), quantized=mode != "none").folder
    model = load_ours(folder, mode)
    # NOTE: the cache the engine keeps for it (kv_cache_dtype="auto"): float16 where the
    # weights are block-quantized, as llama.cpp's is
    kv_dtype = torch.float16 if mode != "none" else torch.float32
    return [
        prefill_logits(model, ids, kv_dtype)[start - 1 : -1].argmax(-1)
        for ids, start in zip(sequences, starts, strict=True)
    ]


def top1_llama_cpp(path: Path, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    from llama_cpp import Llama

    longest = max(len(ids) for ids in sequences)
    llm = Llama(
        model_path=str(path),
        n_ctx=longest + 16,
        n_batch=longest + 16,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    with closing(llm):
        out = []
        for ids, start in zip(sequences, starts, strict=True):
            llm.reset()
            llm.eval(ids)
            scores = torch.from_numpy(llm.scores[: len(ids)].copy())
            out.append(scores[start - 1 : -1].argmax(-1))
    return out


def agreement(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    agree = sum(int((g == w).sum()) for g, w in zip(got, want, strict=True))
    return agree / sum(len(w) for w in want)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--types", nargs="*", default=list(TYPES))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from inlinelm import Engine, SamplingParams

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="quality-"))
    os.environ["INLINELM_CACHE"] = str(root / "cache")
    report: dict[str, Any] = {"load_average_before": load_average(), "types": {}}
    try:
        # NOTE: the user's own cache holds the default model's float32 conversion
        float_folder = resolve_model("default").folder
        source = root / "smollm2-135m-F32.gguf"
        write_family_gguf(float_folder, source)
        tokenizer = AutoTokenizer.from_pretrained(str(float_folder))
        prompts = quality_prompts(tokenizer)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        with closing(Engine(model=str(source), quantization="none", num_threads=2)) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
        sequences = [[*p, *o.outputs[0].token_ids] for p, o in zip(prompts, outs, strict=True)]
        starts = [len(p) for p in prompts]
        want = top1_ours(source, "none", sequences, starts)
        report["llama.cpp F32"] = agreement(top1_llama_cpp(source, sequences, starts), want)
        for ftype in args.types:
            path = root / f"smollm2-135m-{ftype}.gguf"
            quantize(source, path, ftype)
            row = {
                "file_mib": path.stat().st_size / 2**20,
                "inlinelm quantized (auto)": agreement(
                    top1_ours(path, "auto", sequences, starts), want
                ),
                "inlinelm float32 (none)": agreement(
                    top1_ours(path, "none", sequences, starts), want
                ),
                "llama.cpp": agreement(top1_llama_cpp(path, sequences, starts), want),
            }
            report["types"][ftype] = row
            print(ftype, {k: round(v, 4) for k, v in row.items()}, flush=True)
            path.unlink()
            shutil.rmtree(root / "cache", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["load_average_after"] = load_average()
    print(f"\nload average {report['load_average_before']} -> {report['load_average_after']}")
    print(
        f"llama.cpp on the F32 file agrees with inlinelm's float32 at {report['llama.cpp F32']:.4f}\n"
    )
    print(
        "| file type | MiB | inlinelm quantized (auto) | llama.cpp | inlinelm float32 of the file (none) |"
    )
    print("|---|---|---|---|---|")
    for ftype, row in report["types"].items():
        print(
            f"| {ftype} | {row['file_mib']:.0f} | {row['inlinelm quantized (auto)']:.4f} "
            f"| {row['llama.cpp']:.4f} | {row['inlinelm float32 (none)']:.4f} |"
        )
    write_json(args.json, report)


if __name__ == "__main__":
    main()
