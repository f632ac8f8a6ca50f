"""MoE routers in feature forwards (dflash/target/router.py): transformers' top-k router with the
top-k as one op (a Triton kernel on CUDA), installed on the compiled copies only."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.target.model import FrozenTarget
from dflash.target.router import feature_router_forward, is_top_k_router, router_top_k
from dflash.torch_runtime.compile import CompileCounter

MOE_FAMILIES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"]


def routers_of(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_top_k_router(m)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_feature_router_routes_as_the_models_own(family, request):
    """Router logits, routing weights and experts exactly transformers' forward's, with the
    renormalisation on and off where the model has the switch (Qwen3.5-MoE always renormalises)."""
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{family}_dir")).eval()
    routers = routers_of(model)
    assert routers
    hidden = torch.randn(
        2, 19, model.config.get_text_config().hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        for router in routers:
            for normalise in (True, False) if hasattr(router, "norm_topk_prob") else (None,):
                if normalise is not None:
                    router.norm_topk_prob = normalise
                want = router(hidden)
                got = feature_router_forward(router, hidden)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_compiled_copies_route_through_the_op_and_the_models_routers_stay_transformers(tiny_qwen3_next_dir):
    graphs = []

    def capture(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen3_next_dir), [3])
    target.compile_features(CompileCounter("target", backend=capture), scope="layers")
    ids = torch.randint(1, 500, (2, 17))
    want = target.reference_features(ids)
    assert (target.features(ids) - want).abs().max() <= 1e-5 * want.abs().max()
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert calls.count("dflash.router_top_k.default") == len(graphs)  # one per layer kind's graph
    assert all("forward" not in vars(router) for router in routers_of(target.model))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, experts, k", [(300, 512, 10), (7, 60, 4), (1, 256, 8)])
def test_on_cuda_the_top_k_kernel_returns_torch_topk(rows, experts, k):
    """Qwen3-Next's 512 experts top-10, Qwen2-MoE's 60 (not a power of two), one row; softmax
    rows as the routers give them (distinct values: torch.topk's order among equals is its own)."""
    probs = torch.softmax(torch.randn(rows, experts, device="cuda"), dim=-1)
    values, indices = router_top_k(probs, k)
    want_values, want_indices = torch.topk(probs, k, dim=-1)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0)
    assert torch.equal(indices, want_indices)
