"""variant=lilicorr on a GPU: the lattice walk inside the captured round replays the eager static
path's and plain greedy's tokens, and the loss runs under bf16 autocast with finite gradients."""

from __future__ import annotations

import pytest
import torch

from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import plain_generate
from dflash.decoding.settings import DecodeSettings
from dflash.step.lilicorr_loss import LatticeWeights, lilicorr_loss
from tests.test_dflash_rules import tiny_target
from tests.test_lilicorr import loss_inputs, tiny_lilicorr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_graphed_lilicorr_decoding_equals_eager_and_plain_greedy_in_fp32():
    target = tiny_target()
    target.model.to("cuda")
    drafter = tiny_lilicorr(target).to("cuda").eval()
    graphed = StaticDecoder(target, drafter, max_len=128, graphs=True, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=128, graphs=False, kv_bucket=32)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 500, (6 + 9 * seed,)).tolist()
        reference = plain_generate(target, prompt, DecodeSettings(40)).output_ids
        spec, slow = (
            graphed.speculative(prompt, DecodeSettings(40)),
            eager.speculative(prompt, DecodeSettings(40)),
        )
        assert spec.output_ids == reference and slow.output_ids == reference
        assert spec.acceptance_lengths == slow.acceptance_lengths
        assert spec.round_figures == slow.round_figures


def test_the_loss_runs_under_bf16_autocast_with_finite_gradients():
    target, drafter, blocks, hidden, features = loss_inputs()
    target.model.to("cuda")
    drafter.to("cuda")
    hidden = hidden.detach().to("cuda").requires_grad_(True)
    features = features.to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        stats = lilicorr_loss(
            hidden,
            lm_head=target.lm_head,
            embed_tokens=target.embed_tokens,
            drafter=drafter,
            blocks=blocks.to(torch.device("cuda")),
            features_BSF=features[..., :-64],
            final_BSH=features[..., -64:],
            weights=LatticeWeights(ce=0.25, margin=0.0, penalty=0.25, margin_width=2.0),
        )
    stats.loss().backward()
    assert torch.isfinite(stats.loss()) and stats.lattice_slots > 0
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
