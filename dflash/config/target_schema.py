"""The target's config group (`target`): which model hands the drafter its features, and how its
forward is compiled, graphed and quantized.

No torch here: see dflash/config/schema.py."""

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
    # dflash's forward-only Triton kernels (dflash/target/fused_experts.py): gather + gate/up GEMM
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


@dataclass
class KernelTilingConfig:
    """One fused experts kernel's launch shape (dflash.target.experts_tiling.KernelTiling); null:
    the default's."""

    block_n: Optional[int] = None  # output columns per program
    block_k: Optional[int] = None  # K per step
    warps: Optional[int] = None
    stages: Optional[int] = None  # software-pipeline stages


@dataclass
class ExpertsTilingConfig:
    """The fused experts kernels' launch shapes (dflash.target.experts_tiling.ExpertsTiling); each
    null field keeps the default's (dflash.target.experts_tiling.default_tiling: by the weights'
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
    # beyond the count run without one (dflash/target/feature_graphs.py).
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
    # and keep them in FP8 (dflash/target/fp8.py): speed and memory runs at the FP8 size. An
    # FP8 checkpoint at target.path is recognised by its quantization_config, no key needed.
    fp8: bool = False
