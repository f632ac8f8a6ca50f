"""variant=dspark (docs/ARCHITECTURE.md §1, DSpark): every block position predicts the token after
it, the Markov and confidence heads under the reference checkpoint's names, each loss term
against its formula written out by hand, the fused chunked loss against the reference path, the
target's final hidden state from the same forward, training end to end (tiny and a hybrid
target), warm start from a DFlash checkpoint and resume, and the config's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import drafter_config
from dflash.drafters.drafter_class import drafter_from_config
from dflash.drafters.dspark import DSparkDrafter, add_dspark_fields
from dflash.export.zlab import load_drafter
from dflash.step.blocks import build_blocks, position_weights
from dflash.step.dspark_loss import DSparkWeights, dspark_loss
from dflash.target.model import FrozenTarget
from dflash.train import train
from tests.conftest import TINY_ARCH
from tests.test_dflash2_export import without_tensor
from tests.test_dflash_rules import blocks_for

MASK_ID = 511
HEAD_TYPES = ["vanilla", "gated", "rnn"]


def tiny_target(final_state: bool = True) -> FrozenTarget:
    config = AutoConfig.for_model("qwen3", **TINY_ARCH)
    torch.manual_seed(0)
    return FrozenTarget(AutoModelForCausalLM.from_config(config), [1, 3], final_state=final_state)


def tiny_dspark(target: FrozenTarget, head_type: str = "vanilla", *, rank: int = 8, with_markov=True):
    cfg = DrafterConfig(name="t", num_layers=2, block_size=4, mask_token_id=MASK_ID, num_anchors=8)
    config = add_dspark_fields(
        drafter_config(cfg, target.config, target.layer_ids),
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=True,
        confidence_with_markov=with_markov,
    )
    torch.manual_seed(1)
    drafter = DSparkDrafter(config)
    # The init leaves the heads near zero; larger weights make every term and gradient count.
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                param.normal_(0.0, 0.3)
    return drafter


def dspark_blocks(ids, loss_mask, *, block_size=4, num_anchors=8, gamma=4.0):
    return blocks_for(
        ids, loss_mask, block_size=block_size, num_anchors=num_anchors, gamma=gamma, label_offset=1
    )


# -- blocks ----------------------------------------------------------------------------------


def test_every_position_predicts_the_next_token_with_decay_from_position_zero():
    """Slot k of anchor a: label ids[a + k + 1], Markov input ids[a + k] (the anchor for k = 0),
    weight exp(-k / gamma), the target's distribution read at a + k (DeepSpec: label_indices =
    anchor + 1..B, target_pred_indices = label - 1)."""
    ids = torch.arange(100, 120)
    blocks = dspark_blocks(ids, torch.ones(20), num_anchors=3)
    anchors = blocks.anchors[0].tolist()
    for j, a in enumerate(anchors):
        rows = slice(4 * j, 4 * j + 4)
        assert blocks.block_ids[0, rows].tolist() == [100 + a, MASK_ID, MASK_ID, MASK_ID]
        assert blocks.positions[0, rows].tolist() == [a, a + 1, a + 2, a + 3]
        assert blocks.labels[0, rows].tolist() == [100 + a + k + 1 for k in range(4)]
        assert blocks.prev_ids[0, rows].tolist() == [100 + a + k for k in range(4)]
        expected = [math.exp(-k / 4.0) for k in range(4)]
        torch.testing.assert_close(blocks.weights[0, rows], torch.tensor(expected))
    read_at = blocks.final_positions[blocks.final_index]  # each labelled row's position a + k
    assert read_at.tolist() == blocks.positions.flatten()[blocks.loss_rows].tolist()


def test_overlapping_blocks_read_each_target_position_once():
    """Blocks that overlap share positions: the target's distribution is read once per distinct
    position (ascending), each labelled row pointing at its own; the host copy of the pointers
    stays on the host when the blocks move."""
    blocks = dspark_blocks(torch.arange(30), torch.ones(30), num_anchors=20)
    rows = blocks.positions.flatten()[blocks.loss_rows]
    assert blocks.final_positions.tolist() == sorted(set(rows.tolist()))
    assert torch.equal(blocks.final_positions[blocks.final_index], rows)
    assert len(blocks.final_positions) < len(rows)  # 20 anchors in 30 tokens: overlapping
    moved = blocks.to(torch.device("cpu"))
    assert moved.final_index_host is blocks.final_index_host and torch.equal(
        moved.final_index, blocks.final_index
    )


def test_supervision_is_a_contiguous_prefix_ending_at_the_first_unsupervised_label():
    """A hole in the loss mask ends the block's supervision there, as DeepSpec's cumprod eval
    mask does; so does the sample's end."""
    mask = torch.ones(12)
    mask[6] = 0
    blocks = dspark_blocks(torch.arange(12), mask, num_anchors=20)
    valid = blocks.valid.view(-1, 4)
    for a, row in zip(blocks.anchors[0].tolist(), valid.tolist()):
        labels = [a + k + 1 for k in range(4)]
        expected, open_ = [], True
        for label in labels:
            open_ = open_ and label < 12 and label != 6
            expected.append(open_)
        assert row == expected, (a, row)


def test_dflash_blocks_are_unchanged_by_the_label_offset_argument():
    ids, mask = torch.arange(30)[None], torch.ones(1, 30, dtype=torch.uint8)
    common = dict(epoch=0, seed=0, block_size=4, num_anchors=5, mask_token_id=MASK_ID)
    plain = build_blocks(ids, mask, torch.tensor([30]), [0], weights=position_weights(4, 4.0), **common)
    assert plain.prev_ids is None and plain.final_positions is None
    assert plain.labels.view(-1, 4)[:, 0].eq(0).all()  # the anchor predicts nothing
    torch.testing.assert_close(
        position_weights(4, 4.0), torch.tensor([0.0, 1.0, math.exp(-0.25), math.exp(-0.5)])
    )


# -- heads ------------------------------------------------------------------------------------


def test_head_parameters_carry_the_reference_checkpoint_names_and_shapes():
    target = tiny_target()
    expected = {
        "vanilla": {},
        "gated": {"markov_head.gate_proj.weight": (8, 64 + 8), "markov_head.gate_proj.bias": (8,)},
        "rnn": {"markov_head.joint_proj.weight": (24, 2 * 8 + 64), "markov_head.joint_proj.bias": (24,)},
    }
    for head_type, extra in expected.items():
        state = tiny_dspark(target, head_type).state_dict()
        heads = {
            k: tuple(v.shape) for k, v in state.items() if k.startswith(("markov_head.", "confidence_head."))
        }
        assert heads == {
            "markov_head.markov_w1.weight": (512, 8),
            "markov_head.markov_w2.weight": (512, 8),
            "confidence_head.proj.weight": (1, 64 + 8),
            "confidence_head.proj.bias": (1,),
            **extra,
        }
    plain = tiny_dspark(target, rank=0, with_markov=False).state_dict()
    assert not any(k.startswith("markov_head.") for k in plain)
    assert tuple(plain["confidence_head.proj.weight"].shape) == (1, 64)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_markov_latents_follow_the_papers_formulas_position_by_position(head_type):
    """vanilla: W1[x]; gated: sigmoid(gate([h; W1[x]])) * W1[x]; rnn (paper eq. 6):
    z = [s; W1[x]; h], s' = sg s + (1 - sg) tanh(c), latent = tanh(o), s_0 = 0."""
    head = tiny_dspark(tiny_target(), head_type).markov_head
    prev, hidden = torch.randint(0, 512, (3, 4)), torch.randn(3, 4, 64)
    got = head.block_latents(prev, hidden)
    w1 = head.markov_w1.weight
    state = torch.zeros(3, 8)
    for k in range(4):
        e = w1[prev[:, k]]
        if head_type == "vanilla":
            want = e
        elif head_type == "gated":
            gate = torch.sigmoid(
                torch.cat([hidden[:, k], e], -1) @ head.gate_proj.weight.T + head.gate_proj.bias
            )
            want = gate * e
        else:
            z = torch.cat([state, e, hidden[:, k]], -1) @ head.joint_proj.weight.T + head.joint_proj.bias
            g, c, o = z[:, :8], z[:, 8:16], z[:, 16:]
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            want = torch.tanh(o)
        torch.testing.assert_close(got[:, k], want)
    torch.testing.assert_close(head.bias(got), got @ head.markov_w2.weight.T)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_sample_block_biases_each_position_by_the_token_drafted_before_it(head_type):
    drafter = tiny_dspark(tiny_target(), head_type)
    base, hidden = torch.randn(2, 4, 512), torch.randn(2, 4, 64)
    anchor = torch.tensor([7, 9])
    tokens, logits = drafter.sample_block(base, hidden, anchor, lambda step: step.argmax(-1))
    # Teacher forcing with the drafted tokens as the previous ones gives the same logits.
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    latents = drafter.markov_head.block_latents(prev, hidden)
    torch.testing.assert_close(logits, base + drafter.markov_head.bias(latents))
    assert torch.equal(tokens, logits.argmax(-1))


# -- loss ---------------------------------------------------------------------------------------


def loss_inputs(head_type="vanilla", *, with_markov=True, rank=8, anchors=3):
    target = tiny_target()
    drafter = tiny_dspark(target, head_type, rank=rank, with_markov=with_markov)
    torch.manual_seed(2)
    ids = torch.randint(0, 500, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.uint8)
    mask[1, 9] = 0
    blocks = dspark_blocks(ids, mask, num_anchors=anchors)
    hidden = torch.randn(2, blocks.labels.shape[1], 64, requires_grad=True)
    final = target.features(ids)[..., -64:]
    return target, drafter, blocks, hidden, final


WEIGHTS = DSparkWeights(ce=0.3, tv=0.9, confidence=0.7)


@pytest.mark.parametrize("with_markov", [True, False])
def test_each_loss_term_equals_its_formula_written_out(with_markov):
    """CE = -log p[label], L1 = sum |p - q| (twice TV), acc = 1 - L1 / 2, BCE against acc;
    each summed with the position weights; the numerator their weighted sum."""
    target, drafter, blocks, hidden, final = loss_inputs(
        with_markov=with_markov, rank=8 if with_markov else 0
    )
    stats = dspark_loss(
        hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, final_BSH=final, weights=WEIGHTS
    )
    W = target.lm_head.weight.double()
    params = {name: p.detach().double() for name, p in drafter.named_parameters()}
    ce = l1 = bce = weight = 0.0
    soft = [0.0] * 4
    for b in range(2):
        for q in range(blocks.labels.shape[1]):
            w = float(blocks.weights[b, q])
            if w == 0.0:
                continue
            prev = int(blocks.prev_ids[b, q])
            h = hidden[b, q].detach().double()
            z = W @ h
            if drafter.markov_head is not None:
                markov = params["markov_head.markov_w1.weight"][prev]
                z = z + params["markov_head.markov_w2.weight"] @ markov
            t = W @ final[b, int(blocks.positions[b, q])].double()
            p, pt = torch.softmax(z, 0), torch.softmax(t, 0)
            ce_k = -math.log(p[int(blocks.labels[b, q])])
            l1_k = float((p - pt).abs().sum())
            acc = min(1.0, max(0.0, 1.0 - l1_k / 2))
            features = h if drafter.markov_head is None else torch.cat([h, markov])
            c = float(
                params["confidence_head.proj.weight"][0] @ features + params["confidence_head.proj.bias"]
            )
            sig = 1 / (1 + math.exp(-c))
            bce_k = -(acc * math.log(sig) + (1 - acc) * math.log(1 - sig))
            ce, l1, bce, weight = ce + w * ce_k, l1 + w * l1_k, bce + w * bce_k, weight + w
            soft[q % 4] += acc
    assert float(stats.weight) == pytest.approx(weight)
    assert float(stats.ce) == pytest.approx(ce, rel=1e-5)
    assert float(stats.l1) == pytest.approx(l1, rel=1e-5)
    assert float(stats.confidence_loss) == pytest.approx(bce, rel=1e-5)
    assert float(stats.weighted_ce.detach()) == pytest.approx(0.3 * ce + 0.9 * l1 + 0.7 * bce, rel=1e-5)
    assert stats.soft_accepted.tolist() == pytest.approx(soft, rel=1e-5)


def test_the_confidence_target_is_detached_and_its_gradient_reaches_the_head():
    """BCE trains the head against a stop-gradient acceptance: with only the confidence term on,
    the Markov projection W2 (which moves the draft distribution) gets no gradient."""
    target, drafter, blocks, hidden, final = loss_inputs()
    stats = dspark_loss(
        hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, final_BSH=final,
        weights=DSparkWeights(ce=0.0, tv=0.0, confidence=1.0),
    )  # fmt: skip
    stats.weighted_ce.backward()
    assert (
        drafter.markov_head.markov_w2.weight.grad is None
        or not drafter.markov_head.markov_w2.weight.grad.any()
    )
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("chunk", [3, 1000])
@pytest.mark.parametrize("anchors", [3, 12])
def test_fused_chunked_loss_equals_the_reference_path(head_type, chunk, anchors):
    """The same numerator, terms, acceptance, hits and gradients (hidden states and every head
    parameter) as every logit through autograd; chunks smaller than the rows included, and
    blocks overlapping at nearly every position (12 anchors in 14 tokens: the target's logits
    computed once per position, read by several rows)."""
    results = []
    for logits_chunk in (0, chunk):
        target, drafter, blocks, hidden, final = loss_inputs(head_type, anchors=anchors)
        stats = dspark_loss(
            hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, final_BSH=final,
            weights=WEIGHTS, logits_chunk=logits_chunk,
        )  # fmt: skip
        stats.weighted_ce.backward()
        grads = {"hidden": hidden.grad.clone()}
        grads.update({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        results.append((stats, grads))
    (ref, ref_grads), (fused, fused_grads) = results
    for name in ("weighted_ce", "ce", "l1", "confidence_loss", "soft_accepted", "prob_accepted", "correct"):
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    assert ref_grads.keys() == fused_grads.keys() and any(
        k.startswith("markov_head.markov_w2") for k in ref_grads
    )
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_on_cuda_the_markov_w2_gradient_sums_bf16_products_in_fp32():
    """The fused path's `markov_w2` gradient on CUDA (one bf16 GEMM with fp32 output per chunk)
    equals the fp32 GEMM of the same bf16 values, chunk sums in fp32, within fp32 rounding."""
    from dflash.step.dspark_loss import _accumulate_w2_grad

    generator = torch.Generator().manual_seed(0)
    vocab, rows, rank = 5000, 700, 256
    grads = torch.randn(rows, vocab, generator=generator).cuda().bfloat16() * 1e-3
    latent = torch.randn(rows, rank, generator=generator).cuda().bfloat16()
    got = torch.zeros(vocab, rank, device="cuda")
    for start in range(0, rows, 256):  # chunks, as the fused head takes them
        _accumulate_w2_grad(got, grads[start : start + 256], latent[start : start + 256])
    want = grads.double().T @ latent.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def kernel_rows(device: str, dtype: torch.dtype, vocab: int = 5003):
    """[6, vocab] draft and target logits: a partial last tile, a tie for z's maximum (the first
    one counts, as torch.argmax), a row whose two distributions are equal (sign 0), labels at
    both ends of the vocabulary."""
    generator = torch.Generator().manual_seed(1)
    z = torch.randn(6, vocab, generator=generator) * 3
    t = torch.randn(6, vocab, generator=generator) * 3
    z[1, 7] = z[1, 4000] = 40.0
    t[2] = z[2]
    labels = torch.tensor([7, 7, 3, vocab - 1, 0, 4000])
    weights = torch.rand(6, generator=generator)
    return z.to(device, dtype), t.to(device, dtype), labels.to(device), weights.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_triton_terms_kernel_computes_the_formula(dtype):
    """variant.fused_terms=triton: CE, L1, acc, hit and the gradient of the chunk's logits equal
    the PyTorch formula's (`_chunk_terms_and_grads`) within fp32 rounding (bf16 gradients within
    one bf16 step); where p = q exactly the kernel's sign is 0, the formula's rounding noise, so
    that row's gradient is held to its own closed form."""
    from dflash.step.dspark_kernel import chunk_terms_and_grads
    from dflash.step.dspark_loss import _chunk_terms_and_grads

    z, t, labels, weights = kernel_rows("cuda", dtype)
    rows = torch.arange(6, device="cuda")
    got = chunk_terms_and_grads(z, t, rows, labels, weights, 0.3, 0.9)
    want = _chunk_terms_and_grads(z, t, rows, labels, weights, 0.3, 0.9)
    for name, g, w in zip(("ce", "l1", "acc"), got[:3], want[:3]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got[3], want[3]) and got[3][1]  # the tie at column 7 hits label 7
    others = [0, 1, 3, 4, 5]
    step = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[4][others].float(), want[4][others].float(), rtol=step, atol=1e-6)
    p = torch.softmax(z[2].float(), dim=-1)
    onehot = torch.nn.functional.one_hot(labels[2], z.shape[1]).float()
    torch.testing.assert_close(got[4][2].float(), weights[2] * 0.3 * (p - onehot), rtol=step, atol=1e-6)


@pytest.mark.gpu
def test_on_cuda_variant_fused_terms_triton_gives_the_reference_loss_and_gradients():
    """The whole DSpark loss with the kernel (fused, chunks of 3) against every logit through
    autograd, as the fused path's own test does, on CUDA in fp32."""
    from dflash.config.schema import FusedTerms

    results = []
    for logits_chunk, terms in ((0, FusedTerms.inductor), (3, FusedTerms.triton)):
        target, drafter, blocks, hidden, final = loss_inputs("vanilla")
        target, drafter = target.to("cuda"), drafter.to("cuda")
        hidden = hidden.detach().cuda().requires_grad_()
        stats = dspark_loss(
            hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks.to("cuda"), final_BSH=final.cuda(),
            weights=WEIGHTS, logits_chunk=logits_chunk, fused_terms=terms,
        )  # fmt: skip
        stats.weighted_ce.backward()
        results.append(
            (stats.weighted_ce.detach(), stats.l1, hidden.grad, drafter.markov_head.markov_w2.weight.grad)
        )
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_fused_terms_auto_picks_the_kernel_only_where_it_runs(monkeypatch):
    """auto: the Triton kernel on CUDA with triton installed; the PyTorch formula on a CPU, or
    without triton; an explicit choice stays as asked (triton off CUDA is refused earlier)."""
    import importlib.util

    from dflash.config.schema import FusedTerms
    from dflash.step.dspark_loss import resolve_fused_terms

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert resolve_fused_terms(FusedTerms.auto, cpu) is FusedTerms.inductor
    assert resolve_fused_terms(FusedTerms.auto, cuda) is FusedTerms.triton
    assert resolve_fused_terms(FusedTerms.inductor, cuda) is FusedTerms.inductor
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_fused_terms(FusedTerms.auto, cuda) is FusedTerms.inductor


@pytest.mark.slow
def test_the_compiled_chunk_gives_the_eager_chunks_loss_and_gradients():
    """drafter.compile's per-chunk kernel (torch.compile of the chunk's softmax, terms and
    gradient: the CUDA default) against the eager chunk it replaces."""
    results = []
    for compiled in (False, True):
        target, drafter, blocks, hidden, final = loss_inputs("gated")
        stats = dspark_loss(
            hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, final_BSH=final,
            weights=WEIGHTS, logits_chunk=3, compiled=compiled,
        )  # fmt: skip
        stats.weighted_ce.backward()
        results.append((stats.weighted_ce.detach(), hidden.grad, drafter.markov_head.markov_w2.weight.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("logits_chunk", [0, 3])
def test_a_batch_without_supervised_positions_gives_zero_loss_and_zero_gradients(logits_chunk):
    target, drafter, _, _, final = loss_inputs()
    blocks = dspark_blocks(torch.randint(0, 500, (2, 14)), torch.zeros(2, 14), num_anchors=3)
    hidden = torch.randn(2, blocks.labels.shape[1], 64, requires_grad=True)
    stats = dspark_loss(
        hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, final_BSH=final,
        weights=WEIGHTS, logits_chunk=logits_chunk,
    )  # fmt: skip
    stats.weighted_ce.backward()
    assert (
        float(stats.weighted_ce.detach()) == 0.0 and float(stats.weight) == 0.0 and float(stats.blocks) == 0.0
    )
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


# -- the target's final state -------------------------------------------------------------------


def test_final_state_comes_from_the_same_forward_after_the_final_norm():
    target = tiny_target(final_state=True)
    ids = torch.randint(0, 500, (2, 10))
    out = target.model(ids, output_hidden_states=True)
    features = target.features(ids)
    expected = torch.cat([out.hidden_states[2], out.hidden_states[4], out.hidden_states[-1]], dim=-1)
    torch.testing.assert_close(features, expected)
    # hidden_states[-1] is the normed final state: the LM head on it gives the model's logits.
    torch.testing.assert_close(target.lm_head(features[..., -64:]), out.logits)
    assert tiny_target(final_state=False).features(ids).shape[-1] == 2 * 64


# -- training -----------------------------------------------------------------------------------

DSPARK = ["variant=dspark", "variant.markov_rank=16"]
DSPARK_FIGURES = ("ce", "l1", "confidence_loss", "confidence_abs_error", "tau_prob")


def test_variant_dspark_trains_end_to_end_and_reports_its_figures(make_cfg):
    cfg = make_cfg(DSPARK + ["train.total_steps=4", "logger.every_steps=2", "data.val_samples=16"])
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["eval/lossless_frac"] == 1.0
    for name in DSPARK_FIGURES:
        assert math.isfinite(summary[f"train/{name}"]) and math.isfinite(summary[f"val/{name}"]), name
    assert 1.0 <= summary["train/tau_prob"] <= 1.0 + 4
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train_row = next(row for row in rows if "train/loss" in row)
    assert {f"train/accept_pos_{j}" for j in (1, 2, 3, 4)} <= train_row.keys()
    assert {f"train/confidence_pos_{j}" for j in (1, 2, 3, 4)} <= train_row.keys()
    assert "train/acc_pos_4" in train_row  # the anchor slot predicts: four drafts from a block of four
    loss = 0.1 * train_row["train/ce"] + 0.9 * train_row["train/l1"] + train_row["train/confidence_loss"]
    assert train_row["train/loss"] == pytest.approx(loss, rel=1e-5)
    checkpoint = load_drafter(Path(summary["checkpoint"]))
    assert isinstance(checkpoint, DSparkDrafter) and checkpoint.config.markov_rank == 16
    assert checkpoint.config.markov_head_type == "vanilla" and checkpoint.config.confidence_head_with_markov


@pytest.mark.slow
def test_variant_dspark_trains_on_a_hybrid_target(make_cfg, tiny_qwen3_next_dir):
    """Qwen3-Next (Gated DeltaNet + MoE): the final state runs the whole hybrid stack."""
    cfg = make_cfg(DSPARK + ["target=hf", f"target.path={tiny_qwen3_next_dir}", "train.total_steps=2"])
    summary = train(cfg)
    assert (
        summary["steps"] == 2 and math.isfinite(summary["train/l1"]) and summary["eval/lossless_frac"] == 1.0
    )


def test_a_dflash_checkpoint_warm_starts_dspark_and_a_dspark_checkpoint_resumes(make_cfg, tmp_path):
    plain = train(make_cfg(["train.total_steps=2"], output_dir=tmp_path / "dflash"))
    init = make_cfg(
        DSPARK + ["train.total_steps=2", f"drafter.init_from={plain['checkpoint']}"], tmp_path / "warm"
    )
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading

    models = build_models(check_before_loading(init))
    warm, source = models.drafters[0].state_dict(), load_drafter(Path(plain["checkpoint"])).state_dict()
    assert all(torch.equal(warm[name], tensor) for name, tensor in source.items())  # backbone loaded
    assert {k for k in warm if k not in source} == {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    # Only the heads start fresh: a checkpoint that lost a backbone tensor is refused, naming it.
    lost = "layers.0.self_attn.o_proj.weight"
    broken = without_tensor(Path(plain["checkpoint"]), tmp_path / "broken", lost)
    with pytest.raises(ValueError, match=rf"missing: \['{lost}'\]; unexpected: none"):
        build_models(
            check_before_loading(make_cfg(DSPARK + [f"drafter.init_from={broken}"], tmp_path / "no"))
        )
    # A backbone of another width is refused before any weights load, in one line naming the
    # checkpoint, the width and the key that sets it (the heads, which start fresh, are not compared).
    narrow = DSPARK + ["target.arch.hidden_size=32", f"drafter.init_from={plain['checkpoint']}"]
    with pytest.raises(ValueError) as refused:
        check_before_loading(make_cfg(narrow, tmp_path / "narrow"))
    message = str(refused.value)
    assert message.startswith(f"drafter.init_from={plain['checkpoint']} was trained for another drafter")
    assert "target hidden size: checkpoint 64, this run 32" in message and "target.arch:" in message
    assert "variant." not in message and "\n" not in message
    # Resumed mid-run (heads and their optimizer state included), the losses are the
    # uninterrupted run's, bitwise on CPU.
    every = ["train.total_steps=4", "logger.every_steps=1", "checkpoint.every_steps=2"]
    full = make_cfg(DSPARK + every, tmp_path / "full")
    train(full)
    step_2 = Path(full.paths.output_dir) / "checkpoints" / "step_0000002"
    resumed = make_cfg(DSPARK + every + [f"resume={step_2}"], tmp_path / "resumed")
    train(resumed)

    def losses(run_dir: Path) -> dict[int, float]:
        rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}

    expected, got = losses(Path(full.paths.output_dir)), losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4] and all(got[step] == expected[step] for step in got), (got, expected)


def test_a_dspark_checkpoint_does_not_start_a_run_with_other_heads(make_cfg, tmp_path):
    trained = train(make_cfg(DSPARK + ["train.total_steps=1"], tmp_path / "a"))
    for overrides, key in (
        (["variant=dflash"], "variant.markov_rank"),
        (DSPARK + ["variant.markov_head_type=gated"], "variant.markov_head_type"),
    ):
        cfg = make_cfg(
            overrides + ["train.total_steps=1", f"drafter.init_from={trained['checkpoint']}"], tmp_path / key
        )
        with pytest.raises(ValueError, match=key):
            train(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["variant.markov_rank=0"], "variant.confidence_with_markov=true needs a Markov head"),
        (["noise=mask_ramp"], "noise=mask_ramp is DFlash's"),
        (
            ["variant.confidence_head=false"],
            "variant.confidence_head=false needs variant.confidence_weight = 0",
        ),
        (["variant.confidence_weight=0"], "variant.confidence_head=true needs variant.confidence_weight > 0"),
        (["variant.markov_head_class=nowhere.Head"], "variant.markov_head_class"),
        (["variant.fused_terms=triton"], "variant.fused_terms=triton runs on CUDA only"),
    ],
)
def test_bad_dspark_settings_are_refused_naming_the_key(make_cfg, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(make_cfg(["variant=dspark", *overrides]))


def test_a_head_type_outside_the_three_is_refused_at_composition(make_cfg):
    with pytest.raises(ConfigCompositionException, match="markov_head_type"):
        make_cfg(["variant=dspark", "variant.markov_head_type=lstm"])


def test_a_dspark_drafter_starts_at_the_targets_init_std_and_dflash_keeps_its_own():
    """DeepSpec copies the target's config into the draft config, initializer_range included; a
    plain DFlash drafter keeps Qwen3Config's 0.02 (its runs unchanged)."""
    from dflash.step.build import run_drafter_config
    from dflash.step.variant import DFlashVariant, DSparkVariant

    target_config = AutoConfig.for_model("qwen3", **{**TINY_ARCH, "initializer_range": 0.05})
    cfg = DrafterConfig(name="t", num_layers=1, block_size=4, mask_token_id=MASK_ID, num_anchors=8)
    dspark = run_drafter_config(cfg, target_config, [1], DSparkVariant())
    dflash = run_drafter_config(cfg, target_config, [1], DFlashVariant())
    assert (dspark.initializer_range, dflash.initializer_range) == (0.05, 0.02)
    torch.manual_seed(0)
    weight = DSparkDrafter(dspark).layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(0.05, rel=0.05)


def test_drafter_from_config_picks_the_class_by_its_config(tmp_path):
    target = tiny_target()
    cfg = DrafterConfig(name="t", num_layers=1, block_size=4, mask_token_id=MASK_ID)
    plain = drafter_config(cfg, target.config, [1, 3])
    assert type(drafter_from_config(plain)).__name__ == "DFlashDrafter"
    assert isinstance(drafter_from_config(tiny_dspark(target).config), DSparkDrafter)


@pytest.mark.slow
def test_a_variant_sweep_runs_both_and_diff_shows_the_choice(tmp_path, data_cache, capsys):
    """`dflash-train -m variant=dflash,dspark`, then `dflash-diff` of the two jobs."""
    from dflash.tools import diff
    from tests.test_sweeps import sweep

    result = sweep(tmp_path, data_cache, "variant=dflash,dspark", "debug=fast")
    assert result.returncode == 0, result.stderr[-3000:]
    diff.main([str(tmp_path / "0"), str(tmp_path / "1")])
    text = capsys.readouterr().out
    assert "variant: dflash -> dspark" in text.split("choices:")[1].split("config:")[0]
    assert "variant.markov_rank: added (256)" in text
    metrics = text.split("metrics:")[1]
    assert "train/tau_prob" in metrics and "train/l1" in metrics


def test_the_documented_markov_head_of_ones_own_trains_and_reloads(make_cfg, tmp_path, monkeypatch):
    """docs/extending.md's ScaledMarkovHead by `variant.markov_head_class` alone: trained (its
    gain moves), written into config.json and rebuilt from the checkpoint."""
    from tests.test_extending import doc_example

    (tmp_path / "my_heads.py").write_text(doc_example("ScaledMarkovHead"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(DSPARK + ["variant.markov_head_class=my_heads.ScaledMarkovHead", "train.total_steps=2"])
    summary = train(cfg)
    drafter = load_drafter(Path(summary["checkpoint"]))
    assert type(drafter.markov_head).__name__ == "ScaledMarkovHead"
    assert drafter.config.markov_head_type == "my_heads.ScaledMarkovHead"
    assert drafter.markov_head.gain.abs().sum() > 0  # trained from zeros


@pytest.mark.slow
def test_the_asynchronous_pipeline_carries_the_final_state_as_the_sync_reference_does(make_cfg, tmp_path):
    """The target worker's features (final state included) cross the hidden-state queue and the
    drafter loop's copy: the same DSpark losses as the one-thread reference."""
    rows = {}
    for pipeline in ("sync", "async"):
        cfg = make_cfg(
            DSPARK + [f"pipeline={pipeline}", "train.total_steps=4", "logger.every_steps=2"],
            tmp_path / pipeline,
        )
        train(cfg)
        lines = (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
        rows[pipeline] = [
            {k: row[k] for k in ("train/loss", "train/l1", "train/confidence_loss", "train/tau_prob")}
            for row in map(json.loads, lines)
            if "train/loss" in row
        ]
    assert rows["sync"] and rows["sync"] == rows["async"]
