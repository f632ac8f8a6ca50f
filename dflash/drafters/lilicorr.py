"""The LiLiCorr drafter: the DFlash backbone plus a lattice reranker over its per-slot candidates.

LiLiCorr (arXiv 2608.20530; NVIDIA Model-Optimizer `modeling_lilicorr.py`, served by SGLang and
vLLM as `LiLiCorrDraftModel`) keeps DFlash's one parallel forward per block. The backbone's
marginals make each draft plausible on its own but not jointly; instead of the per-slot argmax,
the drafter keeps the top-K candidates of each of the S = B - 1 draft slots and scores the
S x K lattice:

- each candidate c at slot s enters as
      x[s, c] = T e(c) + P h_s + MLP(f(s, c)) + slot_emb[s] + rank_emb[c]
  with e the target's (frozen) embedding, h_s the drafter's hidden state at block position s + 1,
  and f the five candidate features [log p, p, log p - max log p, rank / (K - 1), rank == 0]
  (log p under the drafter's full-vocabulary softmax; rank / (K - 1) is 0 when K = 1);
- a small pre-norm transformer runs over the S K lattice positions with unmasked attention and a
  learned per-head bias bias[h, s_i - s_j] + same_slot[h] [s_i == s_j];
- the anchor row r = hidden_norm(fc(target features at a - 1)) (the last committed row; zero
  where a = 0) is projected, u = norm(C r) (C r zeroed first where r is invalid);
- with g = silu(F [y, u, y * u]) per candidate (y its normalised lattice state),
      start[c]        = scale * cos(A u, I g[0, c])
      pair[s, c, c']  = scale * cos(O g[s, c], I g[s + 1, c'])
  where cos(x, y) = <x / max(|x|, eps), y / max(|y|, eps)> and scale is the fixed `logit_scale`;
- the greedy walk: c_0 = argmax_c start[c], c_s = argmax_c' pair[s - 1, c_{s-1}, c'], and the
  drafts are the picked candidates. Greedy on purpose (the reference's argument): verification
  accepts the longest correct prefix, so each slot is chosen for the prefix so far, not traded
  for a better tail as a whole-path maximum would.

Drafts are the walk's argmax at every temperature (`samples_drafts` False, as SGLang serves it:
deterministic drafts, verified as point masses). Parameter names are the served checkpoints'
(`lilicorr.*`, the lattice attention in nn.MultiheadAttention's `in_proj_weight` / `in_proj_bias`
/ `out_proj` layout), so `state_dict()` is the export as is; the geometry lives in `dflash_config`
as `lilicorr_*` keys beside `lilicorr_enabled: true`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash.drafters.backbone import DFlashDrafter, differing_fields
from dflash.drafters.dflash2 import DFlash2Drafter, GroupedDynamicConv, conv_problems
from dflash.drafters.pick_recorder import PickRecorder

CONV_MODULES = ("attention_conv", "mlp_conv")

LILICORR_ARCHITECTURE = "LiLiCorrDraftModel"
# The head's geometry, each a `lilicorr_<name>` key of dflash_config (the served readers require
# every one: logit_scale and vector_eps change the scores without changing a shape).
GEOMETRY = (
    "candidate_topk",
    "hidden_size",
    "num_layers",
    "num_heads",
    "mlp_ratio",
    "factor_dim",
    "vector_eps",
    "logit_scale",
)
ENABLED_KEY = "lilicorr_enabled"
# The optional block-local convolutions around every draft sublayer (ModelOpt's LiLiCorr+conv;
# DFlash2's GroupedDynamicConv, under DFlash2's key and tensor names): both keys or neither.
CONV_KEYS = ("conv_kernel_size", "conv_group_size")
NUM_CANDIDATE_FEATURES = 5
_FLOAT_FIELDS = ("mlp_ratio", "vector_eps", "logit_scale")


def lilicorr_settings(config: Any) -> dict[str, Any]:
    """The head's geometry by short name, from a drafter config (Qwen3Config or config.json dict);
    {} when it carries no LiLiCorr head."""
    raw = config if isinstance(config, dict) else vars(config)
    nested = raw.get("dflash_config") or {}
    if not nested.get(ENABLED_KEY):
        return {}
    settings = {name: nested[f"lilicorr_{name}"] for name in GEOMETRY if f"lilicorr_{name}" in nested}
    return settings | {key: nested[key] for key in CONV_KEYS if nested.get(key) is not None}


def is_lilicorr_config(config: Any) -> bool:
    """A drafter config with a LiLiCorr head: its dflash_config sets `lilicorr_enabled`."""
    raw = config if isinstance(config, dict) else vars(config)
    return bool((raw.get("dflash_config") or {}).get(ENABLED_KEY))


def lattice_problems(config: Any, prefix: str = "dflash_config.lilicorr_") -> list[str]:
    """What the served readers refuse in the head's geometry, one line each naming the key with
    `prefix` (a config.json's `dflash_config.lilicorr_`, a run's `variant.`)."""
    settings = lilicorr_settings(config)
    missing = [name for name in GEOMETRY if name not in settings]
    if missing:
        return [f"a LiLiCorr drafter config needs {', '.join(prefix + name for name in missing)}"]
    problems = []
    topk = settings["candidate_topk"]
    # SGLang's and vLLM's loaders refuse other widths (their fused top-k runs in power-of-two lanes).
    if not (isinstance(topk, int) and topk >= 1 and topk & (topk - 1) == 0):
        problems.append(f"{prefix}candidate_topk={topk}: must be a power of two (the served readers' rule)")
    for name in ("num_layers", "num_heads", "factor_dim"):
        if not settings[name] >= 1:
            problems.append(f"{prefix}{name}={settings[name]}: must be >= 1")
    if not settings["hidden_size"] >= 0:
        problems.append(f"{prefix}hidden_size={settings['hidden_size']}: must be >= 0 (0: the drafter's)")
    raw = config if isinstance(config, dict) else vars(config)
    width = settings["hidden_size"] or raw["hidden_size"]
    if settings["num_heads"] >= 1 and width % settings["num_heads"]:
        problems.append(f"{prefix}num_heads={settings['num_heads']} must divide the head's width ({width})")
    if not 0.0 < settings["vector_eps"] < 0.5:
        problems.append(f"{prefix}vector_eps={settings['vector_eps']}: must be in (0, 0.5)")
    for name in ("mlp_ratio", "logit_scale"):
        if not settings[name] > 0:
            problems.append(f"{prefix}{name}={settings[name]}: must be > 0")
    if topk > raw["vocab_size"]:
        problems.append(f"{prefix}candidate_topk={topk}: more than the vocabulary ({raw['vocab_size']})")
    return problems + optional_conv_problems(settings, raw, prefix=prefix.removesuffix("lilicorr_"))


def optional_conv_problems(settings: dict[str, Any], raw: dict[str, Any], *, prefix: str) -> list[str]:
    """The convolutions' keys: both or neither, then DFlash2's rules (`conv_problems`), whose
    convolution this is."""
    present = [key for key in CONV_KEYS if key in settings]
    if not present:
        return []
    if len(present) == 1:
        missing = next(key for key in CONV_KEYS if key not in settings)
        return [f"{prefix}{present[0]} is set without {prefix}{missing}: the convolutions need both"]
    return conv_problems(settings, raw, prefix=prefix)


def add_lilicorr_fields(
    config: Qwen3Config,
    *,
    conv_kernel_size: int | None = None,
    conv_group_size: int | None = None,
    **geometry: Any,
) -> Qwen3Config:
    """Mark a drafter config as LiLiCorr with the served config.json's keys (in place); `geometry`
    holds every name of GEOMETRY (hidden_size / factor_dim None: the drafter's / the head's width);
    the two conv sizes add the convolutions (None: none)."""
    values = dict(geometry)
    values["hidden_size"] = int(values["hidden_size"] or config.hidden_size)
    values["factor_dim"] = int(values["factor_dim"] or values["hidden_size"])
    fields = {
        f"lilicorr_{name}": float(values[name]) if name in _FLOAT_FIELDS else int(values[name])
        for name in GEOMETRY
    }
    convs = {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size}
    fields.update({key: int(value) for key, value in convs.items() if value is not None})
    config.dflash_config = {**config.dflash_config, ENABLED_KEY: True, **fields}
    config.architectures = [LILICORR_ARCHITECTURE]
    problems = lattice_problems(config, prefix="variant.")
    if problems:
        raise ValueError(problems[0])
    return config


def candidate_features(log_probs_NSK: torch.Tensor) -> torch.Tensor:
    """[log p, p, log p - max log p, rank / (K - 1), rank == 0] per candidate, [N, S, K, 5] fp32;
    the candidates come sorted by log p (rank 0 the argmax)."""
    log_probs = log_probs_NSK.float()
    topk = log_probs.shape[-1]
    ranks = torch.arange(topk, device=log_probs.device, dtype=log_probs.dtype)
    rank_frac = (ranks / (topk - 1) if topk > 1 else torch.zeros_like(ranks)).expand_as(log_probs)
    is_top1 = (ranks == 0).to(log_probs.dtype).expand_as(log_probs)
    gap = log_probs - log_probs.max(dim=-1, keepdim=True).values
    return torch.stack([log_probs, log_probs.exp(), gap, rank_frac, is_top1], dim=-1)


def greedy_walk(log_start_NK: torch.Tensor, log_pair_NSKK: torch.Tensor) -> torch.Tensor:
    """The candidate index picked at every slot [N, S]: c_0 = argmax start, then
    c_s = argmax_c' pair[s - 1, c_{s-1}, c'] (each slot given the pick before it)."""
    pick = log_start_NK.argmax(dim=-1)
    picks = [pick]
    for slot in range(log_pair_NSKK.shape[1]):
        row = log_pair_NSKK[:, slot].gather(1, pick.view(-1, 1, 1).expand(-1, 1, log_pair_NSKK.shape[-1]))
        pick = row[:, 0].argmax(dim=-1)
        picks.append(pick)
    return torch.stack(picks, dim=1)


class LatticeAttention(nn.Module):
    """Unmasked multi-head attention over the lattice with an additive per-head bias; weights in
    nn.MultiheadAttention's layout (the served checkpoints'), run through SDPA (capturable)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x_NLD: torch.Tensor, bias_HLL: torch.Tensor) -> torch.Tensor:
        n, length, width = x_NLD.shape
        heads = F.linear(x_NLD, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (t.view(n, length, self.num_heads, -1).transpose(1, 2) for t in heads.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias_HLL.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class LatticeLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + MLP(norm(x)) with MLP = Linear, SiLU, Linear."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        inner = int(width * mlp_ratio)
        self.attn_norm = Qwen3RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = Qwen3RMSNorm(width, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(width, inner), nn.SiLU(), nn.Linear(inner, width))

    def forward(self, x_NLD: torch.Tensor, bias_HLL: torch.Tensor) -> torch.Tensor:
        x_NLD = x_NLD + self.attn(self.attn_norm(x_NLD), bias_HLL)
        return x_NLD + self.mlp(self.mlp_norm(x_NLD))


class LatticeHead(nn.Module):
    """The scorer: lattice inputs in, the chain's log-factors (start [N, K], pair [N, S-1, K, K],
    fp32, already times `logit_scale`) out."""

    def __init__(self, *, model_width: int, block_size: int, eps: float, settings: dict[str, Any]):
        super().__init__()
        width = settings["hidden_size"] or model_width
        self.block_size, self.slots, self.topk = block_size, block_size - 1, settings["candidate_topk"]
        self.num_heads = settings["num_heads"]
        self.vector_eps, self.logit_scale = float(settings["vector_eps"]), float(settings["logit_scale"])
        self.token_proj = nn.Identity() if width == model_width else nn.Linear(model_width, width)
        self.pass_hidden_proj = nn.Linear(model_width, width)
        self.feature_mlp = nn.Sequential(
            nn.LayerNorm(NUM_CANDIDATE_FEATURES),
            nn.Linear(NUM_CANDIDATE_FEATURES, width),
            nn.SiLU(),
            nn.Linear(width, width),
        )
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.topk, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.context_proj = nn.Linear(model_width, width)
        self.layers = nn.ModuleList(
            LatticeLayer(width, self.num_heads, float(settings["mlp_ratio"]), eps)
            for _ in range(settings["num_layers"])
        )
        self.output_norm = Qwen3RMSNorm(width, eps=eps)
        self.anchor_norm = Qwen3RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, settings["factor_dim"])
        self.in_head = nn.Linear(width, settings["factor_dim"])
        self.anchor_out_head = nn.Linear(width, settings["factor_dim"])

    def reset_parameters(self, std: float) -> None:
        """The reference's init: Linears N(0, std) with zero bias, the attention's input projection
        Xavier-uniform (nn.MultiheadAttention's), embeddings and biases of the lattice zero, and
        the three factor heads N(0, 0.02): zero on both sides of a cosine would leave its gradient
        zero (a saddle), small keeps the first scores near uniform."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, LatticeAttention):
                nn.init.xavier_uniform_(module.in_proj_weight)
                nn.init.zeros_(module.in_proj_bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        for parameter in (
            self.slot_embedding,
            self.rank_embedding,
            self.relative_slot_bias,
            self.same_slot_bias,
        ):
            nn.init.zeros_(parameter)
        for head in (self.out_head, self.in_head, self.anchor_out_head):
            nn.init.normal_(head.weight, std=0.02)

    def attention_bias(self, topk: int) -> torch.Tensor:
        """[heads, S K, S K]: relative_slot_bias[h, s_i - s_j + B - 1] + same_slot_bias[h] [s_i == s_j]."""
        slot_of = torch.arange(self.slots, device=self.same_slot_bias.device).repeat_interleave(topk)
        distance = slot_of[:, None] - slot_of[None, :]
        same = (distance == 0).to(self.same_slot_bias.dtype)
        return (
            self.relative_slot_bias[:, distance + self.block_size - 1]
            + same * self.same_slot_bias[:, None, None]
        )

    def forward(
        self,
        *,
        token_emb_NSKH: torch.Tensor,
        log_probs_NSK: torch.Tensor,
        pass_hidden_NSH: torch.Tensor,
        anchor_row_NH: torch.Tensor,
        anchor_valid_N: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, slots, topk = log_probs_NSK.shape
        dtype = self.pass_hidden_proj.weight.dtype
        x = (
            self.token_proj(token_emb_NSKH.to(dtype))
            + self.pass_hidden_proj(pass_hidden_NSH.to(dtype))[:, :, None]
        )
        x = x + self.feature_mlp(candidate_features(log_probs_NSK).to(dtype))
        x = x + self.slot_embedding[0] + self.rank_embedding[0, :, :, :topk]
        x = x.reshape(n, slots * topk, -1)
        bias = self.attention_bias(topk)
        for layer in self.layers:
            x = layer(x, bias)
        y = self.output_norm(x).view(n, slots, topk, -1)
        anchor = self.context_proj(anchor_row_NH.to(dtype)) * anchor_valid_N[:, None].to(dtype)
        u = self.anchor_norm(anchor)
        u_each = u[:, None, None].expand_as(y)
        g = F.silu(self.factor_input_proj(torch.cat([y, u_each, y * u_each], dim=-1)))
        out_vec = F.normalize(self.out_head(g), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(g), dim=-1, eps=self.vector_eps)
        anchor_vec = F.normalize(self.anchor_out_head(u), dim=-1, eps=self.vector_eps)
        start = torch.einsum("nd,nkd->nk", anchor_vec.float(), in_vec[:, 0].float())
        pair = torch.einsum("nsid,nsjd->nsij", out_vec[:, :-1].float(), in_vec[:, 1:].float())
        return self.logit_scale * start, self.logit_scale * pair


def candidate_lattice(logits_NSV: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-K candidate ids [N, S, K] (sorted, rank 0 the argmax) and their log-probabilities
    under the full-vocabulary softmax, fp32, with the logits' gradient (the lattice terms reach
    the backbone through them)."""
    with torch.no_grad():
        ids = torch.topk(logits_NSV, topk, dim=-1).indices
    log_probs = logits_NSV.gather(-1, ids).float() - torch.logsumexp(logits_NSV.float(), dim=-1, keepdim=True)
    return ids, log_probs


class LiLiCorrDrafter(PickRecorder, DFlashDrafter):
    """DFlashDrafter + `lilicorr` (LatticeHead). `forward` / `draft` / `context_kv` are the
    backbone's; the head reads their hidden states, the target head's logits on them and the
    projected context row before the anchor."""

    added_modules = ("lilicorr", *CONV_MODULES)
    variant_name = "lilicorr"
    display_name = "LiLiCorr"
    reads_anchor_row = True
    # A DFlash2 checkpoint starts it too (drafter.init_from): its backbone and convolutions load,
    # its candidate selector, which the lattice head replaces, is left out.
    warm_starts_from = (DFlash2Drafter.variant_name,)

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        problems = lattice_problems(config)
        if problems:
            raise ValueError(problems[0])
        self.settings = lilicorr_settings(config)
        if "conv_kernel_size" in self.settings:
            # Identity at init (DFlash2's rule, and the reference's for LiLiCorr+conv): a fresh
            # drafter drafts as the backbone it was built from.
            for layer in self.layers:
                for name in CONV_MODULES:
                    conv = GroupedDynamicConv(
                        hidden_size=config.hidden_size,
                        kernel_size=self.settings["conv_kernel_size"],
                        group_size=self.settings["conv_group_size"],
                        block_size=self.block_size,
                    )
                    setattr(layer, name, conv)
        self.lilicorr = LatticeHead(
            model_width=config.hidden_size,
            block_size=self.block_size,
            eps=config.rms_norm_eps,
            settings=self.settings,
        )
        self.lilicorr.reset_parameters(config.initializer_range)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lilicorr"):  # the backbone's init runs before the head exists
            self.lilicorr.reset_parameters(self.config.initializer_range)

    def anchor_rows(
        self, features_BSF: torch.Tensor, anchors_BA: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_norm(fc(features at a - 1)) per block [B, A, H] and whether a - 1 exists [B, A]
        (fc and hidden_norm work row by row: the rows are gathered first)."""
        index = (anchors_BA - 1).clamp(min=0)
        rows = features_BSF.gather(1, index[:, :, None].expand(-1, -1, features_BSF.shape[-1]))
        return self.context(rows), anchors_BA >= 1

    def score(
        self,
        *,
        logits_NSV: torch.Tensor,
        hidden_NSH: torch.Tensor,
        embed_tokens: nn.Module,
        anchor_row_NH: torch.Tensor,
        anchor_valid_N: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The lattice of N blocks' S slots: candidate ids [N, S, K], start [N, K], pair [N, S-1, K, K]."""
        ids, log_probs = candidate_lattice(logits_NSV, self.settings["candidate_topk"])
        with torch.no_grad():  # the target's frozen table: an input, never trained through
            token_emb = embed_tokens(ids)
        start, pair = self.lilicorr(
            token_emb_NSKH=token_emb,
            log_probs_NSK=log_probs,
            pass_hidden_NSH=hidden_NSH,
            anchor_row_NH=anchor_row_NH,
            anchor_valid_N=anchor_valid_N,
        )
        return ids, start, pair

    @torch.no_grad()
    def draft_block(
        self,
        lm_head: nn.Module,
        hidden_1BH: torch.Tensor,
        anchor_1: torch.Tensor,
        choose: Callable,
        *,
        embed_tokens: nn.Module,
        anchor_row_1H: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """B-1 drafts [B-1]: the greedy walk's picks over the lattice of block positions 1..B-1
        (at every temperature: `choose` is not asked), and the backbone's argmax there [B-1]."""
        hidden_1SH = hidden_1BH[:, 1:]
        logits_1SV = lm_head(hidden_1SH.to(lm_head.weight.dtype))
        valid = torch.ones(1, dtype=torch.bool, device=hidden_1BH.device)
        ids, start, pair = self.score(
            logits_NSV=logits_1SV,
            hidden_NSH=hidden_1SH,
            embed_tokens=embed_tokens,
            anchor_row_NH=anchor_row_1H,
            anchor_valid_N=valid,
        )
        picks = greedy_walk(start, pair)
        return ids.gather(-1, picks[..., None])[0, :, 0], ids[0, :, 0]

    @classmethod
    def describes(cls, config: Any) -> bool:
        return is_lilicorr_config(config)

    @classmethod
    def config_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        fields = {ENABLED_KEY: "variant (lilicorr)"} | {
            f"lilicorr_{name}": f"variant.{name}" for name in GEOMETRY
        }
        fields |= {key: f"variant.{key}" for key in CONV_KEYS}
        return differing_fields(fields, saved.dflash_config, run.dflash_config)
