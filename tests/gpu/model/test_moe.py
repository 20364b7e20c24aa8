"""The sparse MoE MLP against transformers' own Mixtral and Qwen3-MoE blocks (same random
weights, float32 on a CPU); the grouped path's routing, permutation and offsets on a CPU
with a per-group reference GEMM in place of the CUDA one; and, on a CUDA device, the
grouped bfloat16 path against the float32 CPU one and inside a CUDA graph.

Tolerance (float32): every output is a sum of ``k`` weighted expert outputs, each a dot
product of length ``I`` over activations that are dot products of length ``H`` (the router
logits too). A float32 sum of ``n`` terms is within ``n * eps`` of the exact one relative
to the terms' magnitudes, so two orders of summation agree within
``(H + I + k) * eps * max|y|``; that is the ``atol`` of :func:`f32_atol`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from inlinelm.gpu.model.config import MoEConfig
from inlinelm.gpu.model.kernels import TorchKernels
from inlinelm.gpu.model.layers.linear import onednn_packing_available
from inlinelm.gpu.model.layers.moe import SparseMoE, grouped_experts, route, torch_grouped_gemm

HIDDEN, INTER = 64, 32

# (family, experts, top_k, renormalize): Mixtral always renormalises; Qwen3-MoE as asked.
CASES = [
    ("mixtral", 8, 2, True),
    ("mixtral", 4, 1, True),
    ("qwen3_moe", 8, 2, False),
    ("qwen3_moe", 8, 2, True),
    ("qwen3_moe", 4, 1, False),
    ("qwen3_moe", 4, 2, True),
]


def reference_block(family: str, experts: int, top_k: int, renormalize: bool) -> Any:
    """transformers' sparse block with random weights (eager experts: its reference loop)."""
    if family == "mixtral":
        cfg: Any = MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
        )
    else:
        cfg = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=renormalize,
        )
    cfg._experts_implementation = "eager"
    block_class: Any = MixtralSparseMoeBlock if family == "mixtral" else Qwen3MoeSparseMoeBlock
    block = block_class(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * HIDDEN**-0.5)
    return block.eval()


def ours_from(block: Any, top_k: int, renormalize: bool) -> SparseMoE:
    """Our layer holding ``block``'s weights, filled the way the loader fills it."""
    num, inter = block.experts.gate_up_proj.shape[0], INTER
    moe = MoEConfig(num, top_k, inter, renormalize)
    ours = SparseMoE(HIDDEN, moe, TorchKernels())
    views = ours.expert_weights()
    with torch.no_grad():
        ours.gate.weight_t.copy_(block.gate.weight.t())
        for e in range(num):
            gate_up, down = block.experts.gate_up_proj[e], block.experts.down_proj[e]
            views[f"experts.{e}.gate_proj.weight"].copy_(gate_up[:inter])
            views[f"experts.{e}.up_proj.weight"].copy_(gate_up[inter:])
            views[f"experts.{e}.down_proj.weight"].copy_(down)
    return ours.eval()


def f32_atol(want: torch.Tensor, top_k: int) -> float:
    """See the module docstring."""
    return (HIDDEN + INTER + top_k) * torch.finfo(torch.float32).eps * want.abs().max().item()


def reference_out(block: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = block(x.unsqueeze(0))[0]
    return out


def per_group_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM's contract, one plain matmul per group (host-read offsets)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize(("family", "experts", "top_k", "renormalize"), CASES)
def test_the_layer_equals_transformers_block(
    family: str, experts: int, top_k: int, renormalize: bool, tokens: int
) -> None:
    torch.manual_seed(tokens * 100 + experts * 10 + top_k)
    block = reference_block(family, experts, top_k, renormalize)
    ours = ours_from(block, top_k, renormalize)
    x = torch.randn(tokens, HIDDEN)
    want = reference_out(block, x)
    with torch.no_grad():
        got = ours(x)
        grouped = ours.forward_grouped(x, gemm=per_group_gemm)
    atol = f32_atol(want, top_k)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    torch.testing.assert_close(grouped, want, rtol=0, atol=atol)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_the_grouped_path_runs_torch_grouped_mm_on_the_cpu(tokens: int) -> None:
    """torch's grouped GEMM has a CPU kernel too: the CUDA path's exact call sequence."""
    torch.manual_seed(tokens)
    block = reference_block("qwen3_moe", 8, 2, True)
    ours = ours_from(block, 2, True)
    x = torch.randn(tokens, HIDDEN)
    want = reference_out(block, x)
    with torch.no_grad():
        got = ours.forward_grouped(x, gemm=torch_grouped_gemm)
    torch.testing.assert_close(got, want, rtol=0, atol=f32_atol(want, 2))


def test_an_expert_no_token_picks_is_never_run() -> None:
    """Expert 7's router row scores every (positive) token far below the rest, and its
    weights are NaN: any computation with them would poison the output."""
    torch.manual_seed(7)
    block = reference_block("qwen3_moe", 8, 2, True)
    with torch.no_grad():
        block.gate.weight[7] = -1.0
        block.experts.gate_up_proj[7] = float("nan")
        block.experts.down_proj[7] = float("nan")
    ours = ours_from(block, 2, True)
    x = torch.randn(16, HIDDEN).abs()
    with torch.no_grad():
        _, chosen = route(ours.gate(x), 2, True)
        assert 7 not in chosen.flatten().tolist()
        want = reference_out(block, x)
        got, grouped = ours(x), ours.forward_grouped(x, gemm=per_group_gemm)
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, rtol=0, atol=f32_atol(want, 2))
    torch.testing.assert_close(grouped, want, rtol=0, atol=f32_atol(want, 2))


@pytest.mark.skipif(
    not onednn_packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN"
)
def test_an_onednn_packed_router_routes_the_same() -> None:
    torch.manual_seed(3)
    block = reference_block("mixtral", 8, 2, True)
    ours = ours_from(block, 2, True)
    assert ours.gate.pack_for_onednn()
    x = torch.randn(5, HIDDEN)
    want = reference_out(block, x)
    with torch.no_grad():
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=0, atol=f32_atol(want, 2))


def test_expert_weights_alias_the_parameters_after_to_empty() -> None:
    """The loader's order: built on meta, cast, ``to_empty``, then the views filled."""
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=INTER, renormalize=False)
    with torch.device("meta"):
        layer = SparseMoE(HIDDEN, moe, TorchKernels())
    layer = layer.to(torch.float32).to_empty(device="cpu")
    assert all(isinstance(p, torch.nn.Parameter) for p in layer.parameters())
    views = layer.expert_weights()
    assert len(views) == 3 * 4
    for e in range(4):
        views[f"experts.{e}.gate_proj.weight"].fill_(e + 0.25)
        views[f"experts.{e}.up_proj.weight"].fill_(e + 0.5)
        views[f"experts.{e}.down_proj.weight"].fill_(e + 0.75)
        assert views[f"experts.{e}.gate_proj.weight"].shape == (INTER, HIDDEN)
        assert views[f"experts.{e}.down_proj.weight"].shape == (HIDDEN, INTER)
    gate_up, down = layer.gate_up_weights(), layer.down_weights()
    assert gate_up.shape == (4, HIDDEN, 2 * INTER) and down.shape == (4, INTER, HIDDEN)
    for e in range(4):
        assert (gate_up[e, :, :INTER] == e + 0.25).all()
        assert (gate_up[e, :, INTER:] == e + 0.5).all()
        assert (down[e] == e + 0.75).all()


def test_the_cpu_never_takes_the_grouped_path() -> None:
    layer = SparseMoE(HIDDEN, MoEConfig(4, 2, INTER, True), TorchKernels())
    for dtype in (torch.float32, torch.bfloat16):
        assert not layer.runs_grouped(torch.device("cpu"), dtype)


def test_the_routing_of_grouped_experts_matches_a_hand_computed_case() -> None:
    """Three tokens, top-2 of 4 experts; identity-like experts expose the permutation."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # expert e multiplies by e + 1
    gate_up = torch.eye(2).repeat(4, 1, 1) * scale[:, None, None]  # [E, 2, 2]
    down = torch.eye(2).repeat(4, 1, 1)

    seen: list[list[int]] = []

    def gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        seen.append(offs.tolist())
        return per_group_gemm(a, b, offs)

    # An identity activation: the experts are plain scalings, so the sum is easy to write.
    got = grouped_experts(x, weights, experts, gate_up, down, lambda h: h, gemm)
    assert seen == [[2, 2, 5, 6], [2, 2, 5, 6]]  # experts 0 (2 slots), 1 (0), 2 (3), 3 (1)
    per_token = (weights * (experts + 1)).sum(dim=1, keepdim=True)
    want = x * per_token
    torch.testing.assert_close(got, want)


# -- on the device --------------------------------------------------------------------------


def _cuda_layer(layer: SparseMoE) -> SparseMoE:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        pytest.skip("the grouped bfloat16 GEMM without a host sync needs SM90 or SM100")
    cuda = copy.deepcopy(layer).to(device=device, dtype=torch.bfloat16)
    assert cuda.runs_grouped(device, torch.bfloat16)
    return cuda


BF16_HIDDEN, BF16_INTER = 256, 128


def _bf16_layer() -> SparseMoE:
    """A float32 CPU layer whose weights are bfloat16 values."""
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=BF16_INTER, renormalize=True)
    layer = SparseMoE(BF16_HIDDEN, moe, TorchKernels())
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_((torch.randn_like(param) * BF16_HIDDEN**-0.5).bfloat16().float())
    return layer.eval()


def _bf16_inputs(tokens: int) -> torch.Tensor:
    return torch.randn(tokens, BF16_HIDDEN).bfloat16().float()


def assert_bf16_close_to_f32(run: Callable[[torch.Tensor], torch.Tensor], tokens: int) -> None:
    """``run`` (the layer in bfloat16 somewhere) against the float32 CPU per-expert path
    of :func:`_bf16_layer`, on the same bfloat16-valued weights and inputs.

    bfloat16 (unit roundoff ``u = 2**-9``) rounds the logits (the GEMMs accumulate in
    float32: each logit moves by up to ``u * max|logit|``, each softmax weight by up to
    twice that, relative), the weights, the gate_up output, the SiLU and its product, the
    down output, the weighting and the sum: ``(2 * max|logit| + 7) * u`` of the output's
    magnitude, doubled for the errors the down projection's sum carries. A token whose
    k-th and (k+1)-th float32 router probabilities are within the logits' error of each
    other may pick another expert in bfloat16: the inputs are drawn among tokens clear of
    that."""
    cpu = _bf16_layer()
    u = 2.0**-9
    with torch.no_grad():
        candidates = _bf16_inputs(4 * tokens)
        logits = cpu.gate(candidates)
        max_logit = logits.abs().max().item()
        top = torch.softmax(logits, dim=-1).topk(3, dim=-1).values
        clear = top[:, 1] - top[:, 2] > 4 * u * (max_logit + 1)
        x = candidates[clear][:tokens]
        assert len(x) == tokens
        want = cpu.forward_per_expert(x)
        got = run(x).float().cpu()
    atol = 2 * (2 * max_logit + 7) * u * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("tokens", [1, 64])
def test_the_grouped_path_in_bf16_on_the_cpu_is_within_the_bf16_bound(tokens: int) -> None:
    """The CUDA test's bound, checked here with torch's CPU grouped GEMM in bfloat16."""
    layer = copy.deepcopy(_bf16_layer()).to(torch.bfloat16)
    assert_bf16_close_to_f32(lambda x: layer.forward_grouped(x.bfloat16()), tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_the_grouped_bf16_cuda_path_equals_the_float32_cpu_path(tokens: int) -> None:
    """See :func:`assert_bf16_close_to_f32` for the tolerance."""
    layer = _cuda_layer(_bf16_layer())
    assert_bf16_close_to_f32(lambda x: layer(x.to("cuda", torch.bfloat16)), tokens)


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_layer_with_new_inputs() -> None:
    """Captured once at 32 tokens; each replay routes new tokens to other experts."""
    layer = _cuda_layer(_bf16_layer())
    static_x = _bf16_inputs(32).to("cuda", torch.bfloat16)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            layer(static_x)  # warm-up off the capture stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = layer(static_x)
    for _ in range(3):
        x = _bf16_inputs(32).to("cuda", torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            want = layer(x)
        torch.testing.assert_close(static_out, want)
    graph.reset()
