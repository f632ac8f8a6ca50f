"""The model card (README.md, Hugging Face format) beside every drafter dflash writes: each
checkpoint and each converted export says its target, shape, data size and steps, its last
evaluation's figures, and the commands that serve it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.export.card import CARD_FILE, TrainingFacts, model_card
from dflash.export.contract import check_export
from dflash.tools import export as export_tool
from dflash.train import train


def front_matter(card: str) -> list[str]:
    assert card.startswith("---\n"), card[:80]
    return card.split("---\n")[1].splitlines()


def test_every_checkpoint_has_a_card_and_the_last_one_its_final_evaluation(make_cfg, tmp_path, capsys):
    cfg = make_cfg(["train.total_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=3"])
    summary = train(cfg)
    checkpoints = Path(cfg.paths.output_dir) / "checkpoints"

    periodic = (checkpoints / "step_0000002" / CARD_FILE).read_text()
    assert "- speculative-decoding" in front_matter(periodic)
    assert "# DFlash drafter for tiny (random-init)" in periodic
    assert "| optimizer steps | 2 |" in periodic
    assert "| training samples | 48 |" in periodic  # data.num_samples=48, none held out
    assert "| data | data=tiny_synthetic |" in periodic
    assert "Not evaluated at this step" in periodic

    last = checkpoints / "last"
    card = (last / CARD_FILE).read_text()
    drafter = json.loads((last / "config.json").read_text())
    block = drafter["block_size"]
    assert f"| block_size | {block} |" in card
    assert f"| draft layers | {drafter['num_hidden_layers']} |" in card
    assert f"{drafter['dflash_config']['target_layer_ids']} of {drafter['num_target_layers']}" in card
    assert "| optimizer steps | 4 |" in card
    assert f"**tau {summary['eval/tau']:.3f}**" in card
    # The tiny default evaluates random-token prompts (no eval.benchmarks): named so, as the summary does.
    assert summary["eval/prompts"] == "random-token prompts"
    assert f"over {int(summary['eval/num_prompts'])} random-token prompts: " in card
    assert f"over {int(summary['eval/num_prompts'])} random-token prompts\n" in capsys.readouterr().out
    served = str((checkpoints / "step_0000004").resolve())  # the step `last` holds
    assert f"--speculative-draft-model-path {served}" in card
    assert "--model-path TARGET_MODEL_DIR" in card  # a random-init target has no directory to serve
    assert f'"model": "{served}", "num_speculative_tokens": {block - 1}' in card
    assert check_export(last) == []  # the card is no problem for any reader

    export_tool.main(["convert", str(last), str(tmp_path / "spec"), "--layout", "zlab"])
    converted = (tmp_path / "spec" / CARD_FILE).read_text()
    assert "| optimizer steps | 4 |" in converted and f"| block_size | {block} |" in converted
    assert str(tmp_path / "spec") in converted
    capsys.readouterr()


def test_a_hub_target_is_the_cards_base_model_and_a_local_path_is_not():
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_hidden_layers": 1}
    facts = TrainingFacts(target="Qwen/Qwen3-8B", data="data=conversations", samples=10, steps=5)
    assert "base_model: Qwen/Qwen3-8B" in front_matter(model_card(config, facts, directory="d"))
    served = TrainingFacts(target="/m/Q", target_path="/m/Q", data="d", samples=1, steps=1)
    assert "vllm serve /m/Q \\" in model_card(config, served, directory="d")
    local = TrainingFacts(target="/models/Qwen3-8B", data="data=conversations", samples=10, steps=5)
    assert not any(
        line.startswith("base_model") for line in front_matter(model_card(config, local, directory="d"))
    )
    unknown = model_card(config, None, directory="d")
    assert "Trained outside dflash" in unknown and "--speculative-num-draft-tokens 16" in unknown


def test_a_dflash2_drafters_card_names_it_and_shows_its_convolution_and_selector():
    """In either layout: the z-lab one keeps the fields in dflash_config, speculators' at the top."""
    fields = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 16, "selector_rank": 256}
    zlab = {"architectures": ["DFlash2DraftModel"], "block_size": 8, "dflash_config": fields}
    speculators = {"architectures": ["DFlash2DraftModel"], "block_size": 8, **fields}
    for config in (zlab, speculators):
        card = model_card(config, None, directory="d")
        assert "# DFlash2 drafter for" in card and "proposes 7 tokens" in card
        assert "| selector top-K | 16 |" in card and "| convolution taps | 2 |" in card
        assert "| selector rank | 256 |" in card and "| convolution channels per group | 16 |" in card
    assert "# DFlash drafter for" in model_card({"block_size": 16}, None, directory="d")


def test_the_prompts_evaluated_are_named_alike_in_the_summary_and_the_card():
    """Benchmarks by their names, random-token prompts as such: never 'held-out prompts', which
    reads as conversations like the training data's."""
    from dflash.config.schema import EvalConfig
    from dflash.run.inputs import eval_prompts_description
    from dflash.run.runner import format_summary

    config = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_hidden_layers": 1}
    for eval_cfg, words in (
        (EvalConfig(), "random-token prompts"),
        (
            EvalConfig(benchmarks={"mtbench": "m.jsonl", "humaneval": "h.jsonl"}),
            "prompts of humaneval, mtbench",
        ),
    ):
        figures = {
            "eval/tau": 1.5,
            "eval/num_prompts": 8.0,
            "eval/prompts": eval_prompts_description(eval_cfg),
        }
        facts = TrainingFacts(target="t", data="d", samples=1, steps=1, evaluation=figures)
        assert f"Greedy decoding over 8 {words}: **tau 1.500**" in model_card(config, facts, directory="d")
        summary = {
            "run_dir": "r",
            "checkpoint": "c",
            "steps": 1,
            "wall_s": 1.0,
            "pipeline": "sync",
            **{f"train/{k}{w}": 1.0 for k in ("loss", "acc") for w in ("", "_first_window")},
            **{f"train/tau_{k}": 1.0 for k in ("sim", "block", "decode")},
            **figures,
        }
        assert f"tau (spec decode) 1.500 over 8 {words}\n" in format_summary(summary) + "\n"
