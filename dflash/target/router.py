"""MoE routers of the frozen target in feature forwards: transformers' top-k router (softmax over
the experts in fp32, the k largest, renormalised where the model does) with its top-k as one op
that runs a Triton kernel on CUDA.

torch.topk on the router's [tokens, experts] probabilities takes its multi-block radix-select path:
on an H200, Qwen3-Next-80B's shape (512 experts, k = 10, 4 x 3072 tokens) it spent 0.31 ms per
layer, 3.7 ms of a 76.7 ms compiled 12-layer forward (benchmarks/RESULTS.md, 2026-12-03 (late
night)). One program per few rows holds the whole row in registers and takes its maximum k times.
`compile_features` installs `feature_router_forward` on the compiled copies' routers only; the
model's own routers (decoding, reference features) keep transformers' forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from dflash.torch_runtime.kernel_libraries import triton_runs

# Experts per row the kernel holds in registers; wider rows keep torch.topk.
MAX_EXPERTS = 1024


@torch.library.custom_op("dflash::router_top_k", mutates_args=())
def router_top_k(probs_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row [N, k] in descending order and their columns [N, k]
    (int64), as torch.topk returns them; among equal values the lowest column first."""
    rows, experts = probs_NE.shape
    if not triton_runs(probs_NE.device) or experts > MAX_EXPERTS or probs_NE.dtype != torch.float32:
        return torch.topk(probs_NE, k, dim=-1)
    import triton

    from dflash.target.router_topk_kernel import rows_top_k

    probs = probs_NE.contiguous()
    values = torch.empty(rows, k, device=probs.device, dtype=probs.dtype)
    indices = torch.empty(rows, k, device=probs.device, dtype=torch.int64)
    block_m = 8
    rows_top_k[(triton.cdiv(rows, block_m),)](
        probs, values, indices, rows, experts, K=k, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(experts)
    )
    return values, indices


@router_top_k.register_fake
def _(probs_NE, k):
    rows = probs_NE.shape[0]
    return probs_NE.new_empty(rows, k), probs_NE.new_empty(rows, k, dtype=torch.int64)


# transformers' routers whose forward `feature_router_forward` computes (softmax, top-k,
# renormalised by `norm_topk_prob` or always): named, since other routers of the same shape
# score differently (DeepSeek-V3's sigmoid with group-limited routing).
TOP_K_ROUTERS = frozenset(
    {"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter"}
)


def is_top_k_router(module: nn.Module) -> bool:
    return type(module).__name__ in TOP_K_ROUTERS


def feature_router_forward(self: nn.Module, hidden_states: torch.Tensor):
    """transformers' TopKRouter.forward with the top-k as `router_top_k`: (router logits, the k
    routing weights in the logits' dtype, their experts). Routers without `norm_topk_prob`
    (Qwen3.5-MoE's) always renormalise, as theirs do."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, top_index = router_top_k(router_probs, self.top_k)
    if getattr(self, "norm_topk_prob", True):
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), top_index


def use_feature_router(router: nn.Module) -> None:
    """`router` (a compiled copy's own module) routes with `feature_router_forward`."""
    router.forward = types.MethodType(feature_router_forward, router)
