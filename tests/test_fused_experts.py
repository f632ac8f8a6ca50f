"""target.experts=fused: dflash's Triton experts for a frozen MoE target (dflash/target/fused_experts.py).

The routing layout is plain torch and is held to a direct construction on the CPU; the kernels
run on CUDA, where they are held to the experts formula written out, to transformers' own
experts paths and, on FP8 weights, to the dequantized weights' result."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from dflash.target.fused_experts import BLOCK_M, routing
from tests.test_fp8 import QWEN3_NEXT

# The FP8 tests' Qwen3-Next layout with more experts and whole 128 x 128 blocks in the experts'
# intermediate size (FP8 experts are read as stored).
QWEN3_NEXT_MOE = {**QWEN3_NEXT, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 128}


def experts_formula(x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k], token by
    token in fp32: the gate is the first half of gate_up_proj's rows, the up the second."""
    x = x.float()
    out = torch.zeros_like(x)
    for slot in range(top_k_index.shape[-1]):
        expert = top_k_index[:, slot]
        gate, up = torch.einsum("th,tnh->tn", x, gate_up_proj[expert].float()).chunk(2, dim=-1)
        y = torch.einsum("ti,thi->th", F.silu(gate) * up, down_proj[expert].float())
        out += top_k_weights[:, slot, None].float() * y
    return out


def skewed_routing(tokens: int, top_k: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct experts per token; expert 1 in every token's first slot (a run of several tiles)
    and the last expert never chosen (an empty run)."""
    rows = []
    for _ in range(tokens):
        others = torch.randperm(num_experts - 2, generator=generator)[: top_k - 1]
        others = others + (others >= 1).long()  # skip expert 1
        rows.append(torch.cat([torch.tensor([1]), others]))
    return torch.stack(rows)


@pytest.mark.parametrize("block_m", [4, BLOCK_M])
def test_routing_puts_each_pair_once_in_its_experts_padded_run(block_m):
    """Each expert's (token, slot) pairs, in pair order, start its run of rows; the run is
    padded to whole tiles with the padding mark S; runs follow in expert order; every tile
    names its run's expert, and the spare tiles of the host-free upper bound name none (E)."""
    generator = torch.Generator().manual_seed(0)
    tokens, top_k, num_experts = 37, 3, 6
    top_k_index = skewed_routing(tokens, top_k, num_experts, generator)
    route = routing(top_k_index, num_experts, block_m=block_m)
    pairs = tokens * top_k
    assert route.pairs == pairs
    flat = top_k_index.reshape(-1).tolist()
    expected_rows, expected_tiles = [], []
    for expert in range(num_experts):
        run = [pair for pair, e in enumerate(flat) if e == expert]
        padded = -(-len(run) // block_m) * block_m
        expected_rows += run + [pairs] * (padded - len(run))
        expected_tiles += [expert] * (padded // block_m)
    spare = route.row_pair.numel() - len(expected_rows)
    assert spare >= 0 and route.row_pair.numel() % block_m == 0
    assert route.row_pair.tolist() == expected_rows + [pairs] * spare
    assert route.tile_expert.tolist() == expected_tiles + [num_experts] * (spare // block_m)
    # expert 1 in every token: its run spans ceil(37 / block_m) tiles; the last expert none
    assert expected_tiles.count(1) == -(-tokens // block_m) and num_experts - 1 not in expected_tiles


def test_routing_bound_holds_when_every_expert_gets_one_pair():
    """The worst padding: as many experts as pairs, one pair each, a whole tile each."""
    top_k_index = torch.arange(12).view(6, 2)
    route = routing(top_k_index, 12, block_m=8)
    assert route.tile_expert.tolist()[:12] == list(range(12))
    assert sorted(p for p in route.row_pair.tolist() if p < 12) == list(range(12))


@pytest.mark.parametrize("kind", ["fused", "fused_w8a8"])
def test_fused_experts_on_the_cpu_are_refused_naming_the_key(make_cfg, kind):
    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target

    overrides = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT_MOE.items())]
    overrides += [
        "drafter=tiny",
        "drafter.mask_token_id=255",
        "drafter.target_layer_ids=[0,3]",
        f"target.experts={kind}",
    ]
    with pytest.raises(ValueError, match=rf"target.experts={kind} runs Triton kernels on CUDA; on cpu"):
        frozen_target(typed_config(make_cfg(overrides)), "cpu")


def test_experts_the_kernels_do_not_compute_are_refused_by_what_they_have():
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target.fused_experts import fused_experts_forward

    config = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_MOE)
    experts = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    experts.has_bias = True
    with pytest.raises(ValueError, match=r"Qwen3NextExperts has has_bias; the fused kernels compute"):
        fused_experts_forward(
            experts, torch.zeros(2, 128), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
        )


TUNED = ((32, (64, 128, 8, 4), (256, 32, 4, 3)), (16, (64, 64, 4, 2), (128, 128, 8, 3)))


def tiny_moe_target_overrides(*extra: str) -> list[str]:
    overrides = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT_MOE.items())]
    return [*overrides, "drafter=tiny", "drafter.mask_token_id=255", "drafter.target_layer_ids=[0,3]", *extra]


@pytest.mark.parametrize("block_m, gate_up_tiles, down_tiles", TUNED)
def test_the_override_bench_experts_prints_trains_with_that_tiling(
    make_cfg, block_m, gate_up_tiles, down_tiles
):
    """bench_experts prints its best tiling as a `target.experts_tiling=` override: Hydra reads it
    back as the same tiles, and the flat form the compiled op carries round-trips."""
    from dflash.config.typed import typed_config
    from dflash.target.experts_tiling import ExpertsTiling, default_tiling

    tiling = tiling_of(block_m, gate_up_tiles, down_tiles)
    cfg = typed_config(make_cfg(tiny_moe_target_overrides(tiling.override())))
    assert default_tiling(torch.bfloat16).with_settings(cfg.target.experts_tiling) == tiling
    assert ExpertsTiling.from_ints(tiling.as_ints()) == tiling


def test_the_configured_tiling_reaches_the_kernels_of_every_experts_module(monkeypatch):
    """use_tiling (target.experts_tiling) gives each layer's experts its tiles; the experts
    function then hands those to the fused op, and the default tiles where none were given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target import fused_experts as module
    from dflash.target.experts_tiling import default_tiling, use_tiling

    config = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_MOE)
    model = AutoModelForCausalLM.from_config(config)
    untouched = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    tiling = tiling_of(*TUNED[0])
    layers = QWEN3_NEXT_MOE["num_hidden_layers"]
    assert (
        use_tiling(model, tiling, activations=torch.float32, shared_memory=None) == layers
    )  # every field set
    seen = []
    monkeypatch.setattr(module, "_fused_experts_op", lambda *args: seen.append(args[-1]))
    inputs = (torch.zeros(2, 128), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    for layer in model.model.layers:
        module.fused_experts_forward(layer.mlp.experts, *inputs)
    module.fused_experts_forward(untouched, *inputs)
    assert seen == [tiling.as_ints()] * layers + [default_tiling(torch.float32).as_ints()]


@pytest.mark.parametrize("inter, read_as_stored", [(128, True), (64, False)])
def test_fp8_experts_take_the_fields_set_and_the_defaults_of_the_weights_multiplied(
    monkeypatch, inter, read_as_stored
):
    """A tiling that sets only some fields: FP8 experts the kernels read as stored get FP8's
    default tiles for the rest; FP8 experts not on whole scale blocks, dequantized (here to the
    fp32 hidden states' dtype) for the kernels, get that dtype's defaults."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.config.schema import ExpertsTilingConfig
    from dflash.target import fused_experts as module
    from dflash.target.experts_tiling import default_tiling, use_tiling
    from dflash.target.fp8 import quantize_layer

    settings = ExpertsTilingConfig(block_m=32)
    settings.down.warps = 8
    default = default_tiling(torch.float8_e4m3fn if read_as_stored else torch.float32)
    want = replace(default, block_m=32, down=replace(default.down, warps=8))
    seen = []
    monkeypatch.setattr(module, "_fused_experts_op", lambda *args: seen.append(args[-1]) or args[0])
    module.register()
    config = AutoConfig.for_model("qwen3_next", **{**QWEN3_NEXT_MOE, "moe_intermediate_size": inter})
    layer = quantize_layer(AutoModelForCausalLM.from_config(config).model.layers[0])
    assert use_tiling(layer, settings, activations=torch.float32, shared_memory=None) == 1
    experts = layer.mlp.experts
    assert experts._fused_reads_fp8() == read_as_stored
    experts._template[0].config._experts_implementation = module.EXPERTS_IMPLEMENTATION
    experts(
        torch.randn(3, QWEN3_NEXT_MOE["hidden_size"]), torch.zeros(3, 3, dtype=torch.long), torch.ones(3, 3)
    )
    assert seen == [want.as_ints()]


def test_experts_tilings_that_cannot_apply_are_refused_naming_the_key(make_cfg, caplog):
    """Tiles the kernels cannot run: refused before the target is built (FP8 targets by the
    scale-block rule too, one field set, the rest FP8's defaults); a tiling for experts the user set to another implementation: refused;
    under experts=auto, which fell back to transformers' experts on this CPU: built, logged unused."""
    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target

    def build(*extra: str):
        return frozen_target(typed_config(make_cfg(tiny_moe_target_overrides(*extra))), "cpu")

    with pytest.raises(ValueError, match=r"^target.experts_tiling: block_m=48 is not a power of two >= 16$"):
        build(tiling_of(48, (64, 64, 4), (64, 64, 4)).override())
    with pytest.raises(
        ValueError,
        match=r"^target.experts_tiling: gate_up.block_n=256 does not divide the 128-wide FP8 scale",
    ):
        build("target.fp8=true", "target.experts_tiling.gate_up.block_n=256")
    from dflash.config.schema import ExpertsTilingConfig
    from dflash.target.experts_tiling import resolve

    four_stages = ExpertsTilingConfig(block_m=128)
    four_stages.gate_up.stages = 4  # over the A100 defaults (the tiles before): 4 x 48 KiB
    with pytest.raises(
        ValueError,
        match=r"^target.experts_tiling: ExpertsTiling\(block_m=128.* needs 192 KiB of shared memory per block on bfloat16 weights, over this GPU's 163 KiB",
    ):
        resolve(four_stages, weights=torch.bfloat16, activations=torch.bfloat16, shared_memory=A100)
    tiling = tiling_of(*TUNED[0]).override()
    with pytest.raises(
        ValueError, match=r"but its routed experts run grouped_mm, not the fused kernels \(set target"
    ):
        build("target.experts=grouped_mm", tiling)
    with caplog.at_level("INFO", logger="dflash.target.model"):
        target, _ = build("target.experts=auto", tiling)
    assert "target.experts_tiling unused: its routed experts run transformers' default" in caplog.text
    assert not any(hasattr(m, "dflash_experts_tiling") for m in target.model.modules())


def random_experts(num_experts, hidden, inter, dtype, generator):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5
    return gate_up.to("cuda", dtype), down.to("cuda", dtype)


@dataclass
class FP8ExpertsCase:
    """8 experts in the published FP8 layout (e4m3, 128 x 128 blocks), top-2 routing skewed so that
    one expert gets every token and one none, bf16 hidden states and routing weights."""

    x: torch.Tensor
    top_k_index: torch.Tensor
    weights: torch.Tensor
    gate_up: tuple[torch.Tensor, torch.Tensor]  # (e4m3 weight, scale_inv)
    down: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def draw(cls, tokens: int, seed: int, *, num_experts=8, top_k=2, hidden=256, inter=256) -> FP8ExpertsCase:
        from dflash.target.fp8 import quantize_blockwise

        generator = torch.Generator().manual_seed(seed)
        gate_up, down = random_experts(num_experts, hidden, inter, torch.float32, generator)
        top_k_index = skewed_routing(tokens, top_k, num_experts, generator).cuda()
        weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1).cuda().bfloat16()
        x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
        return cls(
            x,
            top_k_index,
            weights,
            quantize_blockwise(gate_up, (128, 128)),
            quantize_blockwise(down, (128, 128)),
        )

    def run(self, **options) -> torch.Tensor:
        from dflash.target import fused_experts

        return fused_experts.fused_experts(
            self.x, self.top_k_index, self.weights, gate_up_proj=self.gate_up[0], down_proj=self.down[0],
            gate_up_scale=self.gate_up[1], down_scale=self.down[1], **options,
        ).float()  # fmt: skip

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        from dflash.target.fp8 import dequantize_blockwise

        return tuple(
            dequantize_blockwise(w, s, (128, 128), torch.float32) for w, s in (self.gate_up, self.down)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_on_cuda_the_fused_experts_compute_the_formula(tokens):
    """fp32: the formula within fp32 rounding (full-precision dots, not TF32). bf16: within bf16
    rounding of it, and no further from it than transformers' grouped_mm path on the same
    weights (which rounds after each projection, where the kernels round once)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from dflash.target.fused_experts import fused_experts

    generator = torch.Generator().manual_seed(0)
    num_experts, top_k, hidden, inter = 16, 4, 256, 192  # 192: a partial column tile
    top_k_index = skewed_routing(tokens, top_k, num_experts, generator).cuda()
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1).cuda()
    x = torch.randn(tokens, hidden, generator=generator).cuda()
    gate_up, down = random_experts(num_experts, hidden, inter, torch.float32, generator)
    want = experts_formula(x, top_k_index, weights, gate_up, down)
    got = fused_experts(x, top_k_index, weights, gate_up_proj=gate_up, down_proj=down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    xb, gb, db, wb = (t.bfloat16() for t in (x, gate_up, down, weights))
    want = experts_formula(xb, top_k_index, wb, gb, db)
    got = fused_experts(xb, top_k_index, wb, gate_up_proj=gb, down_proj=db)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)

    class Experts(torch.nn.Module):  # what transformers' experts functions read
        num_experts, has_gate, has_bias, is_transposed, _is_expert_parallel = 16, True, False, False, False
        has_post_expert_norm, gate_up_proj, down_proj = False, gb, db

        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return F.silu(gate) * up

    theirs = grouped_mm_experts_forward(Experts(), xb, top_k_index, wb)
    assert (got.float() - want).abs().max() <= 1.25 * (theirs.float() - want).abs().max() + 1e-3


@pytest.mark.gpu
def test_on_cuda_fp8_experts_read_as_stored_compute_their_dequantized_weights():
    """Block-wise FP8 weights with their 128 x 128 scales, read as stored: the formula on the
    dequantized weights within bf16 rounding."""
    case = FP8ExpertsCase.draw(tokens=200, seed=1)
    want = experts_formula(case.x, case.top_k_index, case.weights, *case.dequantized())
    torch.testing.assert_close(case.run(), want, rtol=2e-2, atol=2e-2)


# Launch shapes other than the defaults (scripts/bench_experts.py sweeps them): row tiles that
# pad each expert's run differently, column tiles narrower and wider than the 192 / 256 sizes,
# K steps that split a 128-wide FP8 scale block; (dtype, block_m, gate_up, down), each tile
# (block_n, block_k, warps, stages) small enough for fp32's shared memory where fp32.
OTHER_TILINGS = [
    (torch.float32, 16, (64, 32, 4, 2), (128, 64, 4, 2)),
    (torch.float32, 128, (32, 32, 4, 2), (64, 32, 8, 3)),
    (torch.bfloat16, 64, (256, 64, 8, 2), (256, 64, 8, 2)),
]


def tiling_of(block_m, gate_up, down):
    from dflash.target.experts_tiling import ExpertsTiling, KernelTiling

    return ExpertsTiling(block_m=block_m, gate_up=KernelTiling(*gate_up), down=KernelTiling(*down))


def test_tilings_the_kernels_cannot_run_are_refused_before_any_kernel(monkeypatch):
    """Not powers of two >= 16 (tl.dot's rule), or FP8 tiles crossing a 128-wide scale block:
    refused by name before the kernels are imported (on CPU too, where no kernel exists)."""
    from dflash.target import fused_experts as module

    monkeypatch.setattr(module, "_kernels", lambda: pytest.fail("kernels imported"))
    assert tiling_of(16, (64, 32, 4, 2), (256, 128, 8, 4)).refusal(fp8=False) is None
    assert tiling_of(16, (64, 32, 4, 2), (64, 128, 8, 4)).refusal(fp8=True) is None
    assert (
        tiling_of(48, (64, 32, 4), (64, 32, 4)).refusal(fp8=False) == "block_m=48 is not a power of two >= 16"
    )
    assert (
        tiling_of(64, (64, 8, 4), (64, 32, 4)).refusal(fp8=False)
        == "gate_up.block_k=8 is not a power of two >= 16"
    )
    assert (
        tiling_of(64, (64, 64, 4), (256, 64, 4)).refusal(fp8=True)
        == "down.block_n=256 does not divide the 128-wide FP8 scale blocks"
    )
    gate_up, down = torch.zeros(4, 256, 128), torch.zeros(4, 128, 128)
    with pytest.raises(
        ValueError,
        match=r"^fused experts: ExpertsTiling\(block_m=48.*block_m=48 is not a power of two >= 16$",
    ):
        module.fused_experts(
            torch.zeros(3, 128), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2),
            gate_up_proj=gate_up, down_proj=down, tiling=tiling_of(48, (64, 32, 4), (64, 32, 4)),
        )  # fmt: skip


H200, A100, L40S = 232448, 166912, 101376  # shared memory a block can opt in to, bytes
# bench_experts' sweep on an H200 (benchmarks/RESULTS.md, 2026-12-04), bf16: (tiling, whether Triton
# ran it; the rest were "out of shared memory"). Gate/up rows ran beside the default down tiles of
# the time, down rows beside the row tile's best gate/up tiles.
SWEPT_ON_H200 = [
    ((64, (128, 128, 4, 3), (128, 64, 4, 3)), False),
    ((64, (256, 64, 4, 3), (128, 64, 4, 3)), True),
    ((64, (256, 64, 4, 4), (128, 64, 4, 3)), False),
    ((64, (128, 64, 8, 4), (128, 64, 4, 3)), True),
    ((128, (64, 128, 4, 3), (128, 64, 4, 3)), True),
    ((128, (64, 128, 4, 4), (128, 64, 4, 3)), False),
    ((128, (256, 64, 8, 3), (128, 64, 4, 3)), False),
    ((128, (128, 64, 8, 4), (128, 64, 4, 3)), True),
    ((128, (128, 64, 8, 4), (128, 128, 4, 3)), True),
    ((128, (128, 64, 8, 4), (128, 128, 4, 4)), False),
    ((128, (128, 64, 8, 4), (256, 64, 8, 4)), True),
    ((128, (128, 64, 8, 4), (256, 128, 4, 3)), False),
    ((64, (128, 64, 8, 4), (256, 128, 8, 3)), False),
    ((64, (128, 64, 8, 4), (256, 64, 8, 4)), True),
]


@pytest.mark.parametrize("tiles, ran", SWEPT_ON_H200)
def test_the_shared_memory_count_tells_which_tilings_an_h200_ran(tiles, ran):
    """What a program's stages hold (a tile of activations and the weight tiles per K step)
    against an H200's limit: exactly the sweep's rows that Triton ran and the ones it refused."""
    needed = tiling_of(*tiles).shared_memory(activations=torch.bfloat16, weights=torch.bfloat16)
    assert (needed <= H200) == ran, needed


@pytest.mark.parametrize(
    "weights, activations, gpu, want",
    [
        (torch.bfloat16, torch.bfloat16, H200, (128, (128, 64, 8, 4), (128, 64, 4, 3))),  # the sweep's best
        (torch.bfloat16, torch.bfloat16, A100, (64, (128, 64, 4, 3), (128, 64, 4, 3))),  # the tiles before
        (torch.bfloat16, torch.bfloat16, L40S, (16, (64, 32, 4, 2), (128, 64, 4, 2))),
        (torch.float16, torch.float16, H200, (128, (128, 64, 8, 4), (128, 64, 4, 3))),
        (torch.float32, torch.float32, H200, (16, (64, 32, 4, 2), (128, 64, 4, 2))),
        (torch.float8_e4m3fn, torch.bfloat16, A100, (64, (128, 128, 8, 3), (128, 128, 8, 3))),
        (torch.float8_e4m3fn, torch.float32, A100, (64, (64, 64, 4, 2), (64, 64, 4, 2))),
        (torch.float8_e4m3fn, torch.bfloat16, None, (64, (128, 128, 8, 3), (128, 128, 8, 3))),
    ],
)
def test_the_default_tiles_are_the_fastest_that_fit_the_gpu(weights, activations, gpu, want):
    """A target built on a GPU with less shared memory than an H200 (an A100, an L40S) or in
    fp32 (the exact lossless check) gets default tiles Triton can launch there, not an
    out-of-resources error at its first forward."""
    from dflash.target.experts_tiling import default_tiling

    tiling = default_tiling(weights, activations=activations, shared_memory=gpu)
    assert tiling == tiling_of(*want)
    if gpu is not None:
        assert tiling.shared_memory(activations=activations, weights=weights) <= gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, block_m, gate_up_tiles, down_tiles", OTHER_TILINGS)
def test_on_cuda_every_tiling_computes_the_formula(dtype, block_m, gate_up_tiles, down_tiles):
    """Other launch shapes, the same products: fp32 within fp32 rounding of the formula, bf16
    within bf16 rounding; FP8 weights (tiles inside the scale blocks) within bf16 rounding of the
    dequantized formula."""
    from dflash.target.fused_experts import fused_experts

    generator = torch.Generator().manual_seed(3)
    num_experts, top_k, hidden, inter = 16, 4, 256, 192
    top_k_index = skewed_routing(300, top_k, num_experts, generator).cuda()
    weights = torch.softmax(torch.randn(300, top_k, generator=generator), -1).cuda().to(dtype)
    x = torch.randn(300, hidden, generator=generator).cuda().to(dtype)
    gate_up, down = random_experts(num_experts, hidden, inter, dtype, generator)
    want = experts_formula(x, top_k_index, weights, gate_up, down).float()
    got = fused_experts(
        x, top_k_index, weights, gate_up_proj=gate_up, down_proj=down,
        tiling=tiling_of(block_m, gate_up_tiles, down_tiles),
    ).float()  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)

    case = FP8ExpertsCase.draw(tokens=200, seed=1)
    want = experts_formula(case.x, case.top_k_index, case.weights, *case.dequantized())
    fp8_tiles = tiling_of(block_m, (64, 64, 4, 3), (128, 32, 8, 3))
    torch.testing.assert_close(case.run(tiling=fp8_tiles), want, rtol=2e-2, atol=2e-2)


def test_activation_groups_quantize_as_the_served_fp8_kernels_do():
    """One scale per row and 128 columns, max|x| / 448; the group's largest element lands on
    +-448 exactly, every element within e4m3's rounding (3 mantissa bits: half an ulp is 1/16
    relative); an all-zero group keeps a tiny positive scale and quantizes to zeros."""
    from dflash.target.fused_experts import quantize_groups

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=generator) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)
    x[3, 128:256] = 0.0
    q, scale = quantize_groups(x.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, 3)
    groups = x.bfloat16().float().reshape(5, 3, 128)
    amax = groups.abs().amax(-1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / 448.0, rtol=0, atol=0)
    assert scale[3, 1] > 0 and q.float().reshape(5, 3, 128)[3, 1].abs().max() == 0
    back = q.float().reshape(5, 3, 128) * scale[..., None]
    assert (back - groups).abs().le(groups.abs() / 16 + scale[..., None] * 2**-9).all()
    peak = groups.abs().argmax(-1, keepdim=True)
    assert q.float().reshape(5, 3, 128).gather(-1, peak)[amax > 0].abs().eq(448.0).all()


def test_fused_w8a8_sends_fp8_experts_to_the_kernels_with_quantized_activations(monkeypatch):
    """`fused_w8a8` takes the same kernels as `fused`, asking for quantized activations; on bf16
    experts (no scales) the two are one function."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target import fused_experts
    from dflash.target.fp8 import quantize_layer

    calls = []
    monkeypatch.setattr(fused_experts, "_fused_experts_op", lambda *args: calls.append(args[7]) or args[0])
    config = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_MOE)
    experts = quantize_layer(AutoModelForCausalLM.from_config(config).model.layers[0]).mlp.experts
    x, index, weights = (
        torch.randn(3, QWEN3_NEXT_MOE["hidden_size"]),
        torch.zeros(3, 3, dtype=torch.long),
        torch.ones(3, 3),
    )
    for implementation in fused_experts.IMPLEMENTATIONS:
        experts._template[0].config._experts_implementation = implementation
        experts(x, index, weights)
    assert calls == [False, True]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_on_cuda_w8a8_experts_compute_the_formula_on_quantized_activations(tokens, monkeypatch):
    """fused_w8a8 on block-wise FP8 weights, each kernel against the formula on its own quantized
    input: the gate/up kernel's SwiGLU rows from the hidden states quantized per token and 128
    columns (within their bf16 rounding); the down kernel's output from those rows quantized
    the same way (within the bf16 rounding of each pair's row). End to end the result stays
    within what activation quantization explains of the dequantized-weights formula (an e4m3
    step is 1/16 relative, and rows that differ by one bf16 step can quantize a step apart, so
    the formula on the unrounded values is no tight reference)."""
    from dflash.target import fused_experts as module

    quantized_inputs = []

    def recording(t, group=128):
        quantized_inputs.append(t.clone())
        return quantize_groups(t, group)

    quantize_groups = module.quantize_groups
    monkeypatch.setattr(module, "quantize_groups", recording)
    case = FP8ExpertsCase.draw(tokens=tokens, seed=2)
    got = case.run(fp8_activations=True)
    w_gate_up, w_down = case.dequantized()
    x, top_k_index, weights, top_k = case.x, case.top_k_index, case.weights, case.top_k_index.shape[1]
    num_experts, hidden = w_gate_up.shape[0], x.shape[1]

    def dequantized_groups(t):
        q, scale = quantize_groups(t)
        return (q.float().reshape(t.shape[0], -1, 128) * scale[..., None]).reshape(t.shape)

    hidden_in, activated = quantized_inputs  # what each kernel read, before quantization
    assert torch.equal(hidden_in, x)
    route = module.routing(top_k_index, num_experts)
    rows = (route.row_pair < route.pairs).nonzero().squeeze(1)
    pair = route.row_pair[rows].long()
    token, slot = pair // top_k, pair % top_k
    expert = top_k_index[token, slot]
    gate, up = torch.einsum("rh,rnh->rn", dequantized_groups(x)[token], w_gate_up[expert]).chunk(2, dim=-1)
    swiglu = F.silu(gate) * up
    assert (activated[rows].float() - swiglu).abs().max() <= swiglu.abs().max() * 2**-7
    per_pair = torch.einsum("ri,rhi->rh", dequantized_groups(activated)[rows], w_down[expert])
    per_pair = (weights[token, slot, None].float() * per_pair).bfloat16().float()
    want = torch.zeros(tokens, hidden, device="cuda").index_add_(0, token, per_pair)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= top_k * scale * 2**-7
    unquantized = experts_formula(x, top_k_index, weights, w_gate_up, w_down)
    assert (got - unquantized).abs().max().item() <= 0.15 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["false", "true"])
def test_on_cuda_a_moe_target_with_fused_experts_gives_the_batched_experts_features(make_cfg, fp8):
    """target.experts=fused on a Qwen3-Next-layout target in fp32 (bf16-kept and FP8-kept
    experts): the features of transformers' batched_mm experts (grouped_mm has no fp32 CUDA
    kernel) within fp32 rounding, eager and under the regional compile, whose layers keep the
    experts in their graphs (no graph break). (In bf16 the two paths round at different
    places and four random layers amplify that: the kernels' bf16 accuracy is held to the
    formula above.)"""
    from torch._dynamo.utils import counters

    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target
    from dflash.torch_runtime.compile import CompileCounter

    base = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT_MOE.items())]
    base += ["drafter=tiny", "drafter.mask_token_id=255", "drafter.target_layer_ids=[0,3]", "gpu=single"]
    base += [f"target.fp8={fp8}", "target.dtype=float32"]
    ids = torch.randint(0, QWEN3_NEXT_MOE["vocab_size"], (2, 96), device="cuda")
    batched, _ = frozen_target(typed_config(make_cfg(base + ["target.experts=batched_mm"])), "cuda")
    want = batched.features(ids)
    del batched
    fused, _ = frozen_target(typed_config(make_cfg(base + ["target.experts=fused"])), "cuda")
    assert fused.config._experts_implementation == "fused"
    torch.testing.assert_close(fused.features(ids), want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    counters.clear()
    fused.compile_features(CompileCounter("target"), scope="layers")
    torch.testing.assert_close(fused.features(ids), want, rtol=1e-4, atol=1e-4)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("inter, reads_fp8", [(128, True), (64, False)])
def test_fp8_experts_go_to_the_kernels_as_stored_only_on_whole_scale_blocks(inter, reads_fp8):
    """The kernels find the up half's scales at row (column + I) / 128 of the concatenated grid:
    true when I is a whole number of 128-row blocks (then the grid is the two halves' grids one
    after the other); otherwise the experts are dequantized first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target.fp8 import BlockFP8Experts, quantize_blockwise, quantize_layer

    config = AutoConfig.for_model("qwen3_next", **{**QWEN3_NEXT_MOE, "moe_intermediate_size": inter})
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    gate_up = layer.mlp.experts.gate_up_proj.detach().clone()
    experts = quantize_layer(layer).mlp.experts
    assert isinstance(experts, BlockFP8Experts) and experts._fused_reads_fp8() == reads_fp8
    if reads_fp8:
        up_scales = quantize_blockwise(gate_up[:, inter:], (128, 128))[1]
        torch.testing.assert_close(
            experts.gate_up_proj_scale_inv[:, inter // 128 :], up_scales, rtol=0, atol=0
        )


def test_experts_auto_picks_the_fused_kernels_only_where_they_run_and_compute_those_experts(
    monkeypatch, caplog, make_cfg
):
    """`target.experts=auto` (the MoE presets): fused on CUDA with triton installed; transformers'
    default on the CPU, without triton, for a dense model, or where a module is a kind the
    kernels do not compute (logged). A preset target built on the CPU keeps transformers' experts."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target
    from dflash.target import fused_experts
    from dflash.target import model as target
    from dflash.torch_runtime import kernel_libraries as kernels

    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_MOE))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    packages = {"triton"}
    monkeypatch.setattr(kernels, "installed", lambda package: package in packages)
    assert target.auto_experts(moe, cuda) == "fused"
    assert target.auto_experts(moe, cpu) is None
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16))  # fmt: skip
    assert target.auto_experts(dense, cuda) is None
    packages.clear()
    assert target.auto_experts(moe, cuda) is None  # no triton
    packages.add("triton")

    def refuse(experts):
        raise ValueError("has_bias")

    monkeypatch.setattr(fused_experts, "refuse_unsupported", refuse)
    with caplog.at_level(logging.INFO, logger="dflash.target.model"):
        assert target.auto_experts(moe, cuda) is None
    assert "target.experts=auto: transformers' default experts (has_bias)" in caplog.text
    monkeypatch.undo()

    overrides = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT_MOE.items())]
    overrides += ["drafter=tiny", "drafter.mask_token_id=255", "drafter.target_layer_ids=[0,3]"]
    cfg = typed_config(make_cfg(overrides))
    assert cfg.target.experts.value == "auto" and cfg.target.compile is None
    built, _ = frozen_target(cfg, "cpu")
    assert built.config._experts_implementation not in fused_experts.IMPLEMENTATIONS
