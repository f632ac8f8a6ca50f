"""The launch shapes of the fused MoE experts kernels (dflash/target/fused_experts.py): which tiles
they run with, which tiles they cannot run, and how much shared memory a tiling takes.

Each experts module of a target keeps its complete `ExpertsTiling` (`use_tiling`, at target build,
where the GPU and the dtypes are known): `target.experts_tiling`'s fields over the defaults that
fit the GPU (`default_tiling`). The experts call only reads it: no tiling is decided on the hot
path, and a compiled layer sees plain constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_BLOCK = 128  # the published FP8 checkpoints' scale block (weights rows x columns)
# The attribute of an experts module that holds its ExpertsTiling (absent: default_tiling's for
# the weights multiplied), read where transformers calls the experts function with the module.
TILING_ATTRIBUTE = "dflash_experts_tiling"
_KERNEL_FIELDS = ("block_n", "block_k", "warps", "stages")


@dataclass(frozen=True)
class KernelTiling:
    """One kernel's launch shape: output columns and K per step of a program, its warps and
    software-pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int = 3


@dataclass(frozen=True)
class ExpertsTiling:
    """Both kernels' launch shapes; `block_m` is the row tile, and so the padding of each
    expert's run of rows (the routing metadata is built for it)."""

    block_m: int
    gate_up: KernelTiling
    down: KernelTiling

    def refusal(self, fp8: bool) -> str | None:
        """Why these tiles cannot run (None: they can). Triton's dot needs power-of-two tiles of
        at least 16; on FP8 weights a tile (and a K step of activations quantized per 128
        columns) must lie inside one 128-wide scale block, so its sizes divide 128."""
        for name, size in (("block_m", self.block_m), *self._sizes()):
            if size < 16 or size & (size - 1):
                return f"{name}={size} is not a power of two >= 16"
        if fp8:
            for name, size in self._sizes():
                if FP8_BLOCK % size:
                    return f"{name}={size} does not divide the {FP8_BLOCK}-wide FP8 scale blocks"
        return None

    def shared_memory(self, *, activations: torch.dtype, weights: torch.dtype) -> int:
        """Bytes of shared memory a program of the larger kernel takes: every pipeline stage
        holds a block_m x K tile of activations and the K rows of its weight tiles (gate/up: the
        gate's and the up's, 2 N; down: N). On an H200 (227 KiB per block) this count over the
        limit is exactly the set of tilings Triton refused in bench_experts' sweep
        (benchmarks/RESULTS.md, 2026-12-04)."""
        act, weight = (torch.empty(0, dtype=d).element_size() for d in (activations, weights))
        return max(
            kernel.stages * kernel.block_k * (self.block_m * act + tiles * kernel.block_n * weight)
            for kernel, tiles in ((self.gate_up, 2), (self.down, 1))
        )

    def as_ints(self) -> list[int]:
        """Flat, as the compiled op carries it: block_m, then each kernel's N, K, warps, stages."""
        kernels = (self.gate_up, self.down)
        return [self.block_m, *(getattr(kernel, f) for kernel in kernels for f in _KERNEL_FIELDS)]

    @classmethod
    def from_ints(cls, ints: list[int]) -> ExpertsTiling:
        block_m, *rest = ints
        width = len(_KERNEL_FIELDS)
        return cls(block_m=block_m, gate_up=KernelTiling(*rest[:width]), down=KernelTiling(*rest[width:]))

    def with_settings(self, cfg: Any) -> ExpertsTiling:
        """These tiles with the fields `target.experts_tiling` (ExpertsTilingConfig) sets."""
        ints = [
            mine if theirs is None else theirs
            for mine, theirs in zip(self.as_ints(), _fields(cfg), strict=True)
        ]
        return ExpertsTiling.from_ints(ints)

    def override(self) -> str:
        """This tiling as the dflash-train / bench_target override that selects it."""
        gate_up, down = (
            "{" + ",".join(f"{f}:{getattr(k, f)}" for f in _KERNEL_FIELDS) + "}"
            for k in (self.gate_up, self.down)
        )
        return f"target.experts_tiling={{block_m:{self.block_m},gate_up:{gate_up},down:{down}}}"

    def _sizes(self) -> list[tuple[str, int]]:
        return [
            (f"{kernel}.{field}", getattr(getattr(self, kernel), field))
            for kernel in ("gate_up", "down")
            for field in ("block_n", "block_k")
        ]


def _fields(cfg: Any) -> list[int | None]:
    """`target.experts_tiling`'s fields in ExpertsTiling.as_ints' order (None: unset)."""
    return [cfg.block_m, *(getattr(kernel, f) for kernel in (cfg.gate_up, cfg.down) for f in _KERNEL_FIELDS)]


def configured(cfg: Any) -> bool:
    """Whether `target.experts_tiling` sets any field."""
    return any(value is not None for value in _fields(cfg))


# The defaults by the weights multiplied, fastest first; default_tiling takes the first that fits
# the GPU's shared memory. bf16 / fp16: the fastest of bench_experts' sweep at Qwen3-Next-80B's
# expert shape on an H200 (2.49 ms per 12,288-token layer call; 192 KiB), then the tiles before it
# (3.22 ms there; 120 KiB: an A100's 163 KiB), then tiles for GPUs of ~100 KiB per block (L40S,
# consumer cards; 36 KiB). FP8 (tiles inside a 128-wide scale block; not swept): 144 KiB under
# bf16 activations, then 32 KiB. fp32 (exact-reference targets, e.g. dflash-eval's fp32
# lossless check): 4-byte tiles, so fewer rows and stages (72 KiB).
def _tiles(
    block_m: int, gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]
) -> ExpertsTiling:
    """An ExpertsTiling from each kernel's (block_n, block_k, warps, stages)."""
    return ExpertsTiling(block_m=block_m, gate_up=KernelTiling(*gate_up), down=KernelTiling(*down))


_SMALL = _tiles(16, gate_up=(64, 32, 4, 2), down=(128, 64, 4, 2))
_DEFAULTS = {
    torch.bfloat16: (
        _tiles(128, gate_up=(128, 64, 8, 4), down=(128, 64, 4, 3)),
        _tiles(64, gate_up=(128, 64, 4, 3), down=(128, 64, 4, 3)),
        _SMALL,
    ),
    torch.float8_e4m3fn: (
        _tiles(64, gate_up=(128, 128, 8, 3), down=(128, 128, 8, 3)),
        _tiles(64, gate_up=(64, 64, 4, 2), down=(64, 64, 4, 2)),
    ),
    torch.float32: (_SMALL,),
}


def default_tiling(
    weights: torch.dtype, *, activations: torch.dtype | None = None, shared_memory: int | None = None
) -> ExpertsTiling:
    """The tiles the kernels run with unless told otherwise, for weights of dtype `weights` (fp16
    as bf16) multiplied by `activations` (default: the weights' dtype; bf16 for FP8 weights):
    the fastest of _DEFAULTS that fits `shared_memory` bytes per block (None: the fastest)."""
    candidates = _DEFAULTS.get(weights, _DEFAULTS[torch.bfloat16])
    if activations is None:
        activations = torch.bfloat16 if weights == torch.float8_e4m3fn else weights
    for tiling in candidates:
        if (
            shared_memory is None
            or tiling.shared_memory(activations=activations, weights=weights) <= shared_memory
        ):
            return tiling
    return candidates[-1]


def shared_memory_limit(device: torch.device) -> int | None:
    """Shared memory a kernel can opt in to per block on `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


def resolve(
    settings: Any, *, weights: torch.dtype, activations: torch.dtype, shared_memory: int | None
) -> ExpertsTiling:
    """The tiles for weights of dtype `weights` multiplied by `activations` on a GPU of
    `shared_memory` bytes per block (None: unchecked): `settings`' (`target.experts_tiling`)
    fields over default_tiling's. Tiles the kernels cannot run, or that do not fit, are refused
    naming the key."""
    tiling = default_tiling(weights, activations=activations, shared_memory=shared_memory).with_settings(
        settings
    )
    refusal = tiling.refusal(fp8=weights == torch.float8_e4m3fn)
    needed = tiling.shared_memory(activations=activations, weights=weights)
    if refusal is None and shared_memory is not None and needed > shared_memory:
        refusal = (
            f"{tiling} needs {needed // 1024} KiB of shared memory per block on "
            f"{str(weights).removeprefix('torch.')} weights, over this GPU's {shared_memory // 1024} KiB "
            "(fewer stages or smaller tiles)"
        )
    if refusal is not None:
        raise ValueError(f"target.experts_tiling: {refusal}")
    return tiling


def use_tiling(
    model: torch.nn.Module, settings: Any, *, activations: torch.dtype, shared_memory: int | None
) -> int:
    """Give each of `model`'s routed-experts modules its complete tiling (`resolve`) for the
    weights the kernels will multiply there: a module's `multiplied_dtype(activations)` where it
    has one (FP8 experts, read as stored or dequantized), else its gate_up_proj's dtype. Returns
    how many modules took one."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "gate_up_proj", None)
        if not isinstance(weight, torch.Tensor):
            continue
        multiplied = getattr(module, "multiplied_dtype", None)
        weights = multiplied(activations) if multiplied is not None else weight.dtype
        tiling = resolve(settings, weights=weights, activations=activations, shared_memory=shared_memory)
        setattr(module, TILING_ATTRIBUTE, tiling)
        count += 1
    return count


def call_tiling(experts: Any, weights: torch.dtype) -> ExpertsTiling:
    """The tiles an experts module's call runs with: use_tiling's, else the default for weights
    of dtype `weights` (a module built outside a target: a test, a benchmark)."""
    return getattr(experts, TILING_ATTRIBUTE, None) or default_tiling(weights)
