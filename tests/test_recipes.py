"""The published recipes (conf/experiment/recipe/): every value a recipe file sets reaches the run's
config, the matched experiment picks each variant's own recipe, and the values are the sources'
(each file's comments name them)."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from dflash.config.variant_schema import BUILT_IN_VARIANTS
from dflash.tools.compose import CONF_DIR, compose_config
from tests.conftest import yaml_leaves

RECIPES = CONF_DIR / "experiment" / "recipe"
MATCHED = "matched_smollm2"
VARIANTS = [variant.name for variant in BUILT_IN_VARIANTS]


def file_values(path) -> dict:
    spec = yaml.safe_load(path.read_text())
    spec.pop("defaults", None)
    return dict(yaml_leaves(spec))


def composed(overrides: list[str], tmp_path):
    return compose_config([*overrides, f"paths.output_dir={tmp_path / 'run'}"], return_hydra_config=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_matched_experiment_trains_each_variant_by_its_own_recipe(variant, tmp_path):
    """`-m variant=dflash,dspark,dflash2,lilicorr experiment=matched_smollm2`: each job's config holds its
    variant's recipe, except the keys the experiment sets for all (its budget), which win."""
    cfg = composed([f"variant={variant}", f"experiment={MATCHED}"], tmp_path)
    assert cfg.hydra.runtime.choices["experiment/recipe"] == variant
    budget = file_values(CONF_DIR / "experiment" / f"{MATCHED}.yaml")
    for key, value in file_values(RECIPES / f"{variant}.yaml").items():
        expected = budget.get(key, value)
        assert OmegaConf.select(cfg, key) == expected, (variant, key)
    for key, value in budget.items():
        assert OmegaConf.select(cfg, key) == value, key


LILICORR_KEYS = {
    f"variant.{name}"
    for name in (
        "ce_weight", "margin_weight", "penalty_weight", "margin", "candidate_topk",
        "num_layers", "num_heads", "mlp_ratio", "logit_scale", "vector_eps",
    )
}  # fmt: skip


def test_the_lilicorr_recipe_reaches_its_own_keys(tmp_path):
    """Its reranker's values (loss weights, top-K, lattice geometry) reach variant=lilicorr's keys.
    The recipe's values are the schema's defaults (the dataclass took them from the same source),
    so the file is composed a second time with every one of them moved: each moved value must
    arrive, which a recipe whose `variant:` block never reached the config would not do."""
    values = file_values(RECIPES / "lilicorr.yaml")
    assert {key for key in values if key.startswith("variant.")} == LILICORR_KEYS
    cfg = composed(["variant=lilicorr", "experiment/recipe=lilicorr"], tmp_path)
    for key, value in values.items():
        assert OmegaConf.select(cfg, key) == value, key
    spec = yaml.safe_load((RECIPES / "lilicorr.yaml").read_text())
    moved = {name: value * 2 for name, value in spec["variant"].items()}
    (tmp_path / "experiment" / "recipe").mkdir(parents=True)
    header = "# @package _global_\n"
    (tmp_path / "experiment" / "recipe" / "probe.yaml").write_text(
        header + yaml.safe_dump({**spec, "variant": moved})
    )
    cfg = composed(
        ["variant=lilicorr", "experiment/recipe=probe", f"hydra.searchpath=[file://{tmp_path}]"], tmp_path
    )
    for name, value in moved.items():
        assert OmegaConf.select(cfg, f"variant.{name}") == value, name


def test_without_an_experiment_no_recipe_applies(tmp_path):
    cfg = composed([], tmp_path)
    assert cfg.hydra.runtime.choices["experiment/recipe"] is None
    assert cfg.drafter.block_size == 4 and cfg.loss._target_ == "dflash.step.loss.BlockLoss"


# The sources' values, spelled out: a recipe file that drifts from its source fails here.
PUBLISHED = {
    # deepseek-ai/DeepSpec config/dspark/dspark_qwen3_8b.py
    "dspark": {
        "drafter.block_size": 7,
        "drafter.num_anchors": 512,
        "loss.gamma": 4.0,
        "loss._target_": "dflash.step.loss.BlockLoss",
        "variant.ce_weight": 0.1,
        "variant.tv_weight": 0.9,
        "variant.confidence_weight": 1.0,
        "variant.markov_rank": 256,
        "variant.markov_head_type": "vanilla",
        "optimizer.lr": 6.0e-4,
        "optimizer.grad_clip": 1.0,
        "lr_schedule.warmup_ratio": 0.04,
        "lr_schedule._target_": "dflash.step.lr_schedule.cosine_with_warmup",
    },
    # NVIDIA/Model-Optimizer dflash2_pinedrift.yaml: D-PACE, 256 anchors, selector alpha 1
    "dflash2": {
        "drafter.block_size": 16,
        "drafter.num_anchors": 256,
        "loss._target_": "dflash.step.dpace.DPaceLoss",
        "loss.alpha": 0.5,
        "variant.selector_alpha": 1.0,
        "variant.conv_kernel_size": 2,
        "variant.selector_rank": 256,
        "optimizer.lr": 6.0e-4,
        "lr_schedule.warmup_ratio": 0.04,
    },
    # NVIDIA/Model-Optimizer lilicorr.yaml (`base`): lattice terms 0.25 / 0 / 0.25, margin 2, top-8
    "lilicorr": {
        "drafter.block_size": 16,
        "drafter.num_anchors": 512,
        "loss.gamma": 7.0,
        "loss._target_": "dflash.step.loss.BlockLoss",
        "variant._target_": "dflash.step.lilicorr_variant.LiLiCorrVariant",
        "variant.ce_weight": 0.25,
        "variant.margin_weight": 0.0,
        "variant.penalty_weight": 0.25,
        "variant.margin": 2.0,
        "variant.candidate_topk": 8,
        "variant.num_layers": 2,
        "variant.num_heads": 8,
        "variant.mlp_ratio": 2.0,
        "variant.logit_scale": 8.0,
        "variant.vector_eps": 1.0e-4,
        "optimizer.lr": 6.0e-4,
        "lr_schedule.warmup_ratio": 0.04,
        "lr_schedule._target_": "dflash.step.lr_schedule.cosine_with_warmup",
    },
    # the DFlash paper's b16 recipe (z-lab publishes no trainer)
    "dflash": {
        "drafter.block_size": 16,
        "drafter.num_anchors": 512,
        "loss.gamma": 7.0,
        "loss._target_": "dflash.step.loss.BlockLoss",
        "optimizer.lr": 6.0e-4,
        "lr_schedule.warmup_ratio": 0.04,
        "lr_schedule._target_": "dflash.step.lr_schedule.cosine_with_warmup",
    },
}


def test_each_built_in_variant_has_a_recipe_and_its_sources():
    """A built-in variant added without a recipe (or a recipe without its sources' values here)
    would otherwise drop out of the tests above unnoticed."""
    assert VARIANTS and sorted(path.stem for path in RECIPES.glob("*.yaml")) == sorted(VARIANTS)
    assert sorted(PUBLISHED) == sorted(VARIANTS)


@pytest.mark.parametrize("variant", sorted(PUBLISHED))
def test_each_recipe_holds_its_sources_values(variant, tmp_path):
    cfg = composed([f"variant={variant}", f"experiment={MATCHED}"], tmp_path)
    for key, value in PUBLISHED[variant].items():
        assert OmegaConf.select(cfg, key) == value, (variant, key)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_matched_job_passes_the_checks_a_run_makes(variant, tmp_path):
    """What the run checks before weights load (a 30-layer target holding SmolLM2's mask id)."""
    from dflash.config.typed import typed_config
    from dflash.run.checks import validate

    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("")
    cfg = compose_config(
        [
            f"variant={variant}",
            f"experiment={MATCHED}",
            f"data.files=[{conversations}]",
            f"paths.output_dir={tmp_path}",
        ]
    )
    validate(typed_config(cfg), num_target_layers=30, target_vocab_size=49152, visible_cuda_devices=1)
