"""The target over static caches: every decoding path's forward (prefill, one-token decode,
block verification), in shapes a CUDA graph can capture.

Full-attention layers keep a preallocated [slots, kv_heads, max_len, head_dim] key/value pair
(dflash.decoding.kv_cache). Each slot is one sequence; the caller (who knows every sequence's
length on the host) passes the absolute position of every new token. A forward writes the new
keys/values at those positions and each query attends to the keys at positions <= its own, so:
- rolling back a rejected draft is only a smaller length on the host: the rejected entries stay
  in the cache, invisible (beyond every later query until overwritten by the next tokens);
- a slot is reused by a new sequence without clearing it;
- the attended length `kv_len` is a bucket (a multiple of `kv_bucket`) covering the longest
  sequence, so short sequences do not pay for `max_len` and the shapes stay few.

Gated DeltaNet layers of hybrid targets (Qwen3-Next, Qwen3.5 / 3.6) keep a per-slot state
instead (dflash.decoding.deltanet): a step leaves the committed state as it is and keeps its
tokens' inputs, and `commit(taken)` advances each slot by its first `taken` tokens, so a
rejected draft is undone exactly there too. Targets without such layers need no commit (it does nothing).

Only the token mixing is ours: embeddings, norms, projections, rotary tables, MLPs (experts
included) and the LM head are the model's own modules, so weights, rope scaling and
per-architecture details stay transformers'. Supported: decoder-only models whose layers are
full attention (Llama, Mistral without a sliding window, Qwen2, Qwen3, Qwen3-MoE; Qwen3-Next's
and Qwen3.5's gated attention with its partial rotary) or Gated DeltaNet;
`static_decoding_refusal` names why any other target is not, and callers fall back to the
dynamic-cache path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.decoding.deltanet import DeltaNetStates, deltanet_prefill, deltanet_step
from dflash.decoding.kv_cache import StaticKV, write_layer
from dflash.drafters.rope import rotate
from dflash.target.families import TARGET_FAMILIES, is_deltanet_layer
from dflash.target.model import FrozenTarget
from dflash.torch_runtime.compile import compile_shared

# The text model's model_type (an image-text checkpoint's `text_config`): what the static
# decoder runs (the family table's `static_decoding`). All share the decoder-layer layout
# (pre-norm mixer, pre-norm MLP or MoE).
STATIC_MODEL_TYPES = {family.text_model_type for family in TARGET_FAMILIES if family.static_decoding}
_STATIC_LAYER_TYPES = {"full_attention", "linear_attention"}


def static_decoding_refusal(target: FrozenTarget) -> str | None:
    """Why the static-cache decoder cannot run this target (None: it can)."""
    config = target.config
    if config.model_type not in STATIC_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(STATIC_MODEL_TYPES)}"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layer_types <= _STATIC_LAYER_TYPES:
        return f"layer types {sorted(layer_types - _STATIC_LAYER_TYPES)} have no static cache"
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        return "a sliding attention window"
    return None


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class StaticCacheTarget(nn.Module):
    """`prefill` fills fresh slots from position 0; `step` runs new tokens of every slot over the
    caches; `commit` keeps a prefix of the last step in the DeltaNet states. `prefill` and `step`
    return (logits, fused features or None).

    `max_step`: the most tokens one `step` runs per slot (a verification's block), which sizes
    the DeltaNet layers' candidate buffers.

    `compile_backend` (e.g. "inductor"; None: eager): `step`'s per-layer work is one function per
    layer kind (full attention, DeltaNet), compiled once for every layer of that kind (regional
    compilation). The layers share their code, and their weights and caches are the compiled
    function's inputs, so a 36-layer step compiles one layer's graph per step shape (a decode
    step, a verification) instead of one graph of the whole model (at 8B a whole-model compile
    did not finish in 185 s; per layer, compiling and measuring every step took under 270 s).
    Kernels still fuse within a layer, which is where a step's many small kernels are (norms,
    rotary, residuals, the DeltaNet gates and convolution)."""

    def __init__(
        self,
        target: FrozenTarget,
        *,
        slots: int,
        max_len: int,
        kv_bucket: int = 256,
        features: bool,
        max_step: int = 1,
        compile_backend: Any = None,
    ):
        super().__init__()
        refusal = static_decoding_refusal(target)
        if refusal is not None:
            raise ValueError(f"the static-cache decoder cannot run this target: {refusal}")
        self.target = target
        base = target.model.base_model
        self.embed, self.layers, self.norm, self.rotary = (
            base.embed_tokens,
            base.layers,
            base.norm,
            base.rotary_emb,
        )
        config = target.config
        # Each layer's place in its kind's cache list: KV pairs for attention, states for DeltaNet.
        self.deltanet = [is_deltanet_layer(layer) for layer in self.layers]
        self.cache_index, counts = [], [0, 0]
        for recurrent in self.deltanet:
            self.cache_index.append(counts[recurrent])
            counts[recurrent] += 1
        attention = next(layer.self_attn for layer, d in zip(self.layers, self.deltanet) if not d)
        self.head_dim = attention.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.groups = self.num_heads // self.num_kv_heads
        # Qwen3-Next / Qwen3.5 attention: q_proj also yields a per-channel output gate.
        self.gated = attention.q_proj.out_features == 2 * self.num_heads * self.head_dim
        # Qwen3.5's multimodal rotary takes (temporal, height, width) positions, all three the
        # text position for text (some transformers versions expand 2-D positions themselves).
        self.mrope = hasattr(self.rotary, "mrope_section")
        self.kv_bucket = kv_bucket
        self.max_len = round_up(max_len, kv_bucket)
        self.slots = slots
        self.with_features = features
        dtype = self.embed.weight.dtype
        self.kv = StaticKV(
            layers=counts[False],
            slots=slots,
            kv_heads=self.num_kv_heads,
            max_len=self.max_len,
            head_dim=self.head_dim,
            dtype=dtype,
            device=target.device,
        )
        self.states = DeltaNetStates(
            [layer.linear_attn for layer, d in zip(self.layers, self.deltanet) if d],
            slots=slots,
            max_step=max_step,
            dtype=dtype,
            device=target.device,
        )
        self._attention_layer, self._deltanet_layer = self._attention_layer_eager, self._deltanet_layer_eager
        if compile_backend is not None:
            self._attention_layer = compile_shared(
                self._attention_layer_eager, backend=compile_backend, dynamic=True
            )
            self._deltanet_layer = compile_shared(
                self._deltanet_layer_eager, backend=compile_backend, dynamic=True
            )

    @property
    def recurrent(self) -> bool:
        """Whether steps must be committed (the target has DeltaNet layers)."""
        return len(self.states) > 0

    def kv_len_for(self, longest: int) -> int:
        """The attended cache length covering positions < `longest` (a bucket edge)."""
        if longest > self.max_len:
            raise ValueError(f"a sequence of {longest} tokens exceeds the static cache ({self.max_len})")
        return min(self.max_len, round_up(max(longest, 1), self.kv_bucket))

    def _project(self, layer: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Rotated queries [N, H, Q, D] and keys [N, Hkv, Q, D], values [N, Hkv, Q, D], and the
        output gate [N, Q, H * D] of gated attention (else None)."""
        attention = layer.self_attn
        n, q_len, _ = x.shape
        projected = attention.q_proj(x)
        gate = None
        if self.gated:
            q, gate = torch.chunk(projected.view(n, q_len, -1, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(n, q_len, -1)
        else:
            q = projected.view(n, q_len, -1, self.head_dim)
        k = attention.k_proj(x).view(n, q_len, -1, self.head_dim)
        v = attention.v_proj(x).view(n, q_len, -1, self.head_dim).transpose(1, 2)
        if hasattr(attention, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = rotate(q.transpose(1, 2), *rope), rotate(k.transpose(1, 2), *rope)
        return q, k, v, gate

    @staticmethod
    def _mlp(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + (out[0] if isinstance(out, tuple) else out)  # some MoE blocks add router logits

    def _finish_attention(
        self, layer: nn.Module, hidden: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        n, _, q_len, _ = attended.shape
        mixed = attended.transpose(1, 2).reshape(n, q_len, -1)
        if gate is not None:
            mixed = mixed * torch.sigmoid(gate)
        return self._mlp(layer, hidden + layer.self_attn.o_proj(mixed))

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mrope:
            positions = positions.expand(3, *positions.shape)
        return self.rotary(hidden, positions)

    def _fuse(self, collected: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """Decoder-layer outputs concatenated in `target.layer_ids` order, as FrozenTarget does."""
        if not self.with_features:
            return None
        return torch.cat([collected[i] for i in self.target.layer_ids], dim=-1)

    @torch.no_grad()
    def prefill(self, ids_RP: torch.Tensor, rows_R: torch.Tensor, last_R: torch.Tensor):
        """Fresh sequences (right-padded prompts [R, P]) into cache slots `rows_R`, from position
        0. Logits [R, V] at each prompt's last position `last_R`; features [R, P, F] or None.
        Eager (prompt shapes vary); padding writes keys past a prompt's end that the next tokens
        overwrite before any query can see them, and leaves the DeltaNet states untouched."""
        hidden = self.embed(ids_RP)
        positions = torch.arange(ids_RP.shape[1], device=ids_RP.device).expand_as(ids_RP)
        rope = self._rope(hidden, positions)
        collected, layer_ids = {}, set(self.target.layer_ids)
        for index, layer in enumerate(self.layers):
            slot = self.cache_index[index]
            if self.deltanet[index]:
                mixed = deltanet_prefill(
                    layer.linear_attn,
                    layer.input_layernorm(hidden),
                    last_R,
                    rows_R=rows_R,
                    conv=self.states.conv[slot],
                    recurrent=self.states.recurrent[slot],
                )
                hidden = self._mlp(layer, hidden + mixed)
            else:
                q, k, v, gate = self._project(layer, layer.input_layernorm(hidden), rope)
                self.kv.write_prefix(slot, rows_R, k, v)
                attended = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=layer.self_attn.scaling, enable_gqa=self.groups > 1
                )
                hidden = self._finish_attention(layer, hidden, attended, gate)
            if self.with_features and index in layer_ids:
                collected[index] = hidden
        last = hidden[torch.arange(len(rows_R), device=hidden.device), last_R]
        return self.target.lm_head(self.norm(last)), self._fuse(collected)

    @torch.no_grad()
    def step(self, ids_SQ: torch.Tensor, positions_SQ: torch.Tensor, *, kv_len: int):
        """Q new tokens of every slot at absolute `positions_SQ` (each < kv_len) over the caches:
        logits [S, Q, V], features [S, Q, F] or None. Capturable: no host reads, fixed shapes.
        DeltaNet states stay as committed until `commit`.

        Grouped-query attention without copying the cache per head: the G query heads that share
        a key/value head are laid out as G*Q query rows of that head, so one attention call per
        layer reads each cached key once, with the same position mask for every group."""
        if ids_SQ.shape[1] > self.states.max_step and self.recurrent:
            raise ValueError(f"a step of {ids_SQ.shape[1]} tokens exceeds max_step={self.states.max_step}")
        hidden, rope, mask = self.step_inputs(ids_SQ, positions_SQ, kv_len=kv_len)
        collected, layer_ids = {}, set(self.target.layer_ids)
        for index in range(len(self.layers)):
            hidden = self.step_layer(index, hidden, rope=rope, mask=mask, positions_SQ=positions_SQ)
            if self.with_features and index in layer_ids:
                collected[index] = hidden
        return self.target.lm_head(self.norm(hidden)), self._fuse(collected)

    def step_inputs(self, ids_SQ: torch.Tensor, positions_SQ: torch.Tensor, *, kv_len: int):
        """What every layer of a step reads: the embedded tokens, the rotary tables and the
        attention mask [S, 1, G*Q, kv_len]."""
        hidden = self.embed(ids_SQ)
        rope = self._rope(hidden, positions_SQ)
        visible = torch.arange(kv_len, device=ids_SQ.device) <= positions_SQ[:, :, None]  # [S, Q, T]
        return hidden, rope, visible.repeat(1, self.groups, 1).unsqueeze(1)

    def step_layer(self, index: int, hidden: torch.Tensor, *, rope, mask, positions_SQ) -> torch.Tensor:
        """Decoder layer `index` of a step over its cache (benchmarks time the layer kinds apart)."""
        layer, slot = self.layers[index], self.cache_index[index]
        if self.deltanet[index]:
            states = self.states
            return self._deltanet_layer(
                layer,
                hidden,
                conv=states.conv[slot],
                recurrent=states.recurrent[slot],
                window=states.window[slot],
                mixed_buffer=states.mixed[slot],
                gates_buffer=states.gates[slot],
            )
        cos, sin = rope
        return self._attention_layer(
            layer, hidden, cos, sin, mask, positions_SQ, self.kv.keys[slot], self.kv.values[slot]
        )

    @torch.no_grad()
    def commit(self, taken_S: torch.Tensor) -> None:
        """After a `step`: each slot's DeltaNet states advance by its first `taken_S[s]` tokens
        of that step (0: none). Capturable; nothing to do for full-attention targets, whose
        rollback is the caller's smaller length."""
        self.states.commit(taken_S)

    def _attention_layer_eager(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        positions_SQ: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """One full-attention decoder layer of `step`: write the new keys/values into the
        layer's cache, attend over its first mask.shape[-1] positions. Only tensors and the layer
        come in (no layer index, no Python int that differs between layers), so one compiled
        graph serves all."""
        slots, q_len, _ = hidden.shape
        kv_len = mask.shape[-1]
        q, k, v, gate = self._project(layer, layer.input_layernorm(hidden), (cos, sin))
        write_layer(keys, values, positions_SQ, k, v)
        grouped = q.reshape(slots, self.num_kv_heads, self.groups * q_len, self.head_dim)
        attended = F.scaled_dot_product_attention(
            grouped,
            keys[:, :, :kv_len],
            values[:, :, :kv_len],
            attn_mask=mask,
            scale=layer.self_attn.scaling,
        ).reshape(slots, self.num_heads, q_len, self.head_dim)
        return self._finish_attention(layer, hidden, attended, gate)

    def _deltanet_layer_eager(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        **states: torch.Tensor,
    ) -> torch.Tensor:
        """One Gated DeltaNet decoder layer of `step` (dflash.decoding.deltanet.deltanet_step,
        `states` its state and candidate tensors); like the attention layer's, one compiled graph
        serves every layer of the kind."""
        mixed = deltanet_step(layer.linear_attn, layer.input_layernorm(hidden), **states)
        return self._mlp(layer, hidden + mixed)
