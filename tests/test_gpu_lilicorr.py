"""variant=lilicorr on a GPU: the lattice walk inside the captured round replays the eager static
path's and plain greedy's tokens, and the loss a CUDA run trains on (bf16 autocast, the fused
compiled LM-head loss) agrees with the CPU fp32 reference path, its terms and gradients included,
within bf16's tolerance."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from dflash.decoding.engine import StaticDecoder
from dflash.step.lilicorr_variant import LiLiCorrVariant
from dflash.target.target_head import TargetHead
from dflash.torch_runtime.compile import compiled_calls
from tests.test_dflash_rules import blocks_for
from tests.test_dspark import tiny_target as tiny_target_with_final_state
from tests.test_gpu_decoding import check_graphed_equals_eager_and_plain_greedy, fp32_cuda_pair
from tests.test_lilicorr import BLOCK, GEOMETRY, tiny_lilicorr, variant_block_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_graphed_lilicorr_decoding_equals_eager_and_plain_greedy_in_fp32():
    target, drafter = fp32_cuda_pair(tiny_lilicorr)
    graphed = StaticDecoder(target, drafter, max_len=128, graphs=True, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=128, graphs=False, kv_bucket=32)
    check_graphed_equals_eager_and_plain_greedy(target, graphed, eager, prompts=3)


# The recipe's weights (ModelOpt's lilicorr.yaml `base`): the hinge is reported, not trained, so
# its relu kink cannot switch a gradient on between bf16 and fp32.
RECIPE = LiLiCorrVariant(**GEOMETRY, ce_weight=0.25, margin_weight=0.0, penalty_weight=0.25, margin=2.0)
# bf16 keeps 8 significant bits (0.4% per rounding), compounded through the LM head, the lattice
# transformer and the cosines. These inputs under CPU bf16 autocast: the terms within 1.2% (the
# penalty), the gradients within 4.3% in norm (the lattice MLP's biases); the bounds leave 2x or
# more. The lattice makes 86% of the hidden states' gradient here and all of the head's, so a
# CUDA path that loses or mis-weighs it is far outside them.
LOSS_RTOL, GRAD_RTOL = 5e-2, 1e-1


def tie_free_inputs():
    """Inputs whose candidate lattice bf16 cannot change: an LM head whose row v is
    s_v e_{v mod 64} with s_v = 1 + 0.25 (v // 64) (exact in bf16), and hidden states 4 e_d (d the
    label's column) plus 0.05 noise elsewhere, so each slot's top 8 tokens are column d's at
    logits 4 s_v, 1.0 apart, everything else below 0.5. Labels drawn from 256..499 sit at ranks
    0..3 of the top 4 (the true path runs through every rank); two positions point at another
    column (their label leaves the lattice: the prefix ends) and a block has unsupervised labels."""
    target = tiny_target_with_final_state()
    drafter = tiny_lilicorr(target)
    vocab, width = target.lm_head.weight.shape
    lm_head = nn.Linear(width, vocab, bias=False)
    column = torch.arange(vocab) % width
    scale = 1.0 + 0.25 * (torch.arange(vocab) // width)
    with torch.no_grad():
        lm_head.weight.copy_(torch.zeros(vocab, width).scatter_(1, column[:, None], scale[:, None]))
    torch.manual_seed(0)
    ids = torch.randint(256, 500, (2, 18))
    loss_mask = torch.ones(2, 18)
    loss_mask[1, 12:14] = 0
    blocks = blocks_for(ids, loss_mask, block_size=BLOCK, num_anchors=3, gamma=4.0)
    aimed_at = blocks.labels.clamp(min=0) % width
    aimed_at[0, [2, 7]] = (aimed_at[0, [2, 7]] + 1) % width
    hidden = 0.05 * torch.randn(*blocks.labels.shape, width)
    hidden.scatter_(2, aimed_at[..., None], 4.0)
    top = lm_head(hidden).topk(RECIPE.candidate_topk + 1, dim=-1).values
    assert (top[..., :-1] - top[..., 1:]).min() >= 0.5  # no near-tie for bf16 to flip
    return target, drafter, lm_head, blocks, hidden, target.features(ids)


def loss_and_gradients(*, head, drafter, blocks, hidden, features, bf16=False, **path):
    """The variant's loss statistics (under bf16 autocast on CUDA, as the step runs the forward)
    and the gradients of the numerator with respect to the hidden states and every drafter
    parameter that gets one."""
    with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext():
        stats = variant_block_loss(
            RECIPE, target=head, drafter=drafter, blocks=blocks, hidden=hidden, features=features, **path
        )
    with compiled_calls():  # the first backward through a compiled graph compiles it
        stats.weighted_ce.backward()
    grads = {"hidden": hidden.grad.float().cpu()}
    grads |= {name: p.grad.float().cpu() for name, p in drafter.named_parameters() if p.grad is not None}
    return stats, grads


def test_the_cuda_bf16_compiled_loss_and_gradients_agree_with_the_cpu_fp32_reference():
    """The CUDA path a run trains on (dflash/step/step.py: bf16 autocast; the fused LM-head loss
    in chunks, compiled; the hidden states in bf16 as the drafter hands them) against the CPU
    fp32 reference path (every logit through autograd): the same supervised slots, the loss and
    each term within LOSS_RTOL, every gradient within GRAD_RTOL in norm."""
    target, drafter, lm_head, blocks, hidden, features = tie_free_inputs()
    cuda = torch.device("cuda")
    head = TargetHead(target.embed_tokens, lm_head)
    gpu_head, gpu_drafter = copy.deepcopy(head).to(cuda), copy.deepcopy(drafter).to(cuda)
    reference, reference_grads = loss_and_gradients(
        head=head, drafter=drafter, blocks=blocks, hidden=hidden.clone().requires_grad_(True),
        features=features,
    )  # fmt: skip
    fast, fast_grads = loss_and_gradients(
        head=gpu_head, drafter=gpu_drafter, blocks=blocks.to(cuda),
        hidden=hidden.to(cuda, torch.bfloat16).requires_grad_(True), features=features.to(cuda),
        bf16=True, logits_chunk=7, compiled=True,
    )  # fmt: skip
    assert reference.lattice_slots > 0 and reference.lattice_penalty > 0
    assert float(fast.lattice_slots) == float(reference.lattice_slots)
    assert float(fast.weight) == pytest.approx(float(reference.weight))
    for name in ("weighted_ce", "ce", "lattice_ce", "lattice_margin", "lattice_penalty"):
        got, want = float(getattr(fast, name).detach()), float(getattr(reference, name).detach())
        assert got == pytest.approx(want, rel=LOSS_RTOL), name
    assert fast_grads.keys() == reference_grads.keys()
    assert any(name.startswith("lilicorr.") for name in reference_grads) and "fc.weight" in reference_grads
    for name, want in reference_grads.items():
        error = (fast_grads[name] - want).norm()
        assert error <= GRAD_RTOL * want.norm() + 1e-6, (name, float(error), float(want.norm()))
