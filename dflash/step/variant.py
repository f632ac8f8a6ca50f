"""The drafter variant (config group `variant`): which drafter a run trains and how it is scored.

Not `dflash/step/step_paths.py` (the step's reference and fast paths by name). A variant says:
- which drafter class is built and which fields its config carries (`drafter_config`, `drafter`);
- which token each block position predicts: position k of anchor a predicts token
  a + k + `label_offset` (DFlash: 0, so position 0, the anchor itself, predicts nothing;
  DSpark: 1, every position predicts the token after it);
- whether the target must hand over its final hidden state (`needs_final_state`: DSpark's loss
  compares the draft distribution with the target's), and whether the blocks carry each label's
  true previous token (`needs_prev_ids`: DSpark's Markov head, DFlash2's selector);
- the loss over the block positions (`block_loss`);
- what it reports: the sums its loss adds to the metric vector (`metric_fields`), the figures
  computed from them (`figure_names`, `figures`, `undefined_because`) and its own line in the
  run summary (`summary_key`, `summary_line`);
- which run settings outside its own node it refuses (`run_refusal`: a noise schedule, ...).

A variant is registered once, with its drafter class and its config options, by
dflash/step/variant_registry.py's `register_variant`.

Position weights follow the token predicted, w = exp(-(j - 1) / gamma) for the j-th token after
the anchor, in both variants (DFlash: j = k; DSpark: j = k + 1; dflash/step/blocks.py:
position_weights): `loss.gamma` keeps its meaning. The settings are checked where every
cross-field rule is (dflash/run/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Qwen3Config

from dflash.config.schema import (
    DFlash2VariantConfig,
    DFlashVariantConfig,
    DPaceLossConfig,
    DSparkVariantConfig,
    FusedTerms,
    MarkovHeadType,
    MaskRampNoiseConfig,
    VariantConfig,
)
from dflash.config.shape_defaults import default_conv_group_size, default_selector_top_k
from dflash.config.variant_schema import variant_options
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.dflash2 import DFlash2Drafter, add_dflash2_fields
from dflash.drafters.dspark import DSparkDrafter, add_dspark_fields, markov_head_class
from dflash.step.blocks import DraftBlocks
from dflash.step.dflash2_loss import dflash2_loss
from dflash.step.dflash2_metrics import DFLASH2_FIELDS, DFLASH2_FIGURES, dflash2_figures
from dflash.step.dspark_loss import DSparkWeights, dspark_loss, resolve_fused_terms
from dflash.step.dspark_metrics import DSPARK_FIELDS, DSPARK_FIGURES, dspark_figures
from dflash.step.loss import LossStats, draft_loss
from dflash.step.metrics import Field
from dflash.torch_runtime.kernel_libraries import installed


def unmeasured_taus(pick: str) -> dict[str, str]:
    """Why the block and decode taus of a head's `pick` and of the oracle over its candidates
    can be undefined: a window that measured no block."""
    names = (f"{pick}_tau_block", f"{pick}_tau_decode", "oracle_tau_block", "oracle_tau_decode")
    return dict.fromkeys(names, "no block measured")


@dataclass(frozen=True)
class DFlashVariant:
    """Plain DFlash (z-lab): position k >= 1 predicts token a + k; hard-label CE."""

    name: ClassVar[str] = "dflash"
    label_offset: ClassVar[int] = 0
    needs_final_state: ClassVar[bool] = False
    # The blocks carry each label's true previous token (DraftBlocks.prev_ids).
    needs_prev_ids: ClassVar[bool] = False
    # `block_loss` also takes the target's `embed_tokens=` and the fused `features_BSF=`.
    needs_context: ClassVar[bool] = False
    # The drafter's weights start at the target's init std (its config's initializer_range)
    # rather than Qwen3Config's 0.02.
    init_std_from_target: ClassVar[bool] = False
    # The drafter it trains (registered under `name`) and its config group option's schema (a
    # subclass's is set by @variant_options).
    drafter_class: ClassVar[type[DFlashDrafter]] = DFlashDrafter
    options: ClassVar[type[VariantConfig]] = DFlashVariantConfig
    # The sums its loss statistics add to the metric vector after DFlash's (each a field of the
    # `LossStats` subclass `block_loss` returns; dflash/step/metrics.py), and the figures
    # `figures` computes from them: train/ and val/ keys, summary figures, what `objective` may
    # name. `undefined_because`: why a figure that is a ratio can be undefined, by its name.
    metric_fields: ClassVar[tuple[Field, ...]] = ()
    figure_names: ClassVar[tuple[str, ...]] = ()
    undefined_because: ClassVar[Mapping[str, str]] = {}
    # Its figures the console line shows after DFlash's (dflash/monitor/sinks/console.py).
    console_figures: ClassVar[tuple[str, ...]] = ()

    def drafter_config(self, config: Qwen3Config) -> Qwen3Config:
        """The variant's fields added to a backbone config (in place)."""
        return config

    def drafter(self, config: Qwen3Config) -> DFlashDrafter:
        return self.drafter_class(config)

    @classmethod
    def figures(cls, sums: Mapping[str, Any]) -> dict[str, float]:
        """The variant's own figures from a window's (or the held-out split's) summed fields."""
        return {}

    @classmethod
    def run_refusal(cls, *, variant: VariantConfig, noise: Any, loss: Any = None) -> str | None:
        """Why the run's settings outside the variant's own node cannot train it (None: they
        can), in one line naming the config key; asked before any weights load
        (dflash/run/checks.py). A variant whose positions predict the token after them
        (`label_offset` 1) refuses a noise schedule that keeps positions unmasked: a kept
        position shows its true token, the label of the position before it. One that says
        `dpace_applies` False refuses loss=dpace."""
        if cls.label_offset and isinstance(noise, MaskRampNoiseConfig):
            return f"noise=mask_ramp is DFlash's: with variant={cls.name} use noise=none or noise=feature"
        if isinstance(loss, DPaceLossConfig) and not cls.dpace_applies:
            return f"loss=dpace reweighs the block CE, but variant={cls.name}'s references train it with the static decay; with variant={cls.name} use loss=default"
        return None

    # Whether loss=dpace (dflash/step/dpace.py) may weigh this variant's block CE; a variant whose
    # references train it with the static decay only says False and `loss=dpace` is refused.
    dpace_applies: ClassVar[bool] = True

    # The figure whose presence in a run summary means it holds the variant's own (None: the
    # variant prints no line of its own).
    summary_key: ClassVar[str | None] = None

    @classmethod
    def summary_lines(cls, summary: Mapping[str, Any], figure: Callable, defined: Callable) -> list[str]:
        """The variant's own lines in the run summary (dflash/run/runner.py), where `summary`
        holds its figures; `figure(summary, key)` formats one, `defined(value)` says whether a
        value is a finite number."""
        if cls.summary_key is None or cls.summary_key not in summary:
            return []
        return [cls.summary_line(summary, figure, defined)]

    @classmethod
    def summary_line(cls, summary: Mapping[str, Any], figure: Callable, defined: Callable) -> str:
        """The line `summary_lines` prints (a variant with a `summary_key` writes it)."""
        return ""

    def device_refusal(self, device: torch.device) -> str | None:
        """Why this variant's settings cannot train on `device` (None: they can); asked when the
        drafter is built, before any step."""
        return None

    def block_loss(
        self,
        hidden_BQH: torch.Tensor,
        *,
        lm_head: nn.Module,
        drafter: DFlashDrafter,
        blocks: DraftBlocks,
        final_BSH: torch.Tensor | None,
        logits_chunk: int,
        compiled: bool,
    ) -> LossStats:
        """The loss over the block positions. A subclass that reads only some of these takes the
        others as `**step` and passes them on to its loss by name (its loss takes lm_head,
        drafter, blocks, logits_chunk and compiled under the same names)."""
        return draft_loss(hidden_BQH, lm_head, blocks, logits_chunk, compiled=compiled)

    def final_state(self, final_BSH: torch.Tensor | None) -> torch.Tensor:
        """The target's final hidden states a `needs_final_state` variant's loss reads; refused
        when the step passed none."""
        if final_BSH is None:
            raise ValueError(f"variant={self.name} needs the target's final hidden states (none were passed)")
        return final_BSH


@dataclass(frozen=True)
@variant_options(DSparkVariantConfig)  # its options, their types and defaults
class DSparkVariant(DFlashVariant):
    """DSpark (deepseek-ai/DeepSpec): the DFlash backbone with a Markov head and a confidence
    head; every position predicts the token after it; loss ce_weight CE + tv_weight L1 +
    confidence_weight BCE against the target's own distribution (dflash/step/dspark_loss.py)."""

    name = "dspark"
    summary_key = "train/tau_prob"
    label_offset = 1
    # DeepSpec and ModelOpt's dspark.yaml train DSpark with the static decay only.
    dpace_applies = False
    needs_final_state = True
    needs_prev_ids = True
    # DeepSpec's draft config is a deep copy of the target's, initializer_range included
    # (SmolLM2-135M's 1/sqrt(576) = 0.042).
    init_std_from_target = True
    drafter_class = DSparkDrafter
    metric_fields = DSPARK_FIELDS
    figure_names = DSPARK_FIGURES
    undefined_because = {"tau_prob": "no block measured"}
    console_figures = ("tau_prob", "l1", "confidence_abs_error")

    @property
    def head_type(self) -> str:
        """What config.json records as `markov_head_type`: the built-in's name or the class path."""
        if self.markov_head_class:
            return self.markov_head_class
        return MarkovHeadType(self.markov_head_type).value

    def drafter_config(self, config: Qwen3Config) -> Qwen3Config:
        return add_dspark_fields(
            config,
            markov_rank=self.markov_rank,
            markov_head_type=self.head_type,
            confidence_head=self.confidence_head,
            confidence_with_markov=self.confidence_with_markov,
        )

    figures = staticmethod(dspark_figures)

    @classmethod
    def run_refusal(cls, *, variant, noise, loss=None):
        if variant.markov_head_class:
            try:
                markov_head_class(variant.markov_head_class)
            except ValueError as exc:
                return f"variant.markov_head_class: {exc}"
        return super().run_refusal(variant=variant, noise=noise, loss=loss)

    def device_refusal(self, device: torch.device) -> str | None:
        if FusedTerms(self.fused_terms) is not FusedTerms.triton:
            return None
        if torch.device(device).type != "cuda":
            return f"variant.fused_terms=triton runs on CUDA only (the drafter is on {device}); use inductor"
        if not installed("triton"):
            return "variant.fused_terms=triton needs triton (the gpu extra: pip install './dflash[gpu]'); use inductor"
        return None

    @property
    def weights(self) -> DSparkWeights:
        return DSparkWeights(ce=self.ce_weight, tv=self.tv_weight, confidence=self.confidence_weight)

    def block_loss(self, hidden_BQH, *, final_BSH, **step):
        return dspark_loss(
            hidden_BQH,
            final_BSH=self.final_state(final_BSH),
            weights=self.weights,
            fused_terms=resolve_fused_terms(FusedTerms(self.fused_terms), hidden_BQH.device),
            **step,
        )

    @classmethod
    def summary_line(cls, summary, figure, defined):
        return (
            f"dspark            ce {figure(summary, 'train/ce')}, l1 {figure(summary, 'train/l1')}, confidence "
            f"{figure(summary, 'train/confidence_loss')} (|error| {figure(summary, 'train/confidence_abs_error')}); "
            f"tau from the target's probabilities {figure(summary, 'train/tau_prob')}"
            + (f" ({figure(summary, 'val/tau_prob')} held out)" if "val/tau_prob" in summary else "")
        )


@dataclass(frozen=True)
@variant_options(DFlash2VariantConfig)
class DFlash2Variant(DFlashVariant):
    """DFlash2 (z-lab): the DFlash backbone with block-local convolutions around every sublayer and
    a selector over the unary top-K; positions predict as in DFlash; loss CE + selector_alpha x
    the selector's K-way CE with gold injection (dflash/step/dflash2_loss.py)."""

    name = "dflash2"
    summary_key = "train/selector_ce"
    needs_prev_ids = True
    drafter_class = DFlash2Drafter
    metric_fields = DFLASH2_FIELDS
    figure_names = DFLASH2_FIGURES
    undefined_because = {
        **unmeasured_taus("unary"),
        **dict.fromkeys(
            ("candidate_recall", "candidate_mass", "selector_changed", "unary_acc"), "no supervised position"
        ),
        "selector_changed_correct": "the selector changed no pick",
    }

    def drafter_config(self, config: Qwen3Config) -> Qwen3Config:
        group, top_k = self.conv_group_size, self.selector_top_k
        return add_dflash2_fields(
            config,
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=default_conv_group_size(config.hidden_size) if group is None else group,
            selector_rank=self.selector_rank,
            selector_top_k=(
                default_selector_top_k(config.hidden_size, config.vocab_size) if top_k is None else top_k
            ),
        )

    figures = staticmethod(dflash2_figures)

    def block_loss(self, hidden_BQH, *, final_BSH, **step):
        return dflash2_loss(hidden_BQH, selector_alpha=self.selector_alpha, **step)

    @classmethod
    def summary_line(cls, summary, figure, defined):
        return (
            f"dflash2           unary ce {figure(summary, 'train/ce')}, selector ce "
            f"{figure(summary, 'train/selector_ce')}; candidates recall {figure(summary, 'train/candidate_recall')}, "
            f"mass {figure(summary, 'train/candidate_mass')}; selector changed "
            f"{figure(summary, 'train/selector_changed')} of picks"
            # A share of the changed picks: none changed (a short run), nothing to score.
            + (
                f" ({figure(summary, 'train/selector_changed_correct')} of them right)"
                if defined(summary.get("train/selector_changed_correct"))
                else ""
            )
            + f"; tau_decode unary {figure(summary, 'train/unary_tau_decode')}, oracle "
            f"{figure(summary, 'train/oracle_tau_decode')}"
            + (
                f" ({figure(summary, 'val/unary_tau_decode')}, {figure(summary, 'val/oracle_tau_decode')} held out)"
                if "val/oracle_tau_decode" in summary
                else ""
            )
        )
