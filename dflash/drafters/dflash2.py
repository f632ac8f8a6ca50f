"""The DFlash2 drafter: the DFlash backbone plus block-local convolutions and a candidate selector.

DFlash2 (z-lab/dflash `dflash/model.py`, DFlash2DraftModel; SGLang and vLLM serve it as its own
draft architecture) keeps DFlash's one parallel forward per block and adds:

- a grouped, dynamic, depthwise causal convolution before and after the attention and the MLP
  of every draft layer, over the block's positions. With x the sublayer's (normalised) input,
  the projection P x gives each position and channel group a correction of the base kernel,
      conv(y)[i, c] = sum_t (base[t, c] + (P x)[i, t, g(c)]) * y[i - t, c],   t = 0..k-1,
  taps that would read before the block's first position read zero (never another block). One
  projection of x gives both the input side (applied to x before the sublayer) and the output
  side (applied to the sublayer's output). Identity at init (base[:, 0] = 1, every other tap and
  P zero): a fresh DFlash2 is the DFlash it was built from;
- a selector over the unary logits' top-K candidates per draft position: with h the position's
  final hidden state and p the token chosen (or true, in training) at the position before,
      score(c) = unary(c) + < A[p] * (H h), B[c] >      (A, B: [V, r] codebooks, H: [r, H])
  and the block is walked left to right from the anchor, each position choosing among its K
  candidates given the one before, with no second backbone pass.

Parameter names are the released checkpoints' (`layers.N.attention_conv.base_kernel [2, k, H]`,
`layers.N.attention_conv.kernel_projection.weight [2 k G, H]`, the same for `mlp_conv`,
`candidate_selector.predecessor_codebook [V, r]` and `successor_codebook` stored without a
`.weight` suffix, `candidate_selector.hidden_projection.weight [r, H]`), so `state_dict()` is the
exported checkpoint as is. The config fields live in `dflash_config` (`conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`, and a released drafter's optional
`output_multiplier` / `final_logit_softcapping` on the unary logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from dflash.drafters.backbone import DFlashDrafter, differing_fields
from dflash.drafters.pick_recorder import PickRecorder

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# dflash_config keys of a DFlash2 drafter (the released config.json's names), beside DFlash's.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Optional transforms of the unary logits a released drafter may carry (absent: none).
UNARY_KEYS = ("output_multiplier", "final_logit_softcapping")


def dflash2_settings(config: Any) -> dict[str, Any]:
    """The DFlash2 keys of a drafter config (Qwen3Config or config.json dict); {} for DFlash."""
    raw = config if isinstance(config, dict) else vars(config)
    nested = raw.get("dflash_config") or {}
    return {key: nested[key] for key in (*DFLASH2_KEYS, *UNARY_KEYS) if nested.get(key) is not None}


# A released drafter's transforms of its unary logits: its backbone was trained under them, and
# no run here trains with them (a resumed DFlash2 one, or another variant it starts).
UNARY_FIELDS = {key: f"dflash_config.{key} (dflash trains without it)" for key in UNARY_KEYS}
# The dflash_config fields a checkpoint must share with the run resuming it, by the run config
# key that sets each (variant=dflash2).
RESUME_FIELDS = {**{key: f"variant.{key}" for key in DFLASH2_KEYS}, **UNARY_FIELDS}


def is_dflash2_config(config: Any) -> bool:
    """A drafter config of a DFlash2 drafter: its dflash_config sets the selector."""
    return "selector_top_k" in dflash2_settings(config)


def add_dflash2_fields(
    config: Qwen3Config,
    *,
    conv_kernel_size: int,
    conv_group_size: int,
    selector_rank: int,
    selector_top_k: int,
) -> Qwen3Config:
    """Mark a drafter config as DFlash2 with the released config.json's keys (in place)."""
    config.dflash_config = {
        **config.dflash_config,
        "conv_kernel_size": int(conv_kernel_size),
        "conv_group_size": int(conv_group_size),
        "selector_rank": int(selector_rank),
        "selector_top_k": int(selector_top_k),
    }
    config.architectures = [DFLASH2_ARCHITECTURE]
    check_dflash2_shape(config, prefix="variant.")
    return config


def conv_problems(settings: dict[str, Any], raw: dict[str, Any], *, prefix: str) -> list[str]:
    """The block-local convolutions' rules (every reader's; LiLiCorr's optional convolutions
    are these): the taps inside the block (`block_size` at the top level or in dflash_config;
    taps past the block's start read zeros only, speculators refuses them too) and the group
    dividing the hidden size."""
    kernel, group, hidden = settings["conv_kernel_size"], settings["conv_group_size"], raw["hidden_size"]
    block = raw.get("block_size") or (raw.get("dflash_config") or {}).get("block_size")
    problems = []
    if kernel < 1 or (block is not None and kernel > block):
        problems.append(f"{prefix}conv_kernel_size={kernel}: must be in 1..block_size ({block})")
    if group < 1 or hidden % group:
        problems.append(f"{prefix}conv_group_size={group} must divide the hidden size ({hidden})")
    return problems


def check_dflash2_shape(config: Any, prefix: str = "dflash_config.") -> None:
    """The rules every reader applies to the DFlash2 fields; the message names the key with
    `prefix` (a config.json's `dflash_config.`, a run's `variant.`)."""
    settings = dflash2_settings(config)
    missing = [key for key in DFLASH2_KEYS if key not in settings]
    if missing:
        raise ValueError(f"a DFlash2 drafter config needs {', '.join(prefix + key for key in missing)}")
    raw = config if isinstance(config, dict) else vars(config)
    vocab = raw["vocab_size"]
    problems = conv_problems(settings, raw, prefix=prefix)
    if problems:
        raise ValueError(problems[0])
    if settings["selector_rank"] < 1:
        raise ValueError(f"{prefix}selector_rank={settings['selector_rank']}: must be >= 1")
    if not 1 <= settings["selector_top_k"] <= vocab:
        raise ValueError(
            f"{prefix}selector_top_k={settings['selector_top_k']}: must be in 1..vocab_size ({vocab})"
        )


def shift_in_block(x_BQ_: torch.Tensor, offset: int, block_size: int) -> torch.Tensor:
    """x[i - offset] within each block of `block_size` consecutive positions along dim 1, zero
    where i - offset falls outside the block (a block never reads its neighbour: training lays
    many anchors' blocks side by side in one row). A negative offset reads ahead: x[i + |offset|]."""
    if offset == 0:
        return x_BQ_
    bsz, q_len = x_BQ_.shape[:2]
    blocks = x_BQ_.view(bsz, q_len // block_size, block_size, *x_BQ_.shape[2:])
    shifted = torch.zeros_like(blocks)
    if offset > 0:
        shifted[:, :, offset:] = blocks[:, :, :-offset]
    else:
        shifted[:, :, :offset] = blocks[:, :, -offset:]
    return shifted.view_as(x_BQ_)


def block_convolve(
    y_BQH: torch.Tensor, dynamic_BQKG: torch.Tensor, base_KH: torch.Tensor, *, block_size: int
) -> torch.Tensor:
    """out[i, c] = sum_t (base[t, c] + dynamic[i, t, g(c)]) y[i - t, c] within each block: the
    reference, through autograd (which keeps every tap's shifted input and coefficients)."""
    bsz, q_len, hidden = y_BQH.shape
    groups = dynamic_BQKG.shape[-1]
    grouped = (bsz, q_len, groups, hidden // groups)
    out = torch.zeros(grouped, dtype=y_BQH.dtype, device=y_BQH.device)
    for tap in range(base_KH.shape[0]):
        values = shift_in_block(y_BQH, tap, block_size).view(grouped)
        kernel = base_KH[tap].to(y_BQH.dtype).view(groups, -1)
        out = out + (kernel + dynamic_BQKG[:, :, tap, :, None].to(y_BQH.dtype)) * values
    return out.view(bsz, q_len, hidden)


class _BlockConvolve(torch.autograd.Function):
    """`block_convolve` keeping only its inputs for the backward: autograd would keep, per tap, the
    shifted input and the full [positions, channels] coefficient (four activations of the block's
    size per convolution, 80 for a five-layer drafter); the backward recomputes them tap by tap.
    Tested against `block_convolve` (tests/test_dflash2.py)."""

    @staticmethod
    def forward(ctx, y_BQH, dynamic_BQKG, base_KH, block_size):
        ctx.save_for_backward(y_BQH, dynamic_BQKG, base_KH)
        ctx.block_size = block_size
        with torch.no_grad():
            return block_convolve(y_BQH, dynamic_BQKG, base_KH, block_size=block_size)

    @staticmethod
    def backward(ctx, grad_BQH):
        y, dynamic, base = ctx.saved_tensors
        bsz, q_len, hidden = y.shape
        groups = dynamic.shape[-1]
        grouped = (bsz, q_len, groups, hidden // groups)
        grad = grad_BQH.view(grouped)
        grad_y = torch.zeros(grouped, dtype=grad.dtype, device=grad.device)
        grad_dynamic = torch.empty_like(dynamic)
        accumulate = torch.promote_types(grad.dtype, torch.float32)  # bf16 sums over positions in fp32
        grad_base = torch.empty(base.shape, dtype=accumulate, device=base.device)
        for tap in range(base.shape[0]):
            values = shift_in_block(y, tap, ctx.block_size).view(grouped)
            coefficient = base[tap].to(grad.dtype).view(groups, -1) + dynamic[:, :, tap, :, None].to(
                grad.dtype
            )
            # out[i] += coefficient[i] y[i - tap]: y[j] receives coefficient[j + tap] grad[j + tap].
            grad_y += shift_in_block(coefficient * grad, -tap, ctx.block_size)
            products = grad * values
            grad_dynamic[:, :, tap] = products.sum(dim=-1).to(dynamic.dtype)
            grad_base[tap] = products.to(accumulate).sum(dim=(0, 1)).view(hidden)
        return grad_y.view_as(y).to(y.dtype), grad_dynamic, grad_base.to(base.dtype), None


class GroupedDynamicConv(nn.Module):
    """The causal, depthwise, grouped, dynamic convolution around one sublayer (input and output
    sides). `base_kernel` [2, k, H]: side, tap, channel; `kernel_projection` H -> 2 k G (G =
    H / group_size channel groups): each position's correction of every side's taps per group."""

    def __init__(self, *, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, y_BQH: torch.Tensor, dynamic_BQKG: torch.Tensor, side: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _BlockConvolve.apply(y_BQH, dynamic_BQKG, self.base_kernel[side], self.block_size)
        return block_convolve(y_BQH, dynamic_BQKG, self.base_kernel[side], block_size=self.block_size)

    def prepare(self, x_BQH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input side applied to x, the output side's dynamic taps [B, Q, k, G]), both
        from the one projection of x."""
        dynamic = self.kernel_projection(x_BQH).view(*x_BQH.shape[:2], 2, self.kernel_size, self.groups)
        return self._convolve(x_BQH, dynamic[:, :, 0], side=0), dynamic[:, :, 1]

    def finish(self, y_BQH: torch.Tensor, dynamic_BQKG: torch.Tensor) -> torch.Tensor:
        return self._convolve(y_BQH, dynamic_BQKG, side=1)


class CandidateSelector(nn.Module):
    """score(c | p, h) = unary(c) + < A[p] * (H h), B[c] > over each position's top-K candidates."""

    def __init__(self, *, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Plain parameters, not nn.Embedding: the released checkpoints store them without `.weight`.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float) -> None:
        """A and H ~ N(0, std), B = 0 (SpecForge's and NeMo's init): the bilinear term is exactly
        zero, so a fresh selector picks the unary argmax and a fresh DFlash2 drafts as DFlash does;
        B's gradient (A[p] * H h) is not zero, so the selector starts learning at once."""
        nn.init.normal_(self.predecessor_codebook, mean=0.0, std=std)
        nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=std)
        nn.init.zeros_(self.successor_codebook)

    def pair_scores(
        self, prev_ids: torch.Tensor, hidden: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """The bilinear term < A[p] * (H h), B[c] >: prev_ids [...], hidden [..., H], candidates
        [..., K] -> [..., K] (fp32)."""
        query = F.embedding(prev_ids.long(), self.predecessor_codebook) * self.hidden_projection(
            hidden.to(self.hidden_projection.weight.dtype)
        ).to(self.predecessor_codebook.dtype)
        keys = F.embedding(candidates.long(), self.successor_codebook)
        return torch.einsum("...r,...kr->...k", query.float(), keys.float())

    @torch.no_grad()
    def walk(
        self,
        unary_NPV: torch.Tensor,
        hidden_NPH: torch.Tensor,
        anchor_N: torch.Tensor,
        choose: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left to right over P draft positions: candidates = top-K of the unary logits, each
        position's score given the token chosen before it (the anchor first), and
        `choose(scores [N, K], candidates [N, K], position) -> index [N]`. Returns the tokens
        [N, P] and the unary argmax's token [N, P] (what plain DFlash would have drafted)."""
        unary, candidates = torch.topk(unary_NPV.float(), self.top_k, dim=-1)
        prev = anchor_N
        tokens = []
        for position in range(unary.shape[1]):
            scores = unary[:, position] + self.pair_scores(
                prev, hidden_NPH[:, position], candidates[:, position]
            )
            index = choose(scores, candidates[:, position], position)
            prev = candidates[:, position].gather(-1, index[:, None])[:, 0]
            tokens.append(prev)
        return torch.stack(tokens, dim=1), candidates[:, :, 0]


def apply_unary_transforms(logits: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
    """A released drafter's output_multiplier, then tanh soft-capping, on its unary logits (the
    reference's `compute_logits`); identity when neither is set."""
    multiplier = settings.get("output_multiplier")
    if multiplier is not None and float(multiplier) != 1.0:
        logits = logits * float(multiplier)
    cap = settings.get("final_logit_softcapping")
    if cap is not None and float(cap) > 0:
        logits = torch.tanh(logits / float(cap)) * float(cap)
    return logits


class DFlash2Drafter(PickRecorder, DFlashDrafter):
    """DFlashDrafter + a `GroupedDynamicConv` around each layer's attention and MLP (identity at
    init) + `candidate_selector`. `forward` / `draft` / `context_kv` are the backbone's: they
    return the hidden states the selector reads; the convolutions run inside the layers."""

    added_modules = ("attention_conv", "mlp_conv", "candidate_selector")
    variant_name = "dflash2"
    display_name = "DFlash2"
    card_name = "DFlash2"
    card_words = (
        "DFlash2: a convolution within the block around each draft layer's attention and MLP, "
        "and a selector that picks each proposed token among the LM head's top candidates "
        "given the token proposed before it."
    )
    card_fields = (
        ("convolution taps", "conv_kernel_size"),
        ("convolution channels per group", "conv_group_size"),
        ("selector top-K", "selector_top_k"),
        ("selector rank", "selector_rank"),
    )
    samples_drafts = True
    described_by = "dflash_config.selector_top_k (add_dflash2_fields)"

    def __init__(self, config: Qwen3Config):
        # The backbone first, initialised exactly as a DFlash drafter of the same seed is.
        super().__init__(config)
        check_dflash2_shape(config)
        self.settings = dflash2_settings(config)
        for layer in self.layers:
            for name in ("attention_conv", "mlp_conv"):
                setattr(
                    layer,
                    name,
                    GroupedDynamicConv(
                        hidden_size=config.hidden_size,
                        kernel_size=self.settings["conv_kernel_size"],
                        group_size=self.settings["conv_group_size"],
                        block_size=self.block_size,
                    ),
                )
        self.candidate_selector = CandidateSelector(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            rank=self.settings["selector_rank"],
            top_k=self.settings["selector_top_k"],
        )
        self.candidate_selector.reset_parameters(config.initializer_range)

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target head's logits on the drafter's hidden states, as the selector scores them."""
        return apply_unary_transforms(logits, self.settings)

    @torch.no_grad()
    def draft_block(
        self, lm_head: nn.Module, hidden_1BH: torch.Tensor, anchor_1: torch.Tensor, choose: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """B-1 drafts [B-1] walked by the candidate selector from the anchor over the hidden states
        of block positions 1..B-1 (`choose.among` picks each), and the unary argmax there [B-1]
        (plain DFlash's drafts)."""
        hidden_1PH = hidden_1BH[:, 1:]
        logits_1PV = lm_head(hidden_1PH.to(lm_head.weight.dtype))
        tokens_1P, unary_1P = self.candidate_selector.walk(
            self.unary_logits(logits_1PV), hidden_1PH, anchor_1.view(1), choose.among
        )
        return tokens_1P[0], unary_1P[0]

    @classmethod
    def describes(cls, config: Any) -> bool:
        return is_dflash2_config(config)

    @classmethod
    def config_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        return differing_fields(RESUME_FIELDS, saved.dflash_config, run.dflash_config)

    @classmethod
    def backbone_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        return differing_fields(UNARY_FIELDS, saved.dflash_config, run.dflash_config)
