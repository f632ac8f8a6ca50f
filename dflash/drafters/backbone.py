"""The DFlash drafter: Qwen3-style layers with target-context KV injection.

Parameter names follow the z-lab / SGLang / vLLM layout (`layers.*`, `fc`, `hidden_norm`,
`norm`) so `state_dict()` is the exported checkpoint as is. The drafter owns no embedding and
no LM head: callers pass block embeddings from the target's frozen `embed_tokens` and project
the returned hidden states with the target's frozen `lm_head`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from dflash.config.schema import DrafterConfig, LayerType
from dflash.drafters.rope import rotate
from dflash.drafters.round_tally import DecodedRounds, RoundTally
from dflash.torch_runtime.compile import compile_shared

# Qwen3 fields a drafter copies from its target (hidden size must match: KV injection and the
# shared embed_tokens / lm_head see the target's hidden states).
_COPIED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
)


def drafter_config(cfg: DrafterConfig, target: PretrainedConfig, layer_ids: list[int]) -> Qwen3Config:
    """The drafter's Qwen3Config: target fields, drafter overrides and the DFlash fields."""
    # Hybrid targets (Qwen3-Next) nest text fields the same way; getattr keeps this generic.
    fields = {
        name: getattr(target, name) for name in _COPIED_FIELDS if getattr(target, name, None) is not None
    }
    if "rope_parameters" in fields:
        # Draft layers rotate the whole head (Qwen3); a hybrid target's partial rotary does not apply.
        fields["rope_parameters"] = {
            k: v for k, v in fields["rope_parameters"].items() if k != "partial_rotary_factor"
        }
    if "head_dim" not in fields:
        fields["head_dim"] = target.hidden_size // target.num_attention_heads
    for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        value = getattr(cfg, name)
        if value is not None:
            fields[name] = value
    if "intermediate_size" not in fields:
        # A stack of expert MLPs only (Qwen3.5-MoE) has no dense width to copy, and Qwen3Config's
        # default (22016) would silently give the drafter an MLP ten times the target's hidden size.
        raise ValueError(
            f"drafter.intermediate_size must be set: the target ({target.model_type}) has no dense MLP "
            f"width to copy (its MLPs are experts); e.g. drafter.intermediate_size={3 * target.hidden_size}"
        )
    layer_types = [
        LayerType(kind).value for kind in cfg.layer_types or [LayerType.full_attention] * cfg.num_layers
    ]
    sliding = LayerType.sliding_attention.value in layer_types
    config = Qwen3Config(
        **fields,
        num_hidden_layers=cfg.num_layers,
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=layer_types,
        # transformers (4.57 and 5 alike) drops sliding_window when use_sliding_window is false.
        use_sliding_window=sliding,
        sliding_window=cfg.sliding_window if sliding else None,
    )
    # Every layer attends to its own block bidirectionally (the reference runs is_causal=False);
    # SGLang and vLLM run a sliding layer causally unless the config says otherwise.
    config.is_causal = False
    config.architectures = ["DFlashDraftModel"]
    config.block_size = cfg.block_size
    config.num_target_layers = target.num_hidden_layers
    config.dflash_config = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(layer_ids)}
    return config


Mask = Union[torch.Tensor, BlockMask]
# One mask per distinct window of the drafter's layers (None: full attention), or one mask for
# a drafter whose layers are all full attention.
LayerMasks = Union[Mask, Mapping[Union[int, None], Mask]]


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each draft layer's sliding window, None for a full-attention layer (config.layer_types,
    as transformers resolves it; absent: every layer full)."""
    layer_types = (
        getattr(config, "layer_types", None) or [LayerType.full_attention.value] * config.num_hidden_layers
    )
    sliding = LayerType.sliding_attention.value in layer_types
    if sliding and getattr(config, "sliding_window", None) is None:
        # transformers nulls the window when use_sliding_window is false: which attention such
        # a drafter was trained with cannot be told, so it is not guessed.
        raise ValueError(
            "layer_types holds sliding_attention layers but sliding_window is null (use_sliding_window "
            "false?): set sliding_window (and use_sliding_window: true) in the drafter's config.json"
        )
    return [
        config.sliding_window if kind == LayerType.sliding_attention.value else None for kind in layer_types
    ]


@functools.cache
def _compiled_flex_attention():
    return compile_shared(flex_attention, dynamic=True)


def _flex_attention(q, k, v, block_mask: BlockMask, enable_gqa: bool) -> torch.Tensor:
    """flex_attention, compiled on CUDA (the fused block-sparse kernel; eager flex materialises
    every score and has no CPU backward). Inside a compiled drafter layer it is traced as is.
    Shapes are dynamic: one compile serves every batch shape of a run."""
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


class DFlashAttention(nn.Module):
    """Queries from block tokens; keys/values = [proj(context); proj(block)] with the same weights."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], num_heads, self.head_dim)

    def context_kv(
        self, ctx_BSH: torch.Tensor, ctx_rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the context positions; they depend on the target features alone
        (not on the block), so decoding caches them and appends as tokens are committed."""
        k_ctx = self.k_norm(self._heads(self.k_proj(ctx_BSH), self.num_kv_heads)).transpose(1, 2)
        k_ctx = rotate(k_ctx, *ctx_rope)
        v_ctx = self._heads(self.v_proj(ctx_BSH), self.num_kv_heads).transpose(1, 2)
        return k_ctx, v_ctx

    def forward(
        self,
        block_BQH: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        block_rope: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | BlockMask,
    ) -> torch.Tensor:
        """attn_mask: a dense bool [B, 1, Q, S + Q] mask (True = visible) or the same rule as a
        flex_attention BlockMask (dflash.step.block_mask)."""
        bsz, q_len, _ = block_BQH.shape
        q = self.q_norm(self._heads(self.q_proj(block_BQH), self.num_heads)).transpose(1, 2)
        k_blk = self.k_norm(self._heads(self.k_proj(block_BQH), self.num_kv_heads)).transpose(1, 2)
        v_blk = self._heads(self.v_proj(block_BQH), self.num_kv_heads).transpose(1, 2)
        # RoPE at absolute positions: context at 0..S-1, block token k of anchor a at a + k.
        q, k_blk = rotate(q, *block_rope), rotate(k_blk, *block_rope)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        gqa = self.num_heads != self.num_kv_heads
        if isinstance(attn_mask, BlockMask):
            out = _flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # DFlash2 (dflash/drafters/dflash2.py) sets a block-local convolution around each sublayer.
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    @staticmethod
    def _around(conv: nn.Module | None, sublayer, x_BQH: torch.Tensor) -> torch.Tensor:
        if conv is None:
            return sublayer(x_BQH)
        x_BQH, out_taps = conv.prepare(x_BQH)
        return conv.finish(sublayer(x_BQH), out_taps)

    def forward(self, hidden_BQH, ctx_kv, block_rope, attn_mask):
        def attention(x_BQH):
            return self.self_attn(x_BQH, ctx_kv, block_rope, attn_mask)

        hidden_BQH = hidden_BQH + self._around(
            self.attention_conv, attention, self.input_layernorm(hidden_BQH)
        )
        return hidden_BQH + self._around(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden_BQH))


def differing_fields(
    fields: Mapping[str, str], saved: Mapping[str, Any], run: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """(run config key, saved value, run value) for each of `fields` (name -> key) whose values
    differ between two configs' field mappings."""
    return [
        (key, saved.get(name), run.get(name))
        for name, key in fields.items()
        if saved.get(name) != run.get(name)
    ]


class DFlashDrafter(nn.Module):
    """The DFlash backbone, and the decoding interface every drafter variant answers (a variant
    subclasses it and overrides what it drafts differently; the decoders, export and reports ask
    the object, never its class): `drafts_per_block`, `verify_len`, `samples_drafts`,
    `draft_block` and `add_round_figures`.

    Per-round figures: `draft_block` may return an extra beside the drafts (`round_extra` names
    it); after each round the decoders hand it, read to the host, with the round's outcome to
    `add_round_figures`, which records the variant's figures on the decode result by name
    (`result.record_round({name: value})`; the result keeps one list per name). `round_tally`
    names the class that sums those figures over an evaluation's decodings and turns them into
    the evaluation result's fields (dflash.drafters.round_tally.RoundTally); the evaluation asks
    the drafter for it, so a variant defined anywhere records and reports its own figures."""

    # The variant's registered name (dflash.drafters.drafter_registry).
    variant_name: ClassVar[str] = "dflash"
    # Whether drafts can be sampled at a temperature (`draft_block` reads its chooser's noise);
    # a DFlash drafter proposes its argmax at every temperature.
    samples_drafts: ClassVar[bool] = False
    # The layout its export takes (a layout of dflash/export/export_registry.py), and how it is named
    # to a user.
    native_layout: ClassVar[str] = "zlab"
    display_name: ClassVar[str] = "DFlash"
    # Its model card's words (dflash/export/card.py): the name in the title, a paragraph beside
    # the backbone's (None: none) and the config.json fields its shape table adds, (label, key).
    card_name: ClassVar[str] = "DFlash"
    card_words: ClassVar[str | None] = None
    card_fields: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Its export's reader asserts `num_anchors` in config.json (DeepSpec's).
    records_num_anchors: ClassVar[bool] = False
    # What the second output of `draft_block` is, by the name the reference decoder's context
    # exposes it under (None: the variant returns none).
    round_extra: ClassVar[str | None] = None
    # The tally of the figures `add_round_figures` records (None: it records none).
    round_tally: ClassVar[type[RoundTally] | None] = None
    # Submodules a subclass adds to the DFlash backbone, by attribute name (found anywhere in a
    # parameter's dotted name): a DFlash drafter's weights warm-starting the subclass
    # (drafter.init_from) hold none of them, and they keep their fresh init.
    added_modules: ClassVar[tuple[str, ...]] = ()
    # Variants (by name) whose checkpoints may start this one too, beside the backbone's
    # (drafter.init_from, `warm_starts`): the parts both have load, the source's other added
    # modules are left out, this one's own start fresh.
    warm_starts_from: ClassVar[tuple[str, ...]] = ()
    # Whether `draft_block` also takes the target's `embed_tokens=` and `anchor_row_1H=`, the
    # projected context row before the anchor (`context` of the features at anchor - 1): the
    # decoders keep those rows for a drafter that reads them.
    reads_anchor_row: ClassVar[bool] = False
    # The fields a config lacks when `describes` refuses it, as the refusal names them.
    described_by: ClassVar[str] = ""

    def __init__(self, config: Qwen3Config):
        if not self.describes(config):
            raise ValueError(f"a {self.display_name} drafter config needs {self.described_by}")
        super().__init__()
        self.config = config
        self.block_size: int = config.block_size
        self.mask_token_id: int = config.dflash_config["mask_token_id"]
        self.target_layer_ids: list[int] = list(config.dflash_config["target_layer_ids"])
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        if getattr(config, "is_causal", None) is True:
            raise ValueError(
                "this drafter config sets is_causal: true (causal attention inside the block); "
                "dflash trains and decodes DFlash drafters with bidirectional blocks only"
            )
        self.layer_windows = layer_windows(config)
        if any(window is not None and window < self.block_size for window in self.layer_windows):
            raise ValueError(
                f"sliding_window={config.sliding_window} is shorter than block_size={self.block_size}: "
                "a sliding layer would not see its own block"
            )
        # The distinct windows, in layer order: callers build one attention mask per entry.
        self.windows: tuple[int | None, ...] = tuple(dict.fromkeys(self.layer_windows))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        # Not a parameter and not exported: recomputed from config.
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._compiled_forward = None  # compile_training: context projections + layers, one graph
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def context(
        self,
        features_BSF: torch.Tensor,
        feature_noise_std: float = 0.0,
        noise_generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """fc + hidden_norm over the concatenated target layers, plus noise=feature's Gaussian."""
        ctx_BSH = self.hidden_norm(self.fc(features_BSF.to(self.fc.weight.dtype)))
        if feature_noise_std > 0.0:
            noise = torch.randn(
                ctx_BSH.shape, generator=noise_generator, device=ctx_BSH.device, dtype=ctx_BSH.dtype
            )
            ctx_BSH = ctx_BSH + feature_noise_std * noise
        return ctx_BSH

    def context_kv(
        self,
        features_BSF: torch.Tensor,
        positions_BS: torch.Tensor,
        feature_noise_std: float = 0.0,
        noise_generator: torch.Generator | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the keys and values of context positions `positions_BS`."""
        ctx_BSH = self.context(features_BSF, feature_noise_std, noise_generator)
        ctx_rope = self.rotary_emb(ctx_BSH, positions_BS)
        return [layer.self_attn.context_kv(ctx_BSH, ctx_rope) for layer in self.layers]

    def _per_layer(self, masks: LayerMasks) -> tuple[Mask, ...]:
        """Each layer's mask (dense ones given the head axis), from one mask per window."""
        if not isinstance(masks, Mapping):
            if self.windows != (None,):
                raise ValueError(
                    f"this drafter has sliding layers (windows {self.windows}): pass one attention "
                    "mask per window (dflash.step.blocks.layer_masks with drafter.windows)"
                )
            masks = {None: masks}
        missing = [window for window in self.windows if window not in masks]
        if missing:
            raise ValueError(f"no attention mask for the layers of window(s) {missing}")
        shaped = {
            window: mask if isinstance(mask, BlockMask) else mask.unsqueeze(1)
            for window, mask in masks.items()
        }
        return tuple(shaped[window] for window in self.layer_windows)

    def _layers(
        self,
        hidden_BQH: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        block_rope: tuple[torch.Tensor, torch.Tensor],
        masks: tuple[Mask, ...],
    ) -> torch.Tensor:
        for layer, layer_kv, mask in zip(self.layers, ctx_kv, masks):
            hidden_BQH = layer(hidden_BQH, layer_kv, block_rope, mask)
        return self.norm(hidden_BQH)

    def _context_and_layers(
        self,
        ctx_BSH: torch.Tensor,
        ctx_rope: tuple[torch.Tensor, torch.Tensor],
        hidden_BQH: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        masks: tuple[Mask, ...],
        *,
        layer_step: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The training forward's part that `compile_training` compiles: each layer's context
        keys/values (k/v projections, k-norm, RoPE), then the layer (`layer_step`, by default
        `_context_and_layer`), then the final norm. The projections' norm and rotation are small
        elementwise kernels over every context position of every layer, which a compiled graph
        fuses, forward and backward."""
        layer_step = layer_step or self._context_and_layer
        for layer, mask in zip(self.layers, masks):
            hidden_BQH = layer_step(layer, ctx_BSH, ctx_rope, hidden_BQH, block_rope, mask)
        return self.norm(hidden_BQH)

    def _context_and_layer(
        self,
        layer: nn.Module,
        ctx_BSH: torch.Tensor,
        ctx_rope: tuple[torch.Tensor, torch.Tensor],
        hidden_BQH: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        mask: Mask,
    ) -> torch.Tensor:
        """One draft layer with its own context keys/values: what `scope="layers"` compiles. The
        layer is an input (its weights the graph's arguments), so one graph serves every layer."""
        return layer(hidden_BQH, layer.self_attn.context_kv(ctx_BSH, ctx_rope), block_rope, mask)

    def compile_training(
        self, backend: Any = "inductor", dynamic: bool | None = True, scope: str = "stack"
    ) -> None:
        """Compile the training forward's context projections and draft layers (`dynamic`: True,
        one graph with symbolic shapes for batches of any size; None, torch's default: exact
        shapes until one changes). `scope`: "stack", all layers as one graph (kernels fuse across
        layers); "layers", one layer's graph shared by every layer of the same kind (a fraction
        of the compile time; the final norm eager). fc, hidden_norm and the feature noise stay
        eager (a seeded generator). Decoding (`draft`) stays eager: it runs under no_grad with a
        growing cache, shapes a training graph would only be recompiled for."""
        if scope == "stack":
            self._compiled_forward = compile_shared(
                self._context_and_layers, backend=backend, dynamic=dynamic
            )
        elif scope == "layers":
            compiled_layer = compile_shared(self._context_and_layer, backend=backend, dynamic=dynamic)
            self._compiled_forward = functools.partial(self._context_and_layers, layer_step=compiled_layer)
        else:
            raise ValueError(f"drafter.compile_scope={scope!r}: one of stack, layers")

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) is eager: the compiled function is bound to this instance.
        state = dict(self.__dict__)
        state["_compiled_forward"] = None
        return state

    def _block_inputs(
        self, block_emb_BQH: torch.Tensor, block_pos_BQ: torch.Tensor, attn_masks: LayerMasks
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[Mask, ...]]:
        hidden = block_emb_BQH.to(self.fc.weight.dtype)
        block_rope = self.rotary_emb(hidden, block_pos_BQ)
        return hidden, block_rope, self._per_layer(attn_masks)

    def draft(
        self,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        block_emb_BQH: torch.Tensor,
        block_pos_BQ: torch.Tensor,
        attn_masks: LayerMasks,
    ) -> torch.Tensor:
        """Hidden states of the block positions (after the final norm), [B, Q, H]; eager."""
        hidden, block_rope, masks = self._block_inputs(block_emb_BQH, block_pos_BQ, attn_masks)
        return self._layers(hidden, ctx_kv, block_rope, masks)

    @classmethod
    def describes(cls, config: Any) -> bool:
        """Whether a drafter config carries this variant's fields (the backbone: any config)."""
        return True

    @classmethod
    def warm_starts(cls, source: type[DFlashDrafter]) -> bool:
        """Whether a checkpoint of the `source` class starts this variant (drafter.init_from)
        though their parts differ: what both have loads, this one's `added_modules` start fresh,
        the source's own are left out (dflash/run/resume.py asks this alone). The DFlash
        backbone starts every variant: it has no part of its own, so nothing of it is lost.
        Another variant, whose own parts would be lost, only where this one names it in
        `warm_starts_from`. A drafter of this very class is not a warm start: every part must fit."""
        if source is cls:
            return False
        return source is DFlashDrafter or source.variant_name in cls.warm_starts_from

    @classmethod
    def config_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        """The variant's fields where two drafter configs differ, as (run config key, saved
        value, run value): what resuming a checkpoint refuses (dflash/run/resume.py)."""
        return []

    @classmethod
    def backbone_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        """The fields of a checkpoint of this variant that change what its backbone's weights
        compute (DFlash2's logit transforms), where the config of a drafter of another variant it
        warm-starts (`warm_starts`) differs: that drafter loads the backbone, so they must match
        there too (dflash/run/resume.py). None here."""
        return []

    @classmethod
    def drafts_for(cls, block_size: int) -> int:
        """Tokens drafted per block of `block_size`: every position after the anchor."""
        return block_size - 1

    @property
    def drafts_per_block(self) -> int:
        return self.drafts_for(self.block_size)

    @property
    def verify_len(self) -> int:
        """Tokens a decoding round verifies: the anchor and the drafts."""
        return self.drafts_per_block + 1

    @torch.no_grad()
    def draft_block(
        self, lm_head: nn.Module, hidden_1BH: torch.Tensor, anchor_1: torch.Tensor, choose: Callable
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block's drafts [drafts_per_block] from its hidden states [1, B, H] (`draft`), and the
        variant's per-round extra beside them (None here). `choose` picks a position's token from
        its logits (dflash.decoding.reference.DraftChooser); DFlash takes the argmax. Device
        tensors in and out, no host reads: both decoders run it, the static one in a graph."""
        # The drafter may run in fp32 (master weights) in front of a bf16 target head.
        return lm_head(hidden_1BH.to(lm_head.weight.dtype))[0, 1:].argmax(-1), None

    def add_round_figures(self, result: DecodedRounds, extra: list | None, **outcome: Any) -> None:
        """Record a round's variant figures on the decode `result` (`record_round`) from
        `draft_block`'s extra (read to the host) and the round's `draft`, `choices` and
        `accepted`, under the names its `round_tally` reads. None here."""

    def forward(
        self,
        features_BSF: torch.Tensor,
        block_emb_BQH: torch.Tensor,
        block_pos_BQ: torch.Tensor,
        attn_masks: LayerMasks,
        feature_noise_std: float = 0.0,
        noise_generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block positions (after the final norm), [B, Q, H]; the training
        path (compiled after `compile_training`, when gradients are on).

        attn_masks: bool [B, Q, S + Q], True = visible; keys are [context 0..S-1, block tokens
        0..Q-1]; or the same rule as a flex_attention BlockMask; one per entry of `windows`
        (a mapping window -> mask) when some layers slide.
        """
        bsz, ctx_len, _ = features_BSF.shape
        ctx_pos = torch.arange(ctx_len, device=features_BSF.device).unsqueeze(0).expand(bsz, -1)
        ctx_BSH = self.context(features_BSF, feature_noise_std, noise_generator)
        ctx_rope = self.rotary_emb(ctx_BSH, ctx_pos)
        hidden, block_rope, masks = self._block_inputs(block_emb_BQH, block_pos_BQ, attn_masks)
        # The compiled graph is the training one: without gradients (validation) the eager code
        # runs, rather than a second graph compiled for no_grad.
        compiled = self._compiled_forward is not None and torch.is_grad_enabled()
        run = self._compiled_forward if compiled else self._context_and_layers
        return run(ctx_BSH, ctx_rope, hidden, block_rope, masks)
