"""The LiLiCorr training side (variant=lilicorr): the DFlash backbone's blocks and labels, the
lattice head added to the drafter, and the loss of dflash/step/lilicorr_loss.py. Its distractor
penalty reads the target's logits, so the target hands over its final hidden state
(`needs_final_state`, as for DSpark); the head reads the target's embeddings and the context row
before each anchor (`needs_context`). Registered once, with its drafter class and options
(dflash/step/variant_registry.py); its figures are dflash/step/lilicorr_metrics.py's."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3Config

from dflash.config.variant_schema import LiLiCorrVariantConfig, variant_options
from dflash.drafters.lilicorr import GEOMETRY, LiLiCorrDrafter, add_lilicorr_fields
from dflash.step.candidate_taus import unmeasured_taus
from dflash.step.lilicorr_loss import LatticeWeights, lilicorr_loss
from dflash.step.lilicorr_metrics import LILICORR_FIELDS, LILICORR_FIGURES, lilicorr_figures
from dflash.step.variant import DFlashVariant, static_decay_only


@dataclass(frozen=True)
@variant_options(LiLiCorrVariantConfig)  # its options, their types and defaults
class LiLiCorrVariant(DFlashVariant):
    """LiLiCorr (arXiv 2608.20530): DFlash's positions and CE plus the lattice's CE, hinge and
    distractor penalty. Its options and defaults (ModelOpt's `lilicorr.yaml`, its `base`
    composition) are LiLiCorrVariantConfig's (dflash/config/variant_schema.py)."""

    name = "lilicorr"
    needs_final_state = True
    needs_context = True
    drafter_class = LiLiCorrDrafter
    metric_fields = LILICORR_FIELDS
    figure_names = LILICORR_FIGURES
    undefined_because = {
        **unmeasured_taus("top1"),
        **dict.fromkeys(("lattice_ce", "lattice_margin", "lattice_penalty"), "no supervised slot"),
    }
    # The served decision path's tau is the standard tau_decode (the walk's picks); the summary
    # sets it beside what the backbone's argmax alone would reach.
    summary_key = "train/top1_tau_decode"
    console_figures = ("top1_tau_decode", "lattice_ce")

    def drafter_config(self, config: Qwen3Config) -> Qwen3Config:
        return add_lilicorr_fields(
            config,
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size,
            **{name: getattr(self, name) for name in GEOMETRY},
        )

    figures = staticmethod(lilicorr_figures)

    @classmethod
    def run_refusal(cls, *, variant, noise, loss=None):
        # ModelOpt's lilicorr.yaml trains it with the static decay (dflash_loss_decay_factor 7.0)
        # and no D-PACE weighting; the lattice's terms are per slot, outside the weights D-PACE
        # sets, so loss=dpace would reweigh only the backbone's CE against a recipe that never did.
        return super().run_refusal(variant=variant, noise=noise, loss=loss) or static_decay_only(
            cls.name, loss
        )

    @classmethod
    def summary_line(cls, summary, figure, defined):
        return (
            f"lilicorr          ce {figure(summary, 'train/ce')}, lattice ce {figure(summary, 'train/lattice_ce')}, "
            f"penalty {figure(summary, 'train/lattice_penalty')}; tau_decode walk "
            f"{figure(summary, 'train/tau_decode')}, backbone argmax {figure(summary, 'train/top1_tau_decode')}, "
            f"oracle {figure(summary, 'train/oracle_tau_decode')}"
            + (
                f" ({figure(summary, 'val/tau_decode')}, {figure(summary, 'val/top1_tau_decode')}, "
                f"{figure(summary, 'val/oracle_tau_decode')} held out)"
                if "val/top1_tau_decode" in summary
                else ""
            )
        )

    @property
    def weights(self) -> LatticeWeights:
        return LatticeWeights(
            ce=self.ce_weight,
            margin=self.margin_weight,
            penalty=self.penalty_weight,
            margin_width=self.margin,
        )

    def block_loss(self, hidden_BQH, *, final_BSH, **step):
        return lilicorr_loss(hidden_BQH, final_BSH=self.final_state(final_BSH), weights=self.weights, **step)
