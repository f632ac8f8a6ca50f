"""The validation split (data.val_samples): never trained on, measured like training measures."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import InterleavePlanner, held_out_ids
from dflash.step.blocks import block_attention_mask
from dflash.step.loss import BlockLoss, tau_from_accuracy
from dflash.step.step import BlockSettings, make_blocks
from dflash.train import train
from dflash.trainer.validation import Validation
from tests.test_dflash_rules import blocks_for, tiny_drafter, tiny_target


def test_held_out_samples_are_never_planned_and_the_rest_once_per_epoch():
    lengths = np.random.default_rng(0).integers(10, 129, size=300)
    held_out = held_out_ids(300, 40, seed=7)
    assert len(set(held_out.tolist())) == 40
    assert np.array_equal(held_out, held_out_ids(300, 40, seed=7))
    assert not np.array_equal(held_out, held_out_ids(300, 40, seed=8))
    planner = InterleavePlanner(
        lengths=lengths, bucket_edges=[48, 80, 128], tokens_per_batch=512, seed=0, held_out=held_out
    )
    for epoch in range(3):
        planned = [i for batch in planner.epoch(epoch) for i in batch.sample_ids]
        assert sorted(planned) == sorted(set(range(300)) - set(held_out.tolist()))


def test_a_split_that_leaves_nothing_to_train_names_the_key():
    with pytest.raises(ValueError, match=r"data.val_samples=300 must be >= 0 and leave samples to train on"):
        held_out_ids(300, 300, seed=0)


def test_validation_metrics_are_the_training_definitions_on_the_held_out_blocks():
    """val/acc, val/tau_sim and val/tau_block from the LM head's argmax over each held-out
    block, computed here directly; val/loss the weighted CE over the weights."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 500, size=n).tolist(), [0] * 6 + [1] * (n - 6)) for n in (30, 22, 40)]
    dataset = TokenDataset.from_samples(samples)
    settings = BlockSettings(seed=3, num_anchors=8, loss=BlockLoss(gamma=4.0))
    validation = Validation(
        dataset, np.array([0, 2]), settings=settings, tokens_per_batch=40, block_budget=None
    )
    assert [b.sample_ids for b in validation.batches] == [(0,), (2,)]  # 2 x 40 tokens would not fit
    metrics = validation.run(target, drafter)

    correct, counted = np.zeros(4), np.zeros(4)
    weighted_ce = weight = 0.0
    runs = []  # per block whose first prediction is supervised: its leading run of hits
    for batch in validation.batches:
        collated = collate(dataset, batch)
        blocks = make_blocks(collated, drafter, settings, keep_fraction=0.0)
        ids = collated.input_ids
        mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, ids.shape[1], 4)
        with torch.no_grad():
            hidden = drafter(
                target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, mask
            )
            logits = target.lm_head(hidden)
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), blocks.labels.flatten(), reduction="none"
        )
        weighted_ce += float((ce * blocks.weights.flatten()).sum())
        weight += float(blocks.weights.sum())
        hits = (logits.argmax(-1) == blocks.labels) & blocks.valid
        correct += hits.view(-1, 4).sum(0).numpy()
        counted += blocks.valid.view(-1, 4).sum(0).numpy()
        for block_hits, block_valid in zip(hits.view(-1, 4).tolist(), blocks.valid.view(-1, 4).tolist()):
            if block_valid[1]:
                run = 0
                while run < 3 and block_hits[1 + run]:
                    run += 1
                runs.append(run)
    assert metrics["val/loss"] == pytest.approx(weighted_ce / weight, rel=1e-5)
    assert metrics["val/acc"] == pytest.approx(correct[1:].sum() / counted[1:].sum())
    acc = [c / n if n else float("nan") for c, n in zip(correct, counted)]  # position 0: no label
    assert metrics["val/tau_sim"] == pytest.approx(tau_from_accuracy(acc))
    assert runs and metrics["val/tau_block"] == pytest.approx(1 + sum(runs) / len(runs))
    assert metrics["val/tau_decode"] == pytest.approx(len(runs) / sum(1 / (1 + run) for run in runs))


def test_a_copy_of_a_compiled_drafter_is_eager_and_no_grad_runs_eagerly():
    """Periodic evaluation deep-copies the training drafter: the copy must run its own weights,
    not the original's compiled graph; and validation (no_grad) must not compile a second graph."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    drafter.compile_training(counting_backend)
    ids = torch.randint(0, 500, (1, 20))
    blocks = blocks_for(ids, torch.ones(1, 20), num_anchors=3)
    mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, 20, 4)
    inputs = (target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, mask)
    with torch.no_grad():
        eager = drafter(*inputs)
    assert graphs == []
    compiled = drafter(*inputs)
    assert len(graphs) >= 1
    torch.testing.assert_close(compiled, eager)
    twin = copy.deepcopy(drafter)
    assert twin._compiled_forward is None
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert not torch.allclose(twin(*inputs), compiled)  # its own (zeroed) weights ran


def test_a_run_with_a_validation_split_logs_val_metrics_beside_training(make_cfg, tmp_path):
    cfg = make_cfg(
        [
            "data.val_samples=12",
            "train.total_steps=12",
            "logger.every_steps=3",
            "eval.every_steps=6",
            "eval.periodic_num_prompts=1",
        ]
    )
    summary = train(cfg)
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    val_steps = [r["step"] for r in rows if "val/tau_sim" in r]
    assert val_steps[:2] == [6, 12]  # at each periodic evaluation, then the final one
    assert summary["val_samples"] == 12 and summary["val/tau_sim"] >= 1.0
    assert 0.0 <= summary["val/acc"] <= 1.0 and summary["val/loss"] > 0


@pytest.mark.slow
def test_val_tau_decode_predicts_the_tau_decoding_measures(tmp_path, data_cache):
    """The `make train` setup (held-out samples and evaluation prompts drawn alike), 400 steps:
    val/tau_decode lands within 10% of the tau that decoding 32 held-out prompts measures, and
    nearer to it than tau_block, the arithmetic mean a decoder's rounds do not follow (measured:
    tau 1.50, tau_decode 1.45, tau_block 2.11, tau_sim 1.73)."""
    from tests.conftest import compose_config

    summary = train(
        compose_config(
            ["data.val_samples=64", "eval.num_prompts=32", "train.total_steps=400", "monitor.interval_s=0"],
            tmp_path / "run",
            data_cache,
        )
    )
    measured, decode = summary["eval/tau"], summary["val/tau_decode"]
    assert abs(decode - measured) / measured < 0.10, summary
    assert abs(decode - measured) < abs(summary["val/tau_block"] - measured)
