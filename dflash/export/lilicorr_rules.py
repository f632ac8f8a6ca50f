"""A LiLiCorr drafter's export: the z-lab layout with `architectures: [LiLiCorrDraftModel]`, the
head's geometry as `lilicorr_*` keys (and `lilicorr_enabled: true`) inside `dflash_config`, and the
head's `lilicorr.*` tensors beside the backbone's in model.safetensors. It is the layout SGLang's
LiLiCorr loader (`sglang/srt/models/lilicorr.py`, PR #37462: selected by the architecture, served
as DFlash with the head) and vLLM's (`qwen3_lilicorr`) read; both require every geometry key and a
power-of-two `lilicorr_candidate_topk`. No other layout holds the head: `LiLiCorrExport`
declares no layout beside its native one, so `dflash export convert` refuses the speculators and
DeepSpec layouts for it."""

from __future__ import annotations

from typing import Any, ClassVar

from dflash.drafters.lilicorr import (
    LILICORR_ARCHITECTURE,
    NUM_CANDIDATE_FEATURES,
    LiLiCorrDrafter,
    lattice_problems,
    lilicorr_settings,
)
from dflash.export.dflash2_rules import conv_tensor_shapes
from dflash.export.rules import VariantExport


def field_problems(config: dict[str, Any]) -> list[str]:
    """The readers' rules on the head's geometry, one line each naming the key."""
    return lattice_problems(config)


def describes_tensors(config: dict[str, Any]) -> bool:
    """Whether the config gives every head tensor's shape (its geometry keeps the rules)."""
    return not field_problems(config)


def _linear(name: str, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
    """An `nn.Linear`'s two tensors by name and shape."""
    return {f"{name}.weight": (out_features, in_features), f"{name}.bias": (out_features,)}


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The head's tensors by name and shape (dflash/drafters/lilicorr.py's LatticeHead)."""
    settings = lilicorr_settings(config)
    model = config["hidden_size"]
    width = settings["hidden_size"] or model
    slots = (config.get("block_size") or config["dflash_config"]["block_size"]) - 1
    heads, factor, topk = settings["num_heads"], settings["factor_dim"], settings["candidate_topk"]
    inner = int(width * settings["mlp_ratio"])
    head = "lilicorr"
    shapes: dict[str, tuple[int, ...]] = {
        f"{head}.slot_embedding": (1, 1, slots, 1, width),
        f"{head}.rank_embedding": (1, 1, 1, topk, width),
        f"{head}.relative_slot_bias": (heads, 2 * slots + 1),
        f"{head}.same_slot_bias": (heads,),
        **_linear(f"{head}.pass_hidden_proj", width, model),
        f"{head}.feature_mlp.0.weight": (NUM_CANDIDATE_FEATURES,),
        f"{head}.feature_mlp.0.bias": (NUM_CANDIDATE_FEATURES,),
        **_linear(f"{head}.feature_mlp.1", width, NUM_CANDIDATE_FEATURES),
        **_linear(f"{head}.feature_mlp.3", width, width),
        **_linear(f"{head}.context_proj", width, model),
        f"{head}.output_norm.weight": (width,),
        f"{head}.anchor_norm.weight": (width,),
        **_linear(f"{head}.factor_input_proj", width, 3 * width),
    }
    if width != model:
        shapes.update(_linear(f"{head}.token_proj", width, model))
    for name in ("out_head", "in_head", "anchor_out_head"):
        shapes.update(_linear(f"{head}.{name}", factor, width))
    if "conv_kernel_size" in settings:  # DFlash2's convolutions
        shapes.update(
            conv_tensor_shapes(
                config, kernel_size=settings["conv_kernel_size"], group_size=settings["conv_group_size"]
            )
        )
    for i in range(settings["num_layers"]):
        layer = f"{head}.layers.{i}"
        shapes.update(
            {
                f"{layer}.attn_norm.weight": (width,),
                f"{layer}.attn.in_proj_weight": (3 * width, width),
                f"{layer}.attn.in_proj_bias": (3 * width,),
                **_linear(f"{layer}.attn.out_proj", width, width),
                f"{layer}.mlp_norm.weight": (width,),
                **_linear(f"{layer}.mlp.0", inner, width),
                **_linear(f"{layer}.mlp.2", width, inner),
            }
        )
    return shapes


class LiLiCorrExport(VariantExport):
    """A LiLiCorr drafter's export rules: the z-lab layout only (SGLang's and vLLM's LiLiCorr
    loaders), `architectures: [LiLiCorrDraftModel]`, the head's geometry and tensors above."""

    drafter = LiLiCorrDrafter
    # Neither speculators nor DeepSpec has a LiLiCorr config: no reader loads the head there.
    other_layouts: ClassVar[tuple[str, ...]] = ()
    zlab_architecture = LILICORR_ARCHITECTURE
    speculators_type: ClassVar[str | None] = None
    speculators_architecture: ClassVar[str | None] = None
    # llama.cpp's converter and server know DFlash, DSpark and DFlash2 drafters only.
    llama_cpp_spec_type: ClassVar[str | None] = None

    def field_problems(self, config: dict[str, Any]) -> list[str]:
        return field_problems(config)

    def tensor_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(config)

    def describes_tensors(self, config: dict[str, Any]) -> bool:
        return describes_tensors(config)
