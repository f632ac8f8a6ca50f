"""Every registered drafter variant through training, by its one registration
(dflash/step/variant_registry.py `register_variant`): it composes as `variant=<name>`, trains a
few steps on the tiny target, its checkpoint loads back as its drafter class, a resume from the
middle reproduces the uninterrupted run's losses and the variant's own figures bitwise, its
declared metric fields reach metrics.jsonl as its figures and its summary line prints. Among
them a variant defined here, outside the package: a head of one's own needs nothing edited
inside dflash/ to train, resume and report."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from dflash.config.schema import VariantConfig
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import registered_drafters
from dflash.export.zlab import load_drafter
from dflash.run.runner import figure, is_defined, variant_summary_lines
from dflash.step.loss import LossStats
from dflash.step.metrics import Field
from dflash.step.variant import DFlashVariant, DSparkVariant
from dflash.step.variant_registry import register_variant, registered_variants
from dflash.train import train
from tests.test_variant_contract import MarginDrafter

# --- a variant of one's own: MarginDrafter's training side -------------------------------------


@dataclasses.dataclass
class MarginVariantConfig(VariantConfig):
    """variant=test_margin: DFlash's blocks and loss, and a count of confident drafts."""

    _target_: str = "tests.test_variant_training.MarginVariant"
    # A draft is confident where its logit leads the runner-up's by more than this.
    confident_margin: float = 1.0


@dataclasses.dataclass
class MarginLossStats(LossStats):
    confident: torch.Tensor  # scalar: supervised positions whose draft is confident


@register_variant
@dataclasses.dataclass(frozen=True)
class MarginVariant(DFlashVariant):
    """DFlash trained as is, reporting the share of supervised drafts whose logit margin over the
    runner-up exceeds `confident_margin` (what MarginDrafter records per round when decoding)."""

    name: ClassVar[str] = MarginDrafter.variant_name
    drafter_class: ClassVar[type[DFlashDrafter]] = MarginDrafter
    options: ClassVar[type[VariantConfig]] = MarginVariantConfig
    metric_fields: ClassVar[tuple[Field, ...]] = (Field("confident"),)
    figure_names: ClassVar[tuple[str, ...]] = ("confident_frac",)
    undefined_because: ClassVar[dict[str, str]] = {"confident_frac": "no supervised position"}
    summary_key: ClassVar[str | None] = "train/confident_frac"
    console_figures: ClassVar[tuple[str, ...]] = ("confident_frac",)

    confident_margin: float = 1.0

    def drafter_config(self, config):
        config.dflash_config["margin_drafts"] = True  # what MarginDrafter.describes reads back
        return config

    def block_loss(self, hidden_BQH, *, lm_head, drafter, blocks, final_BSH, logits_chunk, compiled):
        stats = super().block_loss(
            hidden_BQH,
            lm_head=lm_head,
            drafter=drafter,
            blocks=blocks,
            final_BSH=final_BSH,
            logits_chunk=logits_chunk,
            compiled=compiled,
        )
        with torch.no_grad():
            top = lm_head(hidden_BQH.detach().to(lm_head.weight.dtype)).float().topk(2, dim=-1).values
            confident = ((top[..., 0] - top[..., 1]) > self.confident_margin) & blocks.valid
        return MarginLossStats(**vars(stats), confident=confident.sum().float())

    @classmethod
    def figures(cls, sums):
        supervised = sum(sums["counted"][1:])
        return {"confident_frac": sums["confident"] / supervised if supervised > 0 else float("nan")}

    @classmethod
    def summary_line(cls, summary, figure, defined):
        return f"{cls.name:<18}confident drafts {figure(summary, 'train/confident_frac')}"


# --- every registered variant through training -------------------------------------------------

EVERY = [
    "logger=console",
    "train.total_steps=4",
    "logger.every_steps=1",
    "checkpoint.every_steps=2",
    "eval.num_prompts=1",
    "eval.max_new_tokens=8",
]


def training_rows(run_dir: Path) -> dict[int, dict]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row for row in rows if "train/loss" in row}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("name", list(registered_variants()))
def test_a_variant_trains_resumes_exactly_and_reports_its_own_figures(name, make_cfg, tmp_path, capsys):
    variant = registered_variants()[name]
    summary = train(make_cfg([f"variant={name}", *EVERY], tmp_path / "full"))
    printed = capsys.readouterr().out.splitlines()
    full = training_rows(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4]
    assert type(load_drafter(Path(summary["checkpoint"]))) is variant.drafter_class

    # Its declared sums reach metrics.jsonl, as its figures and as the fields it reports itself.
    own = [f"train/{figure_name}" for figure_name in variant.figure_names]
    own += [f"train/{field.name}" for field in variant.metric_fields if field.per is not None]
    assert all(key in row for row in full.values() for key in own), (own, sorted(full[4]))
    assert all(f"train/{figure_name}" in summary for figure_name in variant.figure_names)
    # Some of them measured: `same` below lets an undefined figure (no rejected slot, no changed
    # pick in a tiny run) equal itself, so figures that were all undefined would pass the resume
    # check vacuously.
    measured = [key for key in own if full[4][key] is not None and math.isfinite(full[4][key])]
    assert measured or not own, full[4]

    # Its console figures on each window's console line.
    console = [line for line in printed if line.startswith("step ")]
    assert len(console) == 4 and all(
        f" {shown}=" in line for line in console for shown in variant.console_figures
    )

    # Its own summary line prints (none for a variant without one), and no other variant's.
    lines = variant_summary_lines(summary)
    own_line = [] if variant.summary_key is None else [variant.summary_line(summary, figure, is_defined)]
    assert lines == own_line and all(lines)
    assert all(line in printed for line in lines), (lines, printed)

    # Resumed from the middle: the uninterrupted run's losses and own figures, bitwise on CPU.
    step_2 = tmp_path / "full" / "checkpoints" / "step_0000002"
    train(make_cfg([f"variant={name}", *EVERY, f"resume={step_2}"], tmp_path / "resumed"))
    resumed = training_rows(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step, row in resumed.items():
        differing = [key for key in ("train/loss", *own) if not same(row[key], full[step][key])]
        assert not differing, (step, {key: (row[key], full[step][key]) for key in differing})


# --- a registration that forgets or takes something is refused whole -----------------------------


class ForgetfulDrafter(MarginDrafter):
    variant_name: ClassVar[str] = "test_forgetful"


@dataclasses.dataclass
class ForgetfulConfig(VariantConfig):
    _target_: str = "tests.test_variant_training.Forgetful"


@dataclasses.dataclass(frozen=True)
class Forgetful(MarginVariant):
    name: ClassVar[str] = "test_forgetful"
    drafter_class: ClassVar[type[DFlashDrafter]] = ForgetfulDrafter
    options: ClassVar[type[VariantConfig]] = ForgetfulConfig


def test_a_registration_that_forgets_or_takes_a_piece_is_refused_and_registers_nothing():
    from dflash.config.schema import COMPONENT_OPTIONS

    variants, drafters = registered_variants(), registered_drafters()
    options = dict(COMPONENT_OPTIONS["variant"])

    class Impostor(DSparkVariant):  # a second class under a taken name
        pass

    class Unnamed(Forgetful):  # its drafter class registers under another name
        name: ClassVar[str] = "test_unnamed"

    class Unbuilt(Forgetful):  # its options build another class
        pass

    class Silent(Forgetful):  # its summary line keyed on a figure it never reports
        summary_key: ClassVar[str | None] = "train/confident_share"

    class Mute(Forgetful):  # a summary figure but no line of its own
        summary_line = classmethod(DFlashVariant.summary_line.__func__)

    class Loud(Forgetful):  # a console figure it never reports
        console_figures: ClassVar[tuple[str, ...]] = ("confident_share",)

    for variant_class, message in (
        (Impostor, "variant 'dspark' is registered already"),
        (Unnamed, "its drafter_class ForgetfulDrafter is registered as 'test_forgetful'"),
        (Unbuilt, "its options ForgetfulConfig build 'tests.test_variant_training.Forgetful', not "),
        (Silent, "its summary_key 'train/confident_share' is none of its figure_names"),
        (Mute, "it has a summary_key but no summary_line of its own"),
        (Loud, "its console_figures ['confident_share'] are none of its figure_names"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            register_variant(variant_class)
    assert registered_variants() == variants and registered_drafters() == drafters
    assert COMPONENT_OPTIONS["variant"] == options  # nor its options: `variant=NAME` composes nothing
    assert register_variant(MarginVariant) is MarginVariant  # the same class again: nothing new
    assert registered_variants() == variants


def test_the_checks_ask_the_variant_which_noise_it_refuses():
    """A variant whose positions predict the token after them refuses noise that keeps positions
    unmasked (a kept token is the label of the position before it), naming itself; DFlash's own
    positions take it."""
    from dflash.config.schema import MaskRampNoiseConfig, NoNoiseConfig

    @dataclasses.dataclass(frozen=True)
    class Shifted(MarginVariant):
        label_offset: ClassVar[int] = 1

    ramp, options = MaskRampNoiseConfig(), MarginVariantConfig()
    assert Shifted.run_refusal(variant=options, noise=ramp) == (
        "noise=mask_ramp is DFlash's: with variant=test_margin use noise=none or noise=feature"
    )
    assert Shifted.run_refusal(variant=options, noise=NoNoiseConfig()) is None
    assert MarginVariant.run_refusal(variant=options, noise=ramp) is None
