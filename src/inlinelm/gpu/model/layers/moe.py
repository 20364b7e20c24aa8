"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router picks ``top_k`` of
``num_experts`` gated SiLU experts per token, and the token's output is their weighted sum.

The experts run one of two ways, with one result:

- **per expert** (what a CPU runs, and CUDA off the grouped path): one sort groups the
  token slots by expert; each expert that got tokens runs its two matmuls over its rows,
  and one ``index_add_`` adds them back. A Python loop over at most ``num_experts``
  experts, never over tokens; the counts are read on the host (on CUDA, a sync).
- **grouped** (CUDA, bfloat16, SM90/SM100): the same grouping computed on the device (a
  sort and a ``searchsorted`` for the offsets), then one grouped GEMM for gate_up and one
  for down over every expert. Nothing is read on the host, so a CUDA graph can hold it.

The grouped GEMM is PyTorch's (``torch.nn.functional.grouped_mm``: a CUTLASS kernel built
into the CUDA wheel), not FlashInfer's ``cutlass_fused_moe``: it needs no JIT build (that
TensorRT-LLM module is among FlashInfer's heaviest) and no extra package on the machine,
its bfloat16 path on Hopper reads the offsets on the device (pytorch/pytorch#169970: it
captures on SM90+, the fallback elsewhere syncs), and it takes the checkpoint's
[gate | up] layout as is (``cutlass_fused_moe`` wants [up | gate]). A fused kernel saves
launches, which a CUDA graph already removes: sgl-project/sglang#21872 measured FlashInfer's
7% faster than SGLang's Triton MoE kernel without graphs and 6-14% slower with them (FP8,
H100).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inlinelm.gpu.model.config import MoEConfig
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.linear import Linear

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``gemm(a, b, offs)``: rows ``offs[g-1]:offs[g]`` of ``a`` [S, K] times ``b[g]`` [K, N],
stacked to [S, N]; ``offs`` [G] int32 holds each group's end row."""

GROUPED_GEMM_ARCHS = (9, 10)
"""Compute capability majors whose bfloat16 grouped GEMM needs no host sync (Hopper,
Blackwell datacenter); PyTorch falls back to a host loop elsewhere."""


def torch_grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """PyTorch's grouped GEMM (see :data:`GroupedGemm`)."""
    return F.grouped_mm(a, b, offs=offs)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token and their weights, as transformers computes them:
    a float32 softmax over all experts, the top ``k`` (renormalised to sum 1 if asked), the
    weights cast back to the logits' dtype (Qwen3-MoE's cast; Mixtral's block weights in
    float32 and rounds after the product: the same in float32, one rounding apart in 16
    bits). Returns (weights [T, k], expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    gemm: GroupedGemm = torch_grouped_gemm,
) -> torch.Tensor:
    """The experts' weighted sum by grouped GEMMs, with no host sync: any device.

    ``x`` [T, H]; ``weights``, ``experts`` [T, k] from :func:`route`; ``gate_up``
    [E, H, 2I] and ``down`` [E, I, H] (either memory order); ``act`` maps [S, 2I] to [S, I].
    """
    num_tokens, top_k = experts.shape
    # 1) the T*k token slots sorted by expert (stable: a token's slots keep their order);
    #    offs[e] is the end of expert e's rows, every expert counted.
    sorted_ids, order = torch.sort(experts.flatten(), stable=True)
    ids = torch.arange(gate_up.shape[0], device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)
    # 2) each slot's token through its expert, weighted.
    h = act(gemm(x.index_select(0, order // top_k), gate_up, offs))
    h = gemm(h, down, offs) * weights.flatten().index_select(0, order).unsqueeze(1)
    # 3) back to token order; a token's k slots summed (no atomics: deterministic).
    slots = torch.empty_like(h).index_copy_(0, order, h)
    return slots.view(num_tokens, top_k, -1).sum(dim=1)


class SparseMoE(nn.Module):
    """Mixtral's / Qwen3-MoE's sparse MLP block: ``x`` [T, H] -> [T, H].

    ``gate`` is the router (a :class:`Linear` without bias). The experts live in two
    parameters in the checkpoint's orientation, ``gate_up_proj`` [E, 2I, H] (each
    expert's gate rows, then its up rows) and ``down_proj`` [E, H, I]: K-major, the
    grouped GEMM's usual operand. On this project's CPUs the per-expert matmuls read it
    about as fast as the transposed "in, out" layout :class:`Linear` keeps (measured on
    ``benchmarks/moe_step.py``'s shapes: within 3% at one token; at 32, 1.24x faster with
    experts of 256 and 512, 6% slower with 1408). :meth:`expert_weights` exposes them per
    expert.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, kernels: Kernels) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.intermediate_size = moe.intermediate_size
        self.renormalize = moe.renormalize
        self.act = kernels.silu_and_mul
        self.gate = Linear(hidden_size, moe.num_experts)
        num, inter = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, inter))

    def gate_up_weights(self) -> torch.Tensor:
        """Every expert's [gate | up] as [E, H, 2I] (a transposed view: ``x @ w``)."""
        return self.gate_up_proj.data.transpose(1, 2)

    def down_weights(self) -> torch.Tensor:
        """Every expert's down projection as [E, I, H] (a transposed view)."""
        return self.down_proj.data.transpose(1, 2)

    def expert_weights(self) -> dict[str, torch.Tensor]:
        """Writable views into the expert storage, in checkpoint orientation, by name:
        ``experts.{e}.gate_proj.weight`` [I, H], ``experts.{e}.up_proj.weight`` [I, H] and
        ``experts.{e}.down_proj.weight`` [H, I] for every expert ``e``. They alias the
        parameters (the loader copies into them), so they are built on each call, valid
        until the parameters are replaced (``to_empty``, ``to``)."""
        inter = self.intermediate_size
        gate_up, down = self.gate_up_proj.data, self.down_proj.data
        views: dict[str, torch.Tensor] = {}
        for e in range(self.num_experts):
            views[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            views[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            views[f"experts.{e}.down_proj.weight"] = down[e]
        return views

    def runs_grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether :meth:`forward` takes the grouped path on ``device`` in ``dtype``, which
        is also whether a CUDA graph can capture the layer (the per-expert path syncs)."""
        return (
            device.type == "cuda"
            and dtype == torch.bfloat16
            and self.hidden_size % 8 == 0  # 16-byte rows for the kernel's TMA loads
            and self.intermediate_size % 8 == 0
            and hasattr(F, "grouped_mm")  # torch >= 2.10
            and torch.cuda.get_device_capability(device)[0] in GROUPED_GEMM_ARCHS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H] -> [T, H]: each token's top-k experts, weighted and summed."""
        if self.runs_grouped(x.device, x.dtype):
            return self.forward_grouped(x)
        return self.forward_per_expert(x)

    def forward_grouped(
        self, x: torch.Tensor, gemm: GroupedGemm = torch_grouped_gemm
    ) -> torch.Tensor:
        """The grouped path (:func:`grouped_experts`) on any device; ``gemm`` is the seam
        the CPU tests replace."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return grouped_experts(
            x, weights, experts, self.gate_up_weights(), self.down_weights(), self.act, gemm
        )

    def forward_per_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The per-expert path: one matmul pair per expert that got tokens, over its rows
        of the slots sorted by expert; one ``index_add_`` sums each token's slots in
        expert order (transformers' eager order of additions)."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts: list[int] = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        spans = _spans(counts)
        gate_up, down = self.gate_up_weights(), self.down_weights()
        # NOTE: the experts write their rows of one buffer, so the activation and the
        # weighting run once over every slot instead of once per expert.
        xs = x.index_select(0, tokens)
        h = x.new_empty(len(tokens), gate_up.shape[2])
        for e, start, end in spans:
            torch.mm(xs[start:end], gate_up[e], out=h[start:end])
        h = self.act(h)
        y = x.new_empty(len(tokens), self.hidden_size)
        for e, start, end in spans:
            torch.mm(h[start:end], down[e], out=y[start:end])
        y *= weights.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tokens, y)


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, rows grouped in order."""
    spans, start = [], 0
    for e, count in enumerate(counts):
        if count:
            spans.append((e, start, start + count))
            start += count
    return spans
