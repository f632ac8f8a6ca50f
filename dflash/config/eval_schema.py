"""The evaluation's config group (`eval`): dflash-eval and the periodic evaluation while training.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from dflash.config.bounds import at_least


class VerifyRule(str, Enum):
    """How sampled decoding keeps drafts (dflash/decoding/verify.py has the rules' formulas)."""

    match = "match"  # a draft is kept while it equals the target's own sample
    rejection = "rejection"  # speculative sampling, as serving engines verify at a temperature > 0


@dataclass
class EvalConfig:
    # Benchmark name -> local JSONL prompt file (one {"prompt": str} or {"messages": [...]} per
    # line, rendered with the target's chat template). Empty: random held-out token prompts.
    benchmarks: dict[str, str] = field(default_factory=dict)
    # Prompts per benchmark (the first N lines), or the size of the random held-out set.
    num_prompts: int = 8
    # Length of the random held-out prompts.
    prompt_len: int = 16
    max_new_tokens: int = 64
    # 0: greedy, with the check that the output equals plain greedy decoding.
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    seed: int = 12345
    # dflash-eval: refuse a checkpoint whose target.json says it was trained on another target
    # (other weights, config or tokenizer of the same shape); false evaluates it anyway.
    check_target: bool = True
    # Evaluate a snapshot of the drafter every N optimizer steps while training (0: never; the
    # end-of-training evaluation always runs), on `periodic_num_prompts` prompts per benchmark.
    every_steps: int = 0
    periodic_num_prompts: int = 4
    # dflash-eval: time plain vs DFlash decoding (speedup), after `warmup_prompts` untimed runs.
    timing: bool = True
    # Decode steps and DFlash rounds replayed as CUDA graphs on static caches (null: on CUDA),
    # hybrid Gated DeltaNet targets included; a sliding-window target takes the exact
    # dynamic-cache path.
    cuda_graphs: Optional[bool] = None
    # Fuse the captured steps' kernels with torch.compile first (a one-time compile per run, one
    # layer's graph per layer kind and step shape: docs/ARCHITECTURE.md §2b; with every_steps,
    # training's compiled code waits for it at the first periodic evaluation, as every thread
    # does while another compiles). Hybrid targets want it: a DeltaNet layer's gates, convolution
    # and norms are many small kernels (Qwen3.5-9B shape, b16, on an H200: a round 14.5 ms
    # without, 10.1 ms compiled = 1.35 compiled plain steps: benchmarks/RESULTS.md;
    # experiment=qwen3_5_b16 turns it on).
    compile_decoding: bool = False
    # A DSpark drafter at a temperature > 0: sample each draft from its Markov-biased logits at
    # that temperature; a DFlash2 drafter: sample each draft among its selector's K candidates
    # from the softmax of their scores (false: take the argmax, as a DFlash drafter always
    # does). Verification is unchanged either way (a draft is kept when it equals the target's
    # own choice), so the output stays exact. That rule accepts a sampled draft with probability
    # sum_d p(d) q(d) (draft distribution p, target's q), below the 1 - TV(p, q) of the
    # rejection sampling serving engines verify with; an argmax draft gets q(d) under both rules,
    # so the default's figures are what an engine measures.
    sampled_drafts: bool = False
    # At a temperature > 0, how a round's drafts are kept: `match`, while each equals the target's
    # own sample (survives with sum_d p(d) q(d)); `rejection`, speculative sampling as SGLang,
    # vLLM and TensorRT-LLM verify and the DSpark paper measures (min(1, q/p), the residual
    # max(0, q - p) at the first rejection; survives with 1 - TV(p, q)). Both keep the target's
    # distribution exactly, and greedy decoding is the same under both. `rejection` decodes on
    # the reference decoder (the static one keeps `match`), so its timing is that decoder's.
    verify: VerifyRule = VerifyRule.match
    warmup_prompts: int = 2
    # dflash-eval: where the JSON report goes; null: <paths.output_dir>/eval.json. Each prompt's
    # outcome goes beside it as it finishes (eval.json -> eval.prompts.jsonl).
    output: Optional[str] = None
    # dflash-eval: continue the evaluation whose journal is at that place (an earlier run stopped
    # by a time limit or a crash, or one of fewer prompts): only the prompts it lacks are decoded.
    # Refused under other settings (drafter weights, target, dtype, device kind, decoding), with
    # timing (its figures are one process's), and false refuses a place that holds a journal.
    resume: bool = False
    # dflash-eval, untimed (eval.timing=false): the plain greedy references of the lossless check
    # decoded this many prompts at a time on the static-cache target (continuous batching, its own
    # KV cache of that many rows); 1: each prompt's reference right after its DFlash decoding, as
    # timing does. The figures are the same either way (tested).
    reference_slots: int = 16
    # dflash-eval, untimed (eval.timing=false), static-cache targets: the DFlash decodings of this
    # many prompts at once, each on a static decoder of its own (its own caches, CUDA graphs and
    # CUDA stream) in a thread of one process, so a small target's launch-bound rounds overlap on
    # the GPU (dflash.decoding.side_by_side). Each prompt's outcome is that of decoding it alone
    # (tested); each more decoder holds its own KV cache and drafter copy. 1: one at a time.
    # Checked where it runs: the first batch of each benchmark and temperature is decoded alone
    # too, and an outcome that differs stops the evaluation naming this key.
    decode_streams: int = 1

    def __post_init__(self) -> None:
        at_least("eval.reference_slots", self.reference_slots, 1)
        at_least("eval.decode_streams", self.decode_streams, 1)
