"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/config.yaml` lists `dflash_schema` first in its defaults, so every YAML file and every
command-line override is merged into these dataclasses: an unknown key, a wrong type or an
unknown enum value fails at compose time with the dotted key in the message.

This module imports only the standard library, omegaconf and hydra (no torch), so that
`dflash-train --help`, `--cfg job` and tab completion stay fast.

It is longer than the package's 300-line guide on purpose: it is the config contract, field
declarations with their one-line meanings, read top to bottom beside conf/; split by group it
would scatter what a reviewer of a config diff looks up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING


class CompileScope(str, Enum):
    stack = "stack"  # the target's whole feature stack as one graph
    layers = "layers"  # each decoder layer apart: one graph per layer kind (regional)


class ExpertsKind(str, Enum):
    """transformers' implementations of a MoE target's routed experts (transformers >= 5)."""

    eager = "eager"  # a Python loop over the experts a batch routes to (host sync per layer)
    grouped_mm = "grouped_mm"  # tokens sorted by expert, one grouped GEMM per projection
    batched_mm = "batched_mm"  # each token's top-k expert weights gathered, batched GEMMs
    # dflash's forward-only Triton kernels (dflash/models/fused_experts.py): gather + gate/up GEMM
    # + SwiGLU in one kernel, down GEMM + routing weight in another, no host sync; FP8 experts
    # read as stored. CUDA only.
    fused = "fused"
    # The same, and on FP8 experts the activations quantized too (e4m3, one scale per token and
    # 128 columns, as SGLang's and vLLM's block-wise FP8 MoE kernels do): FP8 x FP8 GEMMs on FP8
    # tensor cores, the served engines' numerics rather than the dequantized weights'. bf16
    # experts: as fused. CUDA only.
    fused_w8a8 = "fused_w8a8"
    # `fused` on CUDA where triton is installed and the experts are the kind the kernels compute
    # (else transformers' default, logged); transformers' default elsewhere. The MoE presets' choice.
    auto = "auto"


class VerifyRule(str, Enum):
    """How sampled decoding keeps drafts (dflash/decoding/verify.py has the rules' formulas)."""

    match = "match"  # a draft is kept while it equals the target's own sample
    rejection = "rejection"  # speculative sampling, as serving engines verify at a temperature > 0


class DeviceKind(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class AttentionKind(str, Enum):
    auto = "auto"  # flex on CUDA, sdpa on CPU
    flex = "flex"  # block-sparse flex_attention (CUDA: CPU flex_attention has no backward)
    sdpa = "sdpa"  # SDPA with the dense [B, Q, S + Q] mask: the reference


class LayerType(str, Enum):
    """A draft layer's attention, under the names the serving engines read from `layer_types`."""

    full_attention = "full_attention"  # every context key before the anchor
    sliding_attention = "sliding_attention"  # the context keys within drafter.sliding_window


class SyntheticText(str, Enum):
    greedy = "greedy"  # the target continues each prompt greedily: text a drafter can learn
    random = "random"  # uniformly random tokens, no target call: throughput runs at scale


class DataKind(str, Enum):
    synthetic = "synthetic"
    conversations = "conversations"


class RegenBackend(str, Enum):
    transformers = "transformers"
    http = "http"


@dataclass
class KernelTilingConfig:
    """One fused experts kernel's launch shape (dflash.models.experts_tiling.KernelTiling); null:
    the default's."""

    block_n: Optional[int] = None  # output columns per program
    block_k: Optional[int] = None  # K per step
    warps: Optional[int] = None
    stages: Optional[int] = None  # software-pipeline stages


@dataclass
class ExpertsTilingConfig:
    """The fused experts kernels' launch shapes (dflash.models.experts_tiling.ExpertsTiling); each
    null field keeps the default's (dflash.models.experts_tiling.default_tiling: by the weights'
    dtype, the fastest that fits the GPU's shared memory)."""

    block_m: Optional[int] = None  # the row tile: each expert's run of rows is padded to it
    gate_up: KernelTilingConfig = field(default_factory=KernelTilingConfig)
    down: KernelTilingConfig = field(default_factory=KernelTilingConfig)


@dataclass
class TargetConfig:
    name: str = MISSING
    # Local checkpoint directory (AutoModelForCausalLM.from_pretrained). Required for real targets.
    path: Optional[str] = None
    # transformers config fields for a random-init target (used when `path` is null).
    arch: Optional[dict[str, Any]] = None
    # Tokenizer + chat template directory (conversation data, benchmark prompts); null: `path`.
    tokenizer: Optional[str] = None
    # Extra variables for the chat template wherever the target is prompted (prep, regen, eval),
    # e.g. {enable_thinking: false} for Qwen3's non-thinking mode.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The model_type the target must have; a path to another architecture is refused early.
    # null (target=hf): whatever the checkpoint at target.path is.
    model_type: Optional[str] = "qwen3"
    init_seed: int = 0
    # "auto": bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # torch.compile the decoder stack that computes training features (dynamic shapes; decoding
    # stays eager). Off by default, on in the paper-scale experiments: on an H200 it takes a
    # Qwen3-8B-shaped target from 100 to 75 ms per 3072-token sample, after about a minute of
    # compilation per graph. null: on where the target runs on CUDA, off on the CPU (the hybrid
    # and MoE presets: their regional compile takes under a minute).
    compile: Optional[bool] = False
    # torch.compile's `dynamic` for that stack: true, one graph with symbolic shapes serves every
    # batch shape from the first step; null, torch's default: graphs for the exact shapes seen,
    # recompiled once with symbolic shapes when a shape first changes (faster kernels where the
    # shapes never change, as at the paper's fixed 3072-token samples; one more compile where
    # they do).
    compile_dynamic: Optional[bool] = True
    # What target.compile compiles: `stack`, the feature stack whole (dense targets: every layer
    # in one graph); `layers`, each decoder layer apart, sharing one graph per layer kind (hybrid
    # and MoE stacks, whose whole-stack compile of many unrolled layers takes minutes).
    compile_scope: CompileScope = CompileScope.stack
    # CUDA graphs of the feature forward, one per batch shape, for up to this many shapes (0:
    # none; CUDA only). For targets whose compiled forward is bound by the host's kernel
    # launches (MoE hybrid targets: flash-linear-attention's and the experts' Python launches):
    # the whole forward replays as one launch. Suits data of a few fixed shapes (the paper's
    # 3072-token samples); each graph keeps an input and an output of its shape, and shapes
    # beyond the count run without one (dflash/models/feature_graphs.py).
    cuda_graphs: int = 0
    # A MoE target's routed-experts implementation; null: transformers' default (grouped_mm
    # where it can dispatch, else eager). Ignored by dense targets.
    experts: Optional[ExpertsKind] = None
    # The fused experts kernels' tiles (target.experts=fused, fused_w8a8, or auto where it picks
    # them); fields left null keep the defaults. Which tiles are fastest depends on the GPU and
    # the experts' shape: scripts/bench_experts.py measures them and prints the best as this
    # override. Tiles the kernels cannot run are refused by name.
    experts_tiling: ExpertsTilingConfig = field(default_factory=ExpertsTilingConfig)
    # Hybrid targets on CUDA: the Gated DeltaNet layers' short convolution on
    # flash-linear-attention's Triton kernel when it is installed (transformers otherwise runs
    # its PyTorch reference unless the causal-conv1d package is there: 1.95 vs 0.20 ms per
    # layer at Qwen3-Next-80B's shape on an H200). false: transformers' own choice.
    fla_short_conv: bool = True
    # Random-weight targets only: quantize the random weights block-wise to FP8 (e4m3, one scale
    # per 128 x 128 block, the layout of the published FP8 checkpoints) as each layer is built,
    # and keep them in FP8 (dflash/models/fp8.py): speed and memory runs at the FP8 size. An
    # FP8 checkpoint at target.path is recognised by its quantization_config, no key needed.
    fp8: bool = False


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


@dataclass
class ConversationLayoutConfig:
    """Where conversation records keep their turns (data.layout, regen's layout). null: auto —
    `messages` with role/content turns (OpenAI), else `conversations` with from/value (ShareGPT)."""

    # The record field (a file's key, a Parquet or datasets column) holding the list of turns.
    field: Optional[str] = None
    # Each turn's role key (its values: system, user/human, assistant/gpt/model) and text key;
    # null: role/content when a turn has `role`, else from/value.
    role: Optional[str] = None
    content: Optional[str] = None


@dataclass
class DataConfig:
    name: str = MISSING
    kind: DataKind = DataKind.synthetic
    # Samples longer than this are truncated (both kinds).
    max_length: int = 3072
    # conversations: local .jsonl / .json / .parquet files, or directories `datasets`' save_to_disk
    # wrote, of OpenAI `messages` (role/content) or ShareGPT `conversations` (from/value) records
    # (other names: `layout`), rendered with the target's chat template.
    files: list[str] = field(default_factory=list)
    layout: ConversationLayoutConfig = field(default_factory=ConversationLayoutConfig)
    # conversations: samples with fewer supervised (assistant) tokens are dropped and counted.
    min_supervised_tokens: int = 16
    # conversations: tokenizer processes (datasets.map num_proc); null: in this process.
    num_proc: Optional[int] = None
    # Samples held out of training (chosen by `seed`): val/loss, val/acc, val/tau_sim,
    # val/tau_block and val/tau_decode (the one to set beside decoding's tau) measure the drafter
    # on them at every periodic evaluation and at the end.
    # 0: no validation split.
    val_samples: int = 0
    # synthetic: random prompts continued greedily by the target.
    num_samples: int = 1024
    prompt_len_min: int = 8
    prompt_len_max: int = 48
    gen_len_min: int = 16
    gen_len_max: int = 80
    seed: int = 0
    # Samples generated per target forward while building the synthetic set.
    generation_batch_size: int = 64
    # synthetic: how the supervised part is written (random: for speed runs of large targets,
    # whose greedy text takes hours to write; nothing there can be learned).
    continuation: SyntheticText = SyntheticText.greedy
    # How the samples are packed into batches, set by each data option beside its max_length
    # (the batch order is the `scheduler` group's). Upper bounds (exclusive, the last inclusive)
    # of the length buckets:
    bucket_edges: list[int] = MISSING
    # Padded tokens (batch_size * longest sample) a batch may hold.
    tokens_per_batch: int = MISSING
    # Block tokens (batch_size * anchors of its widest sample * block_size) a batch may hold:
    # what the drafter computes and keeps for backward. null: no limit beyond tokens_per_batch.
    block_tokens_per_batch: Optional[int] = None


# The data keys that say how samples are packed, not which samples exist (a data cache ignores them).
PACKING_KEYS = ("bucket_edges", "tokens_per_batch", "block_tokens_per_batch")


# ---- Components ------------------------------------------------------------------------------
# One structured config per option, naming the class or function it builds (`_target_`): the
# launcher builds each with hydra.utils.instantiate (dflash/run/launch.py); a `_partial_` one gets
# its runtime objects (the samples' lengths, the drafter's parameters, the trainer...) when it is
# built. A user's own class is named the same way, by YAML or an override, and receives the
# option's fields (docs/extending.md); no switch over the built-ins exists anywhere. Each option
# file (conf/<group>/<option>.yaml) starts from its schema (`defaults:
# [/schema/<group>/<option>@_here_]`), so a key of another option is refused at compose time
# (noise=none has no `std`).


@dataclass
class SchedulerConfig:
    """The batch order: `_target_` is a BatchPlanner class (dflash/data/schedule.py), whose
    `order` sorts an epoch's batches; the batches' sizes are the data's (data.bucket_edges,
    data.tokens_per_batch, data.block_tokens_per_batch)."""

    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class InterleaveSchedulerConfig(SchedulerConfig):
    _target_: str = "dflash.data.schedule.InterleavePlanner"


@dataclass
class ShuffleSchedulerConfig(SchedulerConfig):
    _target_: str = "dflash.data.schedule.ShufflePlanner"


@dataclass
class GpuConfig:
    device: DeviceKind = DeviceKind.cpu
    # Number of target devices; the drafter gets `drafter` devices (null: all the rest).
    target: int = 1
    drafter: Optional[int] = 1
    # Both roles on the same device (gpu=single).
    shared: bool = False
    # Intra-op threads of torch on CPU (roles on gpu=cpu, evaluation there). 1: the tiny models
    # gain nothing from more, and a busy machine loses a lot (a 40-token prefill took 6.1 s
    # with torch's default threads and 0.35 s with one, on a shared 2-core box).
    cpu_threads: int = 1

    def __post_init__(self) -> None:
        if self.cpu_threads < 1:
            raise ValueError(f"gpu.cpu_threads must be >= 1, got {self.cpu_threads}")


@dataclass
class OptimizerConfig:
    """`_target_`: a torch optimizer class, built over the drafter's parameters. The step divides
    the gradients by the loss weight and clips them through the fused kernel's `grad_scale`
    input (no pass over the gradients), so the optimizer must be a fused one."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 6e-4
    fused: bool = True
    # The step's gradient-norm clip, applied inside the fused update (not an optimizer argument).
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.fused:
            raise ValueError(
                "optimizer.fused=false: the step divides and clips the gradients through a fused "
                "optimizer's grad_scale input, which an unfused one ignores"
            )
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"optimizer.grad_clip must be > 0, got {self.grad_clip}")


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        # torch refuses these too, but only once the drafter is built, and without the key.
        for key in ("weight_decay", "eps"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"optimizer.{key} must be >= 0, got {getattr(self, key)}")
        super().__post_init__()


@dataclass
class LrScheduleConfig:
    """`_target_`: a function (optimizer, *, total_steps, warmup_ratio) -> an LR scheduler."""

    _target_: str = MISSING
    _partial_: bool = True
    warmup_ratio: float = 0.04

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"lr_schedule.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass
class CosineLrScheduleConfig(LrScheduleConfig):
    _target_: str = "dflash.step.lr_schedule.cosine_with_warmup"


@dataclass
class ConstantLrScheduleConfig(LrScheduleConfig):
    _target_: str = "dflash.step.lr_schedule.constant_with_warmup"
    warmup_ratio: float = 0.0


@dataclass
class LossConfig:
    """`_target_`: the block loss (dflash/step/loss.py): its position weights and chunking."""

    _target_: str = "dflash.step.loss.BlockLoss"
    # Position weight w_k = exp(-(k-1)/gamma); paper: 7 for B=16, 5 for B=10, 4 for B=8.
    gamma: float = 7.0
    # Block positions per sample sent through the LM head at once, recomputed in backward;
    # bounds the logits memory to chunk x vocab floats per sample. 0: all positions at once.
    logits_chunk: int = 2048

    def __post_init__(self) -> None:
        if not self.gamma > 0:
            raise ValueError(f"loss.gamma must be > 0, got {self.gamma}")
        if self.logits_chunk < 0:
            raise ValueError(f"loss.logits_chunk must be >= 0 (0: no chunking), got {self.logits_chunk}")


class FusedTerms(str, Enum):
    """How DSpark's fused LM-head loss computes its vocabulary-wide terms per chunk of rows
    (dflash/step/dspark_loss.py)."""

    auto = "auto"  # triton on CUDA where triton is installed, else inductor
    inductor = "inductor"  # the PyTorch formula (compiled with the drafter; eager when it is not)
    triton = "triton"  # one Triton kernel, three passes over the vocabulary per row (CUDA)


class MarkovHeadType(str, Enum):
    """DSpark's sequential head (deepseek-ai/DeepSpec `markov_head_type`; dflash/models/dspark.py)."""

    vanilla = "vanilla"  # bias W2(W1[x_{k-1}]): rank-r transition from the previous token
    gated = "gated"  # W1[x_{k-1}] scaled by a gate read from [h_k; W1[x_{k-1}]]
    rnn = "rnn"  # a gated recurrent state over the block


@dataclass
class VariantConfig:
    """`_target_`: the drafter variant (dflash/step/variant.py): which drafter is built, which
    block position predicts which token, the loss over them, and what the target must hand over.
    Orthogonal to `drafter` (depth, block size, windows) and `loss` (position weights, chunking)."""

    _target_: str = MISSING


@dataclass
class DFlashVariantConfig(VariantConfig):
    """Plain DFlash: block position k >= 1 predicts token a + k, hard-label CE."""

    _target_: str = "dflash.step.variant.DFlashVariant"


@dataclass
class DSparkVariantConfig(VariantConfig):
    """DSpark (deepseek-ai/DeepSpec): every block position k predicts token a + k + 1, a Markov
    head biases each position by the token before it, a confidence head predicts acceptance; the
    loss is ce_weight CE + tv_weight |p_draft - p_target|_1 + confidence_weight BCE, each weighted
    by the position decay (docs/ARCHITECTURE.md §1, DSpark). Defaults: the reference's."""

    _target_: str = "dflash.step.variant.DSparkVariant"
    # Rank r of the Markov head's factorised transition (0: no Markov head).
    markov_rank: int = 256
    markov_head_type: MarkovHeadType = MarkovHeadType.vanilla
    # Import path of a head class of your own (dflash.models.dspark.MarkovHead's interface, built
    # with vocab_size=, markov_rank=, hidden_size=); overrides markov_head_type. null: the built-in.
    markov_head_class: Optional[str] = None
    # The confidence head (built iff confidence_weight > 0, as the reference does).
    confidence_head: bool = True
    # The confidence head also reads the previous token's Markov embedding [h_k; W1[x_{k-1}]].
    confidence_with_markov: bool = True
    # Loss weights: CE against the data token, L1 distance |p_draft - p_target|_1 (twice the total
    # variation), BCE of the confidence head against 1 - TV (the soft acceptance).
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    # The fused loss's vocabulary-wide terms (CE, L1, the soft acceptance and their gradient):
    # inductor (the compiled PyTorch formula) or triton (dflash/step/dspark_kernel.py, CUDA only;
    # the paper-shape step 167.3 instead of 174.1 ms and 0.8 GiB less: benchmarks/RESULTS.md);
    # auto: triton where it runs.
    fused_terms: FusedTerms = FusedTerms.auto

    def __post_init__(self) -> None:
        if self.markov_rank < 0:
            raise ValueError(f"variant.markov_rank={self.markov_rank}: must be >= 0 (0: no Markov head)")
        if self.confidence_head and self.confidence_with_markov and self.markov_rank == 0:
            raise ValueError(
                "variant.confidence_with_markov=true needs a Markov head (variant.markov_rank > 0); "
                "set variant.confidence_with_markov=false"
            )
        weights = ("ce_weight", "tv_weight", "confidence_weight")
        for key in weights:
            if not getattr(self, key) >= 0:  # `not >=`: nan fails too
                raise ValueError(f"variant.{key}={getattr(self, key)}: must be >= 0")
        if not any(getattr(self, key) > 0 for key in weights):
            # The loss would be 0 at every step: a run that trains nothing and reports success.
            raise ValueError(
                "variant=dspark with variant.ce_weight, variant.tv_weight and variant.confidence_weight "
                "all 0 has no loss term and trains nothing: set one of them > 0 (the reference's: 0.1, 0.9, 1.0)"
            )
        if self.confidence_head != (self.confidence_weight > 0):
            # The reference builds the head exactly when its loss weight is positive: a head with
            # no loss would be exported untrained, a weight without a head would train nothing.
            raise ValueError(
                f"variant.confidence_head={str(self.confidence_head).lower()} needs "
                f"variant.confidence_weight {'> 0' if self.confidence_head else '= 0'} "
                f"(got {self.confidence_weight})"
            )


@dataclass
class DFlash2VariantConfig(VariantConfig):
    """DFlash2 (z-lab): block position k >= 1 predicts token a + k as in DFlash; a grouped dynamic
    depthwise causal convolution around every draft sublayer (identity at init) and a selector
    over the unary logits' top-K; loss CE + selector_alpha x the selector's K-way CE, the gold token
    injected when the top-K misses it (docs/ARCHITECTURE.md §1, DFlash2). Defaults: the released
    drafters' (z-lab/Qwen3.8-27B-DFlash2) and the public trainers' alpha."""

    _target_: str = "dflash.step.variant.DFlash2Variant"
    # Taps of each convolution (tap 0: the position itself, tap t: t positions back in the block).
    conv_kernel_size: int = 2
    # Channels sharing one dynamic coefficient; must divide the hidden size. null: 16 where it
    # divides the target's hidden size, else its largest divisor below 16
    # (dflash/config/shape_defaults.py: default_conv_group_size).
    conv_group_size: Optional[int] = None
    # Rank r of the selector's codebooks ([vocab, r] each) and hidden projection.
    selector_rank: int = 256
    # Candidates per draft position: the unary logits' top-K. null: 16 where the target's hidden
    # size is >= 16 x 17, else the largest K with K (K + 1) <= hidden size, which llama.cpp requires
    # (dflash/config/shape_defaults.py: default_selector_top_k).
    selector_top_k: Optional[int] = None
    # Weight of the selector's K-way CE beside the unary CE (0: the selector does not train).
    selector_alpha: float = 1.0

    def __post_init__(self) -> None:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"variant.{key}={value}: must be >= 1")
        if not self.selector_alpha >= 0:  # `not >=`: nan fails too
            raise ValueError(f"variant.selector_alpha={self.selector_alpha}: must be >= 0")


@dataclass
class NoiseConfig:
    """`_target_`: a noise schedule (dflash/step/noise.py): per optimizer step, the share of
    block positions that keep their true token and the std of the feature noise."""

    _target_: str = MISSING


@dataclass
class NoNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.NoNoise"


@dataclass
class MaskRampNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.MaskRampNoise"
    # Share of non-anchor block positions that keep their true token at step 0 (ramps to 0).
    start: float = 0.5
    warmup_steps: int = 2000

    # A schedule that silently does nothing is the bug this group exists to avoid.
    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"noise=mask_ramp needs noise.warmup_steps >= 1, got {self.warmup_steps}")
        if not 0.0 < self.start <= 1.0:
            raise ValueError(f"noise=mask_ramp needs noise.start in (0, 1], got {self.start}")


@dataclass
class FeatureNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.FeatureNoise"
    # Std of the Gaussian added to the fused context feature after warmup (ramps from 0).
    std: float = 0.05
    warmup_steps: int = 2000

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"noise=feature needs noise.warmup_steps >= 1, got {self.warmup_steps}")
        if not self.std > 0.0:
            raise ValueError(f"noise=feature needs noise.std > 0, got {self.std}")


@dataclass
class PipelineConfig:
    """`_target_`: the trainer (dflash/trainer/), built with the run's targets, step objects,
    dataset and planner."""

    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class SyncPipelineConfig(PipelineConfig):
    _target_: str = "dflash.trainer.sync.SyncTrainer"


@dataclass
class AsyncPipelineConfig(PipelineConfig):
    _target_: str = "dflash.trainer.async_trainer.AsyncTrainer"
    # Packets of target features waiting for a drafter (producers block beyond it).
    hs_queue_size: int = 8
    # Collated batches waiting per target device.
    prefetch_depth: int = 4
    # Collate/pad/pin worker threads.
    num_workers: int = 2
    # Run every bucket's largest shape through the target before the clock starts.
    warmup: bool = True
    # How often the main thread collects metric windows and checks thread health.
    poll_interval_s: float = 0.05
    # How long threads get to stop after a failure or a stop request.
    shutdown_timeout_s: float = 10.0
    # A stop request waits for the step in hand (a first compile can take minutes); if it has
    # not ended after this many seconds, every pipeline thread's stack is logged once, so a step
    # that will never end (a compiler whose processes the signal killed) shows where it waits.
    stop_report_s: float = 300.0


def pipeline_name(node: PipelineConfig) -> str:
    """The `pipeline` option a node is (sync, async), or its `_target_` for a user's trainer."""
    if isinstance(node, SyncPipelineConfig):
        return "sync"
    if isinstance(node, AsyncPipelineConfig):
        return "async"
    return node._target_


@dataclass
class MonitorConfig:
    """`_target_`: the monitor (dflash/monitor/monitor.py), built with the sinks and the trainer."""

    _target_: str = "dflash.monitor.monitor.Monitor"
    _partial_: bool = True
    # Seconds between ticks (one flat dict of floats to every sink); 0: one tick per log window.
    interval_s: float = 10.0
    # NVML telemetry (gpu/): off is the escape hatch when the driver misbehaves.
    telemetry: bool = True
    # CUDA caching-allocator stats (cuda/), peaks reset per tick.
    cuda_stats: bool = True


@dataclass
class LoggerConfig:
    # Metric sinks, name -> {_target_: a sink class or factory, its keyword arguments}; each is
    # built with `context=` (the run dir, the resolved config, the step count, the start step:
    # dflash/monitor/sinks/). The logger options fill it (jsonl, console, wandb, tensorboard,
    # mlflow; a list of them, logger=[tensorboard,mlflow], fills it with each); a user adds
    # one with +logger.sinks.mine._target_=my_module.MySink, drops one with ~logger.sinks.NAME.
    sinks: dict[str, Any] = field(default_factory=dict)
    every_steps: int = 10

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"logger.every_steps must be >= 1, got {self.every_steps}")


@dataclass
class CheckpointConfig:
    every_steps: int = 1000
    keep_last: int = 3

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep_last < 1:
            raise ValueError("checkpoint.every_steps and checkpoint.keep_last must be >= 1")


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
        if self.reference_slots < 1:
            raise ValueError(f"eval.reference_slots must be >= 1, got {self.reference_slots}")
        if self.decode_streams < 1:
            raise ValueError(f"eval.decode_streams must be >= 1, got {self.decode_streams}")


@dataclass
class DebugConfig:
    name: str = "none"
    # Stop after this many optimizer steps (the LR schedule still spans the whole run).
    max_steps: Optional[int] = None
    detect_anomaly: bool = False

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"debug.max_steps must be >= 1 (or null: no limit), got {self.max_steps}")


@dataclass
class PathsConfig:
    output_dir: str = MISSING
    cache_dir: str = MISSING


@dataclass
class TrainConfig:
    epochs: int = 6
    # Overrides epochs: total optimizer steps (the LR schedule spans exactly these).
    total_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1, got {self.epochs}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"train.total_steps must be >= 1 or null, got {self.total_steps}")


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    variant: VariantConfig = field(default_factory=VariantConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    # A checkpoint directory to continue from (same batches, same losses).
    resume: Optional[str] = None
    # resume= onto training data other than the checkpoint's (other files or contents, another
    # template, appended samples) is refused, naming what changed; true continues on it anyway.
    resume_changed_data: bool = False
    # dflash-eval: the drafter to evaluate, a dflash checkpoint directory (whose run config then
    # supplies the target, unless target is overridden) or any z-lab-layout export.
    ckpt: Optional[str] = None
    # The summary metric the task function returns (what a Hydra sweeper optimizes).
    objective: str = "eval/tau"
    # Training callbacks, name -> {_target_: a class, its keyword arguments}
    # (dflash/monitor/callbacks.py, docs/extending.md): +callbacks.mine._target_=my_module.Mine
    callbacks: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingConfig:
    # null: the target's own recommendation (its generation_config.json; over HTTP, whatever the
    # server applies, e.g. vLLM's --generation-config). Temperature 0: greedy.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: int = 2048
    seed: int = 0


@dataclass
class RegenConfig:
    """`dflash-regen` (conf/regen.yaml): replace the assistant turns of a dataset with the target's."""

    target: TargetConfig = field(default_factory=TargetConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    # Conversation files (.jsonl / .json / .parquet, or save_to_disk directories; OpenAI or ShareGPT
    # records, other names: `layout`).
    input: list[str] = MISSING
    layout: ConversationLayoutConfig = field(default_factory=ConversationLayoutConfig)
    # JSONL of regenerated conversations (OpenAI `messages`); appended to, so a rerun resumes.
    output: str = MISSING
    backend: RegenBackend = RegenBackend.transformers
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Replies generated at once (transformers: continuous-batching slots, or one generate batch
    # for targets without a static cache; http: conversations in flight, each on its own).
    batch_size: int = 16
    # transformers, static cache: positions per slot (prompt + reply); a longer prompt is left
    # out with a warning (a rerun with a larger max_len picks it up).
    max_len: int = 4096
    # transformers, static cache: decode steps replayed as CUDA graphs (null: on CUDA), their
    # kernels fused by torch.compile first (`compile`: a one-time compile per run).
    cuda_graphs: Optional[bool] = None
    compile: bool = False
    # http: OpenAI-compatible base URL (e.g. http://localhost:8000/v1), model name (null: the
    # first the server lists), API key (null: the OPENAI_API_KEY environment variable, else
    # "EMPTY"; masked as *** in every record), per-request timeout and retries (backoff,
    # 429/5xx/errors).
    url: Optional[str] = None
    model: Optional[str] = None
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    max_retries: int = 5
    # Exit 2 (after writing what succeeded) when more than this share of the conversations
    # attempted failed: a dead or misconfigured server is an error, not a short dataset.
    max_failed_frac: float = 0.01
    # Stop after this many conversations (null: all).
    limit: Optional[int] = None


# The component schemas each option file of conf/<group>/ starts from (`defaults:
# [/schema/<group>/<option>@_here_]`): stored apart from the options, so they are neither listed nor
# selectable as options of the group.
COMPONENT_OPTIONS: dict[str, dict[str, type]] = {
    "scheduler": {"interleave": InterleaveSchedulerConfig, "shuffle": ShuffleSchedulerConfig},
    "optimizer": {"adamw": AdamWConfig},
    "lr_schedule": {"cosine": CosineLrScheduleConfig, "constant": ConstantLrScheduleConfig},
    "loss": {"default": LossConfig},
    "variant": {
        "dflash": DFlashVariantConfig,
        "dspark": DSparkVariantConfig,
        "dflash2": DFlash2VariantConfig,
    },
    "noise": {"none": NoNoiseConfig, "mask_ramp": MaskRampNoiseConfig, "feature": FeatureNoiseConfig},
    "pipeline": {"sync": SyncPipelineConfig, "async": AsyncPipelineConfig},
    "monitor": {"default": MonitorConfig},
}


def default_cache_dir() -> str:
    """paths.cache_dir's default: $DFLASH_CACHE_DIR, else ~/.cache/dflash. (OmegaConf resolves an
    `oc.env` default even when the variable is set, so HOME would be required by every run.)"""
    import os

    if os.environ.get("DFLASH_CACHE_DIR"):
        return os.path.expanduser(os.environ["DFLASH_CACHE_DIR"])
    if not os.environ.get("HOME"):
        raise ValueError(
            "paths.cache_dir: neither DFLASH_CACHE_DIR nor HOME is set; set one, or paths.cache_dir=DIR"
        )
    return os.path.join(os.environ["HOME"], ".cache", "dflash")


def register_configs() -> None:
    """Register the root schemas; idempotent (Hydra's ConfigStore replaces same-name entries)."""
    from os import getpid

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("dflash_cache_dir", default_cache_dir, replace=True)
    OmegaConf.register_new_resolver("dflash_pid", getpid, replace=True)  # default run dir names
    schema = OmegaConf.structured(Config)
    # Name -> entry maps the user fills: `eval.benchmarks={gsm8k: g.jsonl}` and a new sink or
    # callback must work without Hydra's `+` (the flag keeps Hydra's struct mode from refusing
    # the new names).
    for free_form in (schema.eval.benchmarks, schema.callbacks, schema.logger.sinks):
        OmegaConf.set_struct(free_form, False)
    store = ConfigStore.instance()
    store.store(name="dflash_schema", node=schema)
    store.store(name="dflash_regen_schema", node=RegenConfig)
    for group, options in COMPONENT_OPTIONS.items():
        for option, node in options.items():
            store.store(group=f"schema/{group}", name=option, node=node)
