"""The LiLiCorr training side (variant=lilicorr): the DFlash backbone's blocks and labels, the
lattice head added to the drafter, and the loss of dflash/step/lilicorr_loss.py. Its distractor
penalty reads the target's logits, so the target hands over its final hidden state
(`needs_final_state`, as for DSpark); the head reads the target's embeddings and the context row
before each anchor (`needs_context`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from transformers import Qwen3Config

from dflash.config.variant_schema import LiLiCorrVariantConfig, variant_options
from dflash.models.lilicorr import GEOMETRY, LiLiCorrDrafter, add_lilicorr_fields
from dflash.step.lilicorr_loss import LatticeWeights, lilicorr_loss
from dflash.step.variant import DFlashVariant


@dataclass(frozen=True)
@variant_options(LiLiCorrVariantConfig)  # its options, their types and defaults
class LiLiCorrVariant(DFlashVariant):
    """LiLiCorr (arXiv 2608.20530): DFlash's positions and CE plus the lattice's CE, hinge and
    distractor penalty. Its options and defaults (ModelOpt's `lilicorr.yaml`, its `base`
    composition) are LiLiCorrVariantConfig's (dflash/config/variant_schema.py)."""

    name: ClassVar[str] = "lilicorr"
    needs_final_state: ClassVar[bool] = True
    needs_context: ClassVar[bool] = True

    def drafter_config(self, config: Qwen3Config) -> Qwen3Config:
        return add_lilicorr_fields(
            config,
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size,
            **{name: getattr(self, name) for name in GEOMETRY},
        )

    def drafter(self, config: Qwen3Config) -> LiLiCorrDrafter:
        return LiLiCorrDrafter(config)

    @property
    def weights(self) -> LatticeWeights:
        return LatticeWeights(
            ce=self.ce_weight,
            margin=self.margin_weight,
            penalty=self.penalty_weight,
            margin_width=self.margin,
        )

    def block_loss(
        self,
        hidden_BQH,
        *,
        lm_head,
        drafter,
        blocks,
        final_BSH,
        logits_chunk,
        compiled,
        embed_tokens,
        features_BSF,
    ):
        if final_BSH is None:
            raise ValueError("variant=lilicorr needs the target's final hidden states (none were passed)")
        return lilicorr_loss(
            hidden_BQH,
            lm_head=lm_head,
            embed_tokens=embed_tokens,
            drafter=drafter,
            blocks=blocks,
            features_BSF=features_BSF,
            final_BSH=final_BSH,
            weights=self.weights,
            logits_chunk=logits_chunk,
            compiled=compiled,
        )
