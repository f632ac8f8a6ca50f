"""The drafter's config group (`drafter`): its depth, block size, attention windows and compilation.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from dflash.config.target_schema import CompileScope


class AttentionKind(str, Enum):
    auto = "auto"  # flex on CUDA, sdpa on CPU
    flex = "flex"  # block-sparse flex_attention (CUDA: CPU flex_attention has no backward)
    sdpa = "sdpa"  # SDPA with the dense [B, Q, S + Q] mask: the reference


class LayerType(str, Enum):
    """A draft layer's attention, under the names the serving engines read from `layer_types`."""

    full_attention = "full_attention"  # every context key before the anchor
    sliding_attention = "sliding_attention"  # the context keys within drafter.sliding_window


@dataclass
class DrafterConfig:
    name: str = MISSING
    num_layers: int = MISSING
    block_size: int = MISSING
    mask_token_id: int = MISSING
    # Number of fused target layers (n_feat); ignored when target_layer_ids is given.
    num_features: int = 5
    # null: the default formula over the target's layer count (docs/ARCHITECTURE.md §1).
    target_layer_ids: Optional[list[int]] = None
    # Anchors (blocks) per sample per step; paper: 512.
    num_anchors: int = 512
    # Qwen3 fields of the draft layers; null copies the target's value.
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    # One entry per draft layer (null: all full_attention). A sliding_attention layer sees only
    # the context keys within sliding_window positions of each query (docs/ARCHITECTURE.md §1);
    # in-block attention stays bidirectional in every layer.
    layer_types: Optional[list[LayerType]] = None
    # Window of the sliding layers, in positions (>= block_size); required when any layer slides.
    sliding_window: Optional[int] = None
    init_seed: int = 0
    # Training attention kernel (decoding always uses the dense mask: one block per step).
    attention: AttentionKind = AttentionKind.auto
    # torch.compile the drafter (context projections + draft layers) and the fused loss
    # (null: on CUDA, off on CPU).
    compile: Optional[bool] = None
    # torch.compile's `dynamic` for the drafter's training graph: as target.compile_dynamic.
    compile_dynamic: Optional[bool] = True
    # What drafter.compile compiles: `stack`, the context projections and every draft layer as
    # one graph; `layers`, one layer (with its context projection) whose graph every layer of
    # the same kind reuses: a shorter first step (five DFlash2 layers with their convolutions
    # compile as one: 106 instead of 131 s on a 2-core CPU), kernels no longer fused across layers.
    compile_scope: CompileScope = CompileScope.stack
    # A drafter directory (config.json + model.safetensors: a checkpoint of ours or a z-lab-layout
    # export) whose weights this run starts from, with a fresh optimizer and schedule; it must be
    # a drafter of this shape for this target. A resumed run (`resume=`) takes its checkpoint's.
    init_from: Optional[str] = None
