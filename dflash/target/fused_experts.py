"""A frozen MoE target's routed experts as two fused Triton kernels (`target.experts=fused`).

transformers' `grouped_mm` path sorts the (token, expert) pairs, gathers the tokens' rows into a
sorted copy, runs one grouped GEMM for gate+up, applies SwiGLU in a separate pass, runs the down
grouped GEMM, scales by the routing weights, un-permutes and sums. Here, forward only (the
target is frozen, nothing needs its gradients):

1. routing metadata, from `top_k_index` alone with torch ops and no host sync: each expert's
   pairs in a run of rows padded to a multiple of `BLOCK_M`, a row -> pair table (`S` marks
   padding), and the expert of every `BLOCK_M`-row tile. The tile count is bounded without
   reading the counts (`S + min(E, S) * (BLOCK_M - 1)` rows), so there is no `.item()` and the
   whole layer stays one CUDA graph / one compiled region; tiles past the last expert's rows
   return at once.
2. kernel 1: each tile gathers its tokens' hidden rows straight from `hidden_states` (no sorted
   copy), multiplies by its expert's gate and up rows in one K loop (two accumulators) and writes
   `silu(gate) * up`: the `[S, 2I]` pre-activation never exists.
3. kernel 2: the down projection of those rows, scaled by each pair's routing weight in the
   epilogue and written to the pair's own row (token-major), so the per-token sum over its top-k
   is one strided reduction, no un-permute.

Both GEMMs accumulate in fp32 and round once; the eager experts round after each projection, so
the two agree within bf16 rounding (tests/test_fused_experts.py, on CUDA). Routed experts in the
published FP8 layout (e4m3 weights, one scale per 128 x 128 block, `*_scale_inv`) are read as
they are stored: each weight tile lies inside one scale block, so a tile's product is scaled
once, `dot(a, w_fp8) * s`, and the layer's weights never exist in bf16 (dflash/target/fp8.py
routes `BlockFP8Experts` here when the model's experts implementation is `fused`).

Needs CUDA and triton (the `gpu` extra). The routing metadata is plain torch and is tested on
CPU against a direct construction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from dflash.target.experts_tiling import FP8_BLOCK, ExpertsTiling, KernelTiling, call_tiling, default_tiling

EXPERTS_IMPLEMENTATION = "fused"  # the name under transformers' ALL_EXPERTS_FUNCTIONS
# The same kernels; on FP8 experts the activations are quantized too (w8a8, `quantize_groups`)
# and the GEMMs run on FP8 tensor cores.
W8A8_IMPLEMENTATION = "fused_w8a8"
IMPLEMENTATIONS = (EXPERTS_IMPLEMENTATION, W8A8_IMPLEMENTATION)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK_M = 64  # routing's default row tile (each kernel launch passes its tiling's)


@dataclass(frozen=True)
class Routing:
    """Where each (token, expert) pair's row lies in the expert-sorted, tile-padded layout."""

    row_pair: (
        torch.Tensor
    )  # [rows] int32: the flat pair index (token * top_k + slot) of each row; S = padding
    tile_expert: torch.Tensor  # [rows // BLOCK_M] int32: each tile's expert; num_experts = no rows
    pairs: int  # S = tokens * top_k


def routing(top_k_index: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> Routing:
    """The padded expert-sorted layout of `top_k_index [tokens, top_k]`, without a host sync."""
    expert = top_k_index.reshape(-1).long()
    pairs = expert.numel()
    device = expert.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, expert, torch.ones_like(expert)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(expert, stable=True)  # pairs grouped by expert, each group in pair order
    sorted_expert = expert[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    # An upper bound on the padded rows that needs no count on the host: at most min(E, S)
    # experts hold pairs, each wasting under block_m rows.
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    rows = (rows + block_m - 1) // block_m * block_m
    row_pair = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    row_pair[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, rows, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return Routing(row_pair=row_pair, tile_expert=tile_expert, pairs=pairs)


def quantize_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [R, C]` as e4m3 with one fp32 scale per row and `group` columns ([R, C / group]):
    scale = max|x| / 448 over the group (1e-10 at least), q = x / scale rounded to e4m3. The
    dynamic per-token-group activation quantization of SGLang's and vLLM's block-wise FP8
    kernels and transformers' fine-grained FP8: q * scale is what their FP8 GEMMs multiply."""
    rows, cols = x.shape
    grouped = x.float().reshape(rows, cols // group, group)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-10) / E4M3_MAX
    q = (grouped / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


@functools.cache
def _kernels():
    """The Triton kernels, imported on first use (triton is the `gpu` extra; CPU runs never import it)."""
    import triton

    from dflash.target import fused_experts_kernels

    return triton, fused_experts_kernels.gate_up_swiglu, fused_experts_kernels.down_weighted


def _scale_arguments(scale: Optional[torch.Tensor], placeholder: torch.Tensor) -> dict:
    """An FP8 weight's scale pointer and strides (bf16 weights: a placeholder pointer, never read)."""
    if scale is None:
        return dict(s_ptr=placeholder, stride_se=0, stride_sn=0, stride_sk=0)
    return dict(s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), stride_sk=scale.stride(2))


def _check_launchable(tiling: ExpertsTiling, *, fp8: bool, hidden: int, inter: int) -> None:
    """A ValueError for tiles the kernels cannot run, or FP8 sizes off the 128-wide scale blocks:
    refused before the kernels are imported."""
    refusal = tiling.refusal(fp8)
    if refusal is not None:
        raise ValueError(f"fused experts: {tiling}: {refusal}")
    if fp8 and (inter % FP8_BLOCK or hidden % FP8_BLOCK):
        raise ValueError(
            f"fused FP8 experts need hidden ({hidden}) and intermediate ({inter}) sizes that are "
            f"multiples of {FP8_BLOCK}; use target.experts=grouped_mm"
        )


def _launch_arguments(kernel_tiling: KernelTiling) -> dict:
    """One kernel's launch shape as Triton's launch keywords."""
    return dict(
        BLOCK_N=kernel_tiling.block_n,
        BLOCK_K=kernel_tiling.block_k,
        num_warps=kernel_tiling.warps,
        num_stages=kernel_tiling.stages,
    )


def _shared_arguments(
    route: Routing,
    gate_up_proj: torch.Tensor,
    *,
    hidden: int,
    fp8: bool,
    a8: bool,
    dtype: torch.dtype,
    block_m: int,
) -> dict:
    """The launch keywords both kernels take: the routing tables, the sizes, the numerics."""
    num_experts, two_inter, _ = gate_up_proj.shape
    # fp32 weights (a test's exact reference) multiply in full precision, not TF32
    precision = "ieee" if dtype == torch.float32 else "tf32"
    tables = dict(row_pair_ptr=route.row_pair, tile_expert_ptr=route.tile_expert, pairs=route.pairs)
    sizes = dict(
        num_experts=num_experts, hidden=hidden, inter=two_inter // 2, stride_wn=gate_up_proj.stride(1)
    )
    numerics = dict(FP8=fp8, SCALE_BLOCK=FP8_BLOCK, PRECISION=precision, A8=a8, BLOCK_M=block_m)
    return {**tables, **sizes, **numerics}


def fused_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_scale: Optional[torch.Tensor] = None,
    down_scale: Optional[torch.Tensor] = None,
    fp8_activations: bool = False,
    tiling: ExpertsTiling | None = None,
) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k], for
    `hidden_states [T, H]`, `gate_up_proj [E, 2I, H]` (gate rows first), `down_proj [E, H, I]`
    (bf16, or FP8 e4m3 with `*_scale` [E, rows / 128, cols / 128]). `fp8_activations` (FP8
    weights only): both GEMMs read their inputs quantized by `quantize_groups` (the hidden
    states, then the SwiGLU rows) and multiply FP8 by FP8. `tiling`: the kernels' launch
    shapes (default_tiling's unless given)."""
    fp8 = gate_up_scale is not None
    a8 = fp8 and fp8_activations
    tiling = tiling or default_tiling(gate_up_proj.dtype)
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    _check_launchable(tiling, fp8=fp8, hidden=hidden, inter=inter)
    triton, gate_up_kernel, down_kernel = _kernels()
    x = hidden_states.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    route = routing(top_k_index, num_experts, tiling.block_m)
    tiles = route.tile_expert.numel()
    shared = _shared_arguments(
        route, gate_up_proj, hidden=hidden, fp8=fp8, a8=a8, dtype=x.dtype, block_m=tiling.block_m
    )
    x_in, x_scale = quantize_groups(x) if a8 else (x, x)  # (bf16: a placeholder pointer, never read)
    # Rows no pair fills stay unwritten; A8 quantizes every row, so they must hold finite values.
    rows = route.row_pair.numel()
    activated = (torch.zeros if a8 else torch.empty)(rows, inter, dtype=x.dtype, device=x.device)
    gate_up_kernel[(tiles * triton.cdiv(inter, tiling.gate_up.block_n),)](
        x_ptr=x_in,
        xs_ptr=x_scale,
        w_ptr=gate_up_proj,
        out_ptr=activated,
        top_k=top_k,
        stride_xt=x_in.stride(0),
        stride_xst=x_scale.stride(0),
        stride_we=gate_up_proj.stride(0),
        **_scale_arguments(gate_up_scale, x),
        **shared,
        **_launch_arguments(tiling.gate_up),
    )
    h_in, h_scale = quantize_groups(activated) if a8 else (activated, activated)
    per_pair = torch.empty(route.pairs, hidden, dtype=x.dtype, device=x.device)
    down_kernel[(tiles * triton.cdiv(hidden, tiling.down.block_n),)](
        h_ptr=h_in,
        hs_ptr=h_scale,
        stride_hst=h_scale.stride(0),
        w_ptr=down_proj,
        weights_ptr=top_k_weights.reshape(-1).contiguous(),
        out_ptr=per_pair,
        stride_we=down_proj.stride(0),
        **_scale_arguments(down_scale, x),
        **{**shared, "stride_wn": down_proj.stride(1)},
        **_launch_arguments(tiling.down),
    )
    # One reduction kernel: CUDA sums bf16 in fp32 and rounds once, as sum(dtype=float32).to()
    # does, without writing and re-reading the fp32 [T, H] in between.
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


# One opaque op for torch.compile: a compiled layer keeps the experts inside its graph (no graph
# break, no host sync), and Inductor leaves the Triton launches alone.
@torch.library.custom_op("dflash::fused_experts", mutates_args=())
def _fused_experts_op(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_scale: Optional[torch.Tensor],
    down_scale: Optional[torch.Tensor],
    fp8_activations: bool,
    tiling: list[int],
) -> torch.Tensor:
    return fused_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj=gate_up_proj,
        down_proj=down_proj,
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
        fp8_activations=fp8_activations,
        tiling=ExpertsTiling.from_ints(tiling),
    )


@_fused_experts_op.register_fake
def _(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_scale,
    down_scale,
    fp8_activations,
    tiling,
):
    return hidden_states.new_empty(hidden_states.shape)


def refuse_unsupported(experts: torch.nn.Module) -> None:
    """The fused kernels compute concatenated [gate; up] SwiGLU experts without biases, as the
    Qwen3 / Qwen3-Next / Qwen3.5 MoE families store them; anything else is refused by name."""
    act = getattr(experts.config, "hidden_act", "silu")
    flags = {
        "has_bias": getattr(experts, "has_bias", False),
        "has_gate": not getattr(experts, "has_gate", True),
        "is_transposed": getattr(experts, "is_transposed", False),
        "is_concatenated": not getattr(experts, "is_concatenated", True),
        "has_post_expert_norm": getattr(experts, "has_post_expert_norm", False),
        "expert parallel": getattr(experts, "_is_expert_parallel", False),
        f"hidden_act={act}": act != "silu",
    }
    unsupported = [name for name, bad in flags.items() if bad]
    if unsupported:
        raise ValueError(
            f"target.experts={EXPERTS_IMPLEMENTATION}: {type(experts).__name__} has {', '.join(unsupported)}; "
            "the fused kernels compute bias-free concatenated SwiGLU experts (use grouped_mm)"
        )


def fused_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function signature (ALL_EXPERTS_FUNCTIONS), bf16 weights."""
    refuse_unsupported(self)
    tiling = call_tiling(self, self.gate_up_proj.dtype).as_ints()
    return _fused_experts_op(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        None,
        None,
        False,
        tiling,
    )


def fused_fp8_experts(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    fp8_activations: bool = False,
    tiling: ExpertsTiling | None = None,
) -> torch.Tensor:
    """The fused kernels on block-wise FP8 weights `(weight, scale_inv)` as stored; with
    `fp8_activations`, on quantized activations too (the `fused_w8a8` implementation).
    `tiling`: the kernels' tiles (default_tiling's unless given)."""
    refuse_unsupported(experts)
    tiles = (tiling or default_tiling(gate_up[0].dtype)).as_ints()
    return _fused_experts_op(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up[0],
        down[0],
        gate_up[1],
        down[1],
        fp8_activations,
        tiles,
    )


def register() -> None:
    """Make `fused` and `fused_w8a8` transformers experts implementations
    (model.set_experts_implementation); on bf16 weights the two are the same."""
    from transformers.integrations.moe import ExpertsInterface

    for name in IMPLEMENTATIONS:
        ExpertsInterface.register(name, fused_experts_forward)
