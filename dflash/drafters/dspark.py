"""The DSpark drafter: the DFlash backbone plus a Markov head and a confidence head.

DSpark (deepseek-ai/DeepSpec, paper §3) drafts a block semi-autoregressively: the backbone
gives every block position its base logits `U_k` at once (the target's frozen LM head on the
drafter's hidden state `h_k`), then the block is sampled left to right, each position biased by
the token before it: `logits_k = U_k + markov_w2(latent_k)`, where `latent_k` comes from the
previous token `x_{k-1}` (the anchor for k = 0) through `markov_w1` (and, for the `gated` and
`rnn` heads, from `h_k` and a recurrent state). A confidence head reads `[h_k; markov_w1[x_{k-1}]]`
(or `h_k` alone) and returns the logit of the probability that draft k survives verification
given that every draft before it did.

Every block position predicts (the anchor slot too): slot k of anchor a predicts token a + k + 1
(docs/ARCHITECTURE.md §1, DSpark).

Parameter names are the reference checkpoint's (`markov_head.markov_w1.weight [V, r]`,
`markov_head.markov_w2.weight [V, r]`, `markov_head.gate_proj.*`, `markov_head.joint_proj.*`,
`confidence_head.proj.weight [1, H (+ r)]`, `confidence_head.proj.bias [1]`), beside the DFlash
backbone's, so `state_dict()` holds them under the names DeepSpec writes. The config fields
(`markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`) are
the reference config.json's top-level keys.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from dflash.drafters.backbone import DFlashDrafter, differing_fields
from dflash.drafters.dspark_tally import CONFIDENCE, ConfidenceTally
from dflash.drafters.round_tally import DecodedRounds

# The reference's head types; any other `markov_head_type` is the import path of a user's class.
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """`vanilla`: a rank-r transition bias from the previous token, B(x_{k-1}, .) = W1[x_{k-1}] W2.

    The interface every head keeps (the loss and both decoders use only this):
    - `initial_state(prev_ids)`: the state before a block's first position (None: stateless);
    - `step(prev_ids [N], hidden [N, H], state) -> (latent [N, r], state)`: one position;
    - `block_latents(prev_ids [..., K], hidden [..., K, H]) -> [..., K, r]`: a whole block with
      the true previous tokens (teacher forcing, training);
    - `markov_w1` (the Markov embedding the confidence head reads) and `markov_w2` (rank -> vocab,
      no bias): the bias is `markov_w2(latent)`.
    """

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int):
        super().__init__()
        if markov_rank <= 0:
            raise ValueError(f"markov_rank must be positive, got {markov_rank}")
        self.markov_rank = markov_rank
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: the Markov embedding of the previous token."""
        return self.markov_w1(prev_ids.long())

    def initial_state(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(
        self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.embed(prev_ids), state

    def block_latents(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed(prev_ids)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:
        """[..., r] -> the vocabulary bias [..., V]."""
        return self.markov_w2(latent)


class GatedMarkovHead(MarkovHead):
    """`gated`: the Markov embedding scaled by a gate read from the hidden state,
    latent_k = sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}]."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size)
        self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)

    def _gated(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedding = self.embed(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding.to(hidden.dtype)], dim=-1)))
        return gate.to(embedding.dtype) * embedding

    def step(self, prev_ids, hidden, state):
        return self._gated(prev_ids, hidden), state

    def block_latents(self, prev_ids, hidden):
        return self._gated(prev_ids, hidden)


class RNNMarkovHead(MarkovHead):
    """`rnn`: a gated recurrent state over the block (paper eq. 6). With z = [s_{k-1}; W1[x_{k-1}]; h_k]
    and (g, c, o) = joint_proj(z) split in three: s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c),
    latent_k = tanh(o); s_0 = 0."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size)
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def initial_state(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(
            *prev_ids.shape, self.markov_rank, device=prev_ids.device, dtype=self.joint_proj.weight.dtype
        )

    def step(self, prev_ids, hidden, state):
        embedding = self.embed(prev_ids)
        z = torch.cat([state, embedding.to(hidden.dtype), hidden], dim=-1)
        gate, candidate, output = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(output), state

    def block_latents(self, prev_ids, hidden):
        state = self.initial_state(prev_ids[..., 0]).to(hidden.dtype)
        latents = []
        for k in range(prev_ids.shape[-1]):
            latent, state = self.step(prev_ids[..., k], hidden[..., k, :], state)
            latents.append(latent)
        return torch.stack(latents, dim=-2)


_BUILT_IN_HEADS: dict[str, type[MarkovHead]] = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNMarkovHead,
}


def markov_head_class(head_type: str) -> type[nn.Module]:
    """`vanilla`, `gated`, `rnn`, or the import path (`my_module.MyHead`) of a class built with
    (vocab_size=, markov_rank=, hidden_size=) that keeps `MarkovHead`'s interface."""
    if head_type in _BUILT_IN_HEADS:
        return _BUILT_IN_HEADS[head_type]
    module_name, _, class_name = head_type.rpartition(".")
    if not module_name:
        raise ValueError(
            f"markov_head_type={head_type!r}: expected one of {', '.join(MARKOV_HEAD_TYPES)} "
            "or the import path of a head class (my_module.MyHead)"
        )
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"markov_head_type={head_type!r}: cannot import it ({exc})") from exc
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"markov_head_type={head_type!r} is not an nn.Module class")
    return found


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj(features_k)); returns the logit (sigmoid is the caller's), [...]."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# The heads' config fields a checkpoint must share with the run resuming it, by the run config
# key that sets each (variant=dspark).
RESUME_FIELDS = {
    "markov_rank": "variant.markov_rank",
    "markov_head_type": "variant.markov_head_type",
    "enable_confidence_head": "variant.confidence_head",
    "confidence_head_with_markov": "variant.confidence_with_markov",
}


def is_dspark_config(config: Any) -> bool:
    """A drafter config (Qwen3Config or config.json dict) of a DSpark drafter."""
    keys = config if isinstance(config, dict) else vars(config)
    return "markov_rank" in keys


def add_dspark_fields(
    config: Qwen3Config,
    *,
    markov_rank: int,
    markov_head_type: str,
    confidence_head: bool,
    confidence_with_markov: bool,
) -> Qwen3Config:
    """Mark a drafter config as DSpark with the reference's config.json keys (in place)."""
    if confidence_head and confidence_with_markov and markov_rank <= 0:
        raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    config.markov_rank = int(markov_rank)
    config.markov_head_type = str(markov_head_type)
    config.enable_confidence_head = bool(confidence_head)
    config.confidence_head_with_markov = bool(confidence_head and confidence_with_markov)
    return config


class DSparkDrafter(DFlashDrafter):
    """DFlashDrafter + `markov_head` (None when markov_rank is 0) + `confidence_head` (None when
    disabled). `forward` / `draft` / `context_kv` are the backbone's, unchanged: they return the
    hidden states h_k [B, Q, H] the heads read."""

    added_modules = ("markov_head", "confidence_head")
    variant_name = "dspark"
    native_layout = "deepspec"
    display_name = "DSpark"
    records_num_anchors = True
    samples_drafts = True
    round_extra = "confidence"
    round_tally = ConfidenceTally
    described_by = "markov_rank (dflash.drafters.dspark.add_dspark_fields)"

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.markov_rank: int = int(config.markov_rank)
        self.markov_head: nn.Module | None = None
        if self.markov_rank > 0:
            head_class = markov_head_class(config.markov_head_type)
            self.markov_head = head_class(
                vocab_size=config.vocab_size, markov_rank=self.markov_rank, hidden_size=config.hidden_size
            )
        self.confidence_with_markov = bool(getattr(config, "confidence_head_with_markov", False))
        self.confidence_head: ConfidenceHead | None = None
        if getattr(config, "enable_confidence_head", False):
            if self.confidence_with_markov and self.markov_head is None:
                raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
            extra = self.markov_rank if self.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(config.hidden_size + extra)
        self._reset_heads()

    def _reset_heads(self) -> None:
        """The reference's init (transformers' `_init_weights`): weights N(0, initializer_range),
        biases 0. The backbone keeps the DFlash init, so a seed builds the same backbone."""
        std = self.config.initializer_range
        for head in (self.markov_head, self.confidence_head):
            if head is None:
                continue
            for module in head.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def block_latents(self, prev_ids_BQ: torch.Tensor, hidden_BQH: torch.Tensor) -> torch.Tensor | None:
        """Teacher-forced Markov latents of every block position, [B, Q, r] (None without a head):
        `prev_ids_BQ` holds each position's true previous token (the anchor for position 0)."""
        if self.markov_head is None:
            return None
        bsz, q_len = prev_ids_BQ.shape
        blocks = (bsz, q_len // self.block_size, self.block_size)
        latents = self.markov_head.block_latents(
            prev_ids_BQ.view(blocks), hidden_BQH.view(*blocks, hidden_BQH.shape[-1])
        )
        return latents.reshape(bsz, q_len, -1)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logits [...] (fp32) for hidden [..., H] and previous tokens [...];
        None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.confidence_with_markov:
            features = torch.cat([hidden, self.markov_head.embed(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features.to(self.confidence_head.proj.weight.dtype)).float()

    @torch.no_grad()
    def sample_block(
        self,
        base_logits_NKV: torch.Tensor,
        hidden_NKH: torch.Tensor,
        first_prev_N: torch.Tensor,
        choose: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-to-right drafting of K positions: logits_k = U_k + bias(x_{k-1}), x_k = choose(logits_k)
        (argmax, or a sampler at the round's temperature), x_{-1} = the anchor. Returns the tokens
        [N, K] and the biased logits [N, K, V] (the draft distribution verification needs).
        Without a Markov head the base logits are the draft logits."""
        if self.markov_head is None:
            tokens = torch.stack([choose(base_logits_NKV[:, k]) for k in range(base_logits_NKV.shape[1])], 1)
            return tokens, base_logits_NKV
        prev = first_prev_N
        state = self.markov_head.initial_state(prev)
        tokens, logits = [], []
        for k in range(base_logits_NKV.shape[1]):
            latent, state = self.markov_head.step(prev, hidden_NKH[:, k], state)
            step_logits = base_logits_NKV[:, k] + self.markov_head.bias(latent).to(base_logits_NKV.dtype)
            prev = choose(step_logits)
            tokens.append(prev)
            logits.append(step_logits)
        return torch.stack(tokens, 1), torch.stack(logits, 1)

    @classmethod
    def drafts_for(cls, block_size: int) -> int:
        """Every block slot drafts, the anchor's too (slot k proposes the token at anchor + k + 1)."""
        return block_size

    @torch.no_grad()
    def draft_block(
        self, lm_head: nn.Module, hidden_1BH: torch.Tensor, anchor_1: torch.Tensor, choose: Callable
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """B drafts [B] left to right with the Markov bias, and each draft's survival probability
        [B] from the confidence head (None without one)."""
        # The drafter may run in fp32 (master weights) in front of a bf16 target head.
        base_1BV = lm_head(hidden_1BH.to(lm_head.weight.dtype))
        tokens_1B, _ = self.sample_block(base_1BV, hidden_1BH, anchor_1.view(1), choose)
        if self.confidence_head is None:
            return tokens_1B[0], None
        previous = torch.cat([anchor_1.view(1), tokens_1B[0, :-1]])  # the token before each draft
        return tokens_1B[0], torch.sigmoid(self.confidence_logits(hidden_1BH[0], previous))

    def add_round_figures(self, result: DecodedRounds, extra: list | None, **outcome: Any) -> None:
        """The round's survival probabilities, beside the acceptance measured (ConfidenceTally)."""
        if extra is not None:
            result.record_round({CONFIDENCE: extra})

    @classmethod
    def describes(cls, config: Any) -> bool:
        return is_dspark_config(config)

    @classmethod
    def config_differences(cls, saved: Any, run: Any) -> list[tuple[str, Any, Any]]:
        return differing_fields(RESUME_FIELDS, vars(saved), vars(run))
