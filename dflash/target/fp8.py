"""Block-wise FP8 targets: weights kept as float8_e4m3fn, dequantized layer by layer as they run.

The published FP8 checkpoints (Qwen3-8B-FP8, Qwen3-Next-80B-A3B-*-FP8, Qwen3.5/3.6-*-FP8) store
each quantized projection as a float8_e4m3fn `weight` and a float32 `weight_scale_inv` with one
value per 128 x 128 block (config.json: `quantization_config: {quant_method: fp8,
weight_block_size: [128, 128], activation_scheme: dynamic, modules_to_not_convert: [...]}`).
The weight is `fp8 * scale_inv` over each block; a shape that is not a multiple of the block has
a last, partial block with its own scale (the scale grid is ceil(rows/128) x ceil(cols/128)).
Kept in bf16 (`modules_to_not_convert`, and lm_head/embeddings by default): embeddings, LM head,
norms, the MoE routers (`mlp.gate`), `mlp.shared_expert_gate`, and the Gated DeltaNet's small
`in_proj_ba` / `in_proj_a` / `in_proj_b`, `conv1d`, `A_log`, `dt_bias`. Routed experts are stored
per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight` + scales); transformers stacks them into
`gate_up_proj [E, 2I, H]` (gate rows, then up rows, each half with its own block grid) and
`down_proj [E, H, I]`.

A frozen target never needs the dequantized weights all at once: `BlockFP8Linear` and
`BlockFP8Experts` hold the FP8 weights and scales and dequantize one module's weights into the
compute dtype when it runs, so memory holds the FP8 model plus one layer's transient weights.
The GEMMs then run in the compute dtype (bf16): the features are those of the bf16 forward of
the dequantized weights, which is what the tests compare against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.target import experts_tiling, fused_experts
from dflash.target.fp8_checkpoint import check_fp8_checkpoint, fp8_block
from dflash.target.size import StoredTensor, stored_tensors

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = (128, 128)
# Module names (suffixes) the published FP8 checkpoints keep unquantized beside embeddings, LM
# head and norms (which are not Linear layers of a decoder layer): the routers, the shared
# expert's gate and the Gated DeltaNet's per-head gate projections (out dim = 2 x heads).
UNQUANTIZED = (
    "lm_head",
    "embed_tokens",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_ba",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
)


def _quantization(config: Any) -> dict[str, Any]:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return {}
    return dict(quant) if isinstance(quant, dict) else quant.to_dict()


def is_fp8_checkpoint(config: Any) -> bool:
    """Whether a transformers config describes a fine-grained (block-wise) FP8 checkpoint."""
    quant = _quantization(config)
    method = quant.get("quant_method")
    return str(getattr(method, "value", method)) == "fp8" and quant.get("weight_block_size") is not None


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(fp8, scale_inv)` of a `[..., rows, cols]` weight: per block, scale_inv = amax / 448 (1 for
    an all-zero block) and fp8 = weight / scale_inv rounded to e4m3. A partial last block is
    scaled by its own amax (zero padding changes no amax)."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block
    grid_rows, grid_cols = -(-rows // block_rows), -(-cols // block_cols)
    padded = F.pad(weight.float(), (0, grid_cols * block_cols - cols, 0, grid_rows * block_rows - rows))
    tiles = padded.unflatten(-1, (grid_cols, block_cols)).unflatten(-3, (grid_rows, block_rows))
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = tiles / scale_inv[..., :, None, :, None]
    fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(-2).flatten(-3, -2)
    return fp8[..., :rows, :cols].contiguous(), scale_inv


def dequantize_blockwise(
    fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`fp8 * scale_inv` per block, computed in float32 and rounded once to `dtype`."""
    rows, cols = fp8.shape[-2:]
    weight = fp8.float()
    if rows % block[0] == 0 and cols % block[1] == 0:
        # Whole blocks: scale a blocked view in place (no expanded scale tensor: a MoE layer's
        # experts are ~0.8G elements at Qwen3-Next's shape).
        tiles = weight.unflatten(-1, (cols // block[1], block[1])).unflatten(-3, (rows // block[0], block[0]))
        tiles.mul_(scale_inv.float()[..., :, None, :, None])
        return weight.to(dtype)
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.mul_(scale[..., :rows, :cols]).to(dtype)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    # Parameters (not buffers): they move with the model and count in its weight bytes.
    return nn.Parameter(tensor, requires_grad=False)


class BlockFP8Linear(nn.Module):
    """A bias-optional linear layer whose weight is block-wise FP8, dequantized when it runs."""

    def __init__(
        self,
        *,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        block: tuple[int, int],
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.weight = _frozen(weight)
        self.weight_scale_inv = _frozen(weight_scale_inv)
        self.bias = None if bias is None else _frozen(bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blockwise(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.dequantized(input.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class _DequantizedView:
    """An experts module as transformers' experts functions read it (`self.gate_up_proj`,
    `self.num_experts`, `self._apply_gate` ...), with the dequantized weights in place of its own."""

    def __init__(self, experts: nn.Module, **weights: torch.Tensor):
        self.__dict__.update(weights)
        self._experts = experts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._experts, name)


class BlockFP8Experts(nn.Module):
    """A MoE layer's routed experts (transformers' fused `gate_up_proj [E, 2I, H]`, `down_proj
    [E, H, I]`) held in FP8. Each forward dequantizes the layer's experts once, then runs the
    experts implementation the model is set to (`config._experts_implementation`: eager,
    grouped_mm, batched_mm) on them, through transformers' own functions. `template` is the
    model's experts module (its weights dropped): it supplies the activation, the gate and the
    flags those functions read."""

    def __init__(
        self,
        *,
        template: nn.Module,
        gate_up: tuple[torch.Tensor, torch.Tensor],
        down: tuple[torch.Tensor, torch.Tensor],
        block: tuple[int, int],
    ):
        super().__init__()
        self.block = tuple(block)
        self.num_experts = template.num_experts
        self.gate_up_proj, self.gate_up_proj_scale_inv = (_frozen(t) for t in gate_up)
        self.down_proj, self.down_proj_scale_inv = (_frozen(t) for t in down)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
            template._parameters.pop(name, None)
        self._template = (template,)  # a tuple: outside the module tree, it owns no weights now

    def _fused_reads_fp8(self) -> bool:
        """Whether the fused kernels can read these weights as stored: 128 x 128 blocks and
        both halves of gate_up on whole blocks (else they get the dequantized weights)."""
        inter, hidden = self.down_proj.shape[-1], self.down_proj.shape[-2]
        block = fused_experts.FP8_BLOCK
        return self.block == (block, block) and inter % block == 0 and hidden % block == 0

    def multiplied_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The weights' dtype in the fused kernels' products: FP8 where they read these weights as
        stored, else the activations' (the weights dequantized first); experts_tiling.use_tiling
        picks the tiles for it."""
        return self.gate_up_proj.dtype if self._fused_reads_fp8() else activations

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The gate and up halves each have their own block grid (they are two checkpoint tensors).
        halves = zip(self.gate_up_proj.chunk(2, dim=-2), self.gate_up_proj_scale_inv.chunk(2, dim=-2))
        gate_up = torch.cat([dequantize_blockwise(w, s, self.block, dtype) for w, s in halves], dim=-2)
        return gate_up, dequantize_blockwise(self.down_proj, self.down_proj_scale_inv, self.block, dtype)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        template = self._template[0]
        implementation = template.config._experts_implementation
        if implementation in fused_experts.IMPLEMENTATIONS and self._fused_reads_fp8():
            return fused_experts.fused_fp8_experts(
                template,
                hidden_states,
                top_k_index,
                top_k_weights,
                gate_up=(self.gate_up_proj, self.gate_up_proj_scale_inv),
                down=(self.down_proj, self.down_proj_scale_inv),
                fp8_activations=implementation == fused_experts.W8A8_IMPLEMENTATION,
                # this module's tiles (use_tiling set them here, not on the unregistered template)
                tiling=getattr(self, experts_tiling.TILING_ATTRIBUTE, None),
            )
        gate_up, down = self.dequantized(hidden_states.dtype)
        view = _DequantizedView(
            template,
            gate_up_proj=gate_up,
            down_proj=down,
            # Read (and left unused: the weights are not FP8) by transformers' FP8Experts loop.
            gate_up_proj_scale_inv=self.gate_up_proj_scale_inv,
            down_proj_scale_inv=self.down_proj_scale_inv,
            # the tiles use_tiling chose for the fused kernels on these dequantized weights
            **{experts_tiling.TILING_ATTRIBUTE: getattr(self, experts_tiling.TILING_ATTRIBUTE, None)},
        )
        if implementation in (None, "eager"):  # the model's own eager loop (its class's forward)
            return type(template).forward(view, hidden_states, top_k_index, top_k_weights)
        experts_forward = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, None)
        return experts_forward(view, hidden_states, top_k_index, top_k_weights)


def _quantizable(name: str, module: nn.Module) -> bool:
    """Whether a decoder layer's module `name` is one the published FP8 checkpoints quantize:
    a plain Linear projection or fused routed experts, not one of `UNQUANTIZED`."""
    if any(name == suffix or name.endswith("." + suffix) for suffix in UNQUANTIZED):
        return False
    return type(module) is nn.Linear or isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)


def quantize_layer(layer: nn.Module, *, block: tuple[int, int] = BLOCK) -> nn.Module:
    """`layer` (one decoder layer) with the modules a published FP8 checkpoint quantizes in
    block-wise FP8, quantized from their current weights: plain Linear projections (not the
    routers and gates of `UNQUANTIZED`) and fused routed experts. Each bf16 weight is dropped
    as its FP8 copy replaces it."""
    for name, module in list(layer.named_modules()):
        if name and _quantizable(name, module):
            layer.set_submodule(name, _quantized(module, block))
    return layer


def _quantized(module: nn.Module, block: tuple[int, int]) -> nn.Module:
    if type(module) is nn.Linear:
        weight, scale_inv = quantize_blockwise(module.weight.detach(), block)
        bias = None if module.bias is None else module.bias.detach()
        return BlockFP8Linear(weight=weight, weight_scale_inv=scale_inv, block=block, bias=bias)
    gate, up = module.gate_up_proj.detach().chunk(2, dim=-2)
    (gate_q, gate_s), (up_q, up_s) = quantize_blockwise(gate, block), quantize_blockwise(up, block)
    gate_up = (torch.cat([gate_q, up_q], dim=-2), torch.cat([gate_s, up_s], dim=-2))
    down = quantize_blockwise(module.down_proj.detach(), block)
    return BlockFP8Experts(template=module, gate_up=gate_up, down=down, block=block)


def from_transformers_fp8(model: nn.Module) -> int:
    """Replace transformers' FP8 modules (`FP8Linear`, `FP8Experts`, as its fine-grained FP8
    loader builds them from a published checkpoint) by `BlockFP8Linear` / `BlockFP8Experts`
    holding the same FP8 tensors: transformers' own FP8 GEMMs need a kernel fetched from the hub
    at run time. Returns how many modules were replaced."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Linear) and module.weight.dtype == FP8_DTYPE:
            if module.block_size is None or getattr(module, "activation_scale", None) is not None:
                raise ValueError(f"{name}: only block-wise FP8 with dynamic activations is supported")
            new: nn.Module = BlockFP8Linear(
                weight=module.weight.data,
                weight_scale_inv=module.weight_scale_inv.data,
                block=tuple(module.block_size),
                bias=None if module.bias is None else module.bias.data,
            )
        elif isinstance(module, FP8Experts) and module.down_proj.dtype == FP8_DTYPE:
            if module.block_size is None or not module.has_gate:
                raise ValueError(f"{name}: only block-wise FP8 gated experts are supported")
            new = BlockFP8Experts(
                template=module,
                gate_up=(module.gate_up_proj.data, module.gate_up_proj_scale_inv.data),
                down=(module.down_proj.data, module.down_proj_scale_inv.data),
                block=tuple(module.block_size),
            )
        else:
            continue
        model.set_submodule(name, new)
        replaced += 1
    return replaced


def quantized_module_names(model: nn.Module) -> list[str]:
    """The modules `quantize_layer` puts in FP8, over every decoder layer of `model` (which may be
    on the meta device: used to count a target's bytes before it loads)."""
    return [
        name
        for name, module in model.named_modules()
        if ".layers." in f".{name}" and _quantizable(name, module)
    ]


def weight_bytes(model: nn.Module, *, itemsize: int, fp8: bool) -> int:
    """The bytes of `model`'s weights at `itemsize` bytes an element, the FP8 modules' weights at
    one byte (plus one float32 scale per 128 x 128 block) when `fp8`."""
    total = sum(p.numel() for p in model.parameters()) * itemsize
    if not fp8:
        return total
    for name in quantized_module_names(model):
        elements = sum(p.numel() for p in model.get_submodule(name).parameters() if p.dim() >= 2)
        total -= elements * (itemsize - 1) - elements * 4 // (BLOCK[0] * BLOCK[1])
    return total


def build_random_fp8(config: Any, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A random-weight causal LM of `config` whose decoder layers are quantized to block-wise FP8
    one at a time as they are initialised, so the full-precision model never exists: an 80B MoE
    target builds within its FP8 size. The caller seeds the generator. The weights are
    transformers' initialisation, as `from_config` draws them (in another order)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = model.base_model.layers
    for index, layer in enumerate(layers):
        layer.to_empty(device=device)
        layer.apply(model._init_weights)
        layers[index] = quantize_layer(layer)
    for child in model.children():
        if child is not model.base_model:  # the LM head
            child.to_empty(device=device)
            child.apply(model._init_weights)
    for child in model.base_model.children():
        if child is not layers:
            child.to_empty(device=device)  # embeddings, final norm, rotary tables
            child.apply(model._init_weights)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def load_fp8_checkpoint(path: str, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A published block-wise FP8 checkpoint as published, through transformers' fine-grained
    FP8 loader (it reads the per-expert tensors and `weight_scale_inv` into the model's layout).
    On CUDA the weights stay FP8 on the device: transformers' FP8 modules where its FP8 kernel
    can be loaded, else `BlockFP8Linear` / `BlockFP8Experts` over the same tensors (dequantized
    module by module as they run). Elsewhere transformers dequantizes them at load into `dtype`.
    Either way the checkpoint's config and scales are checked first (dflash/target/fp8_checkpoint.py):
    transformers would apply a missing or misshapen scale silently."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

    block = check_fp8_checkpoint(path) or fp8_block(  # a hub id: its config as transformers read it
        _quantization(AutoConfig.from_pretrained(path)), f"target.path={path}: config.json"
    )
    if device.type != "cuda":
        misread = _partial_block_beside_full(stored_tensors(Path(path)), block)
        if misread is not None:
            raise ValueError(
                f"target.path={path!r}: {misread} has a partial {block} block beside full ones, which "
                "transformers' CPU dequantization scales wrongly; load this checkpoint on CUDA "
                "(FP8 kept, dequantized by dflash) or from a bf16 copy"
            )
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=FineGrainedFP8Config(dequantize=True)
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": index})
    if not _transformers_fp8_kernel_loads():
        from_transformers_fp8(model)
    return model


def _partial_block_beside_full(tensors: dict[str, StoredTensor], block: tuple[int, int]) -> str | None:
    """The first `weight_scale_inv` whose weight has a dimension that is not a multiple of the
    block but spans more than one block. transformers' dequantize-at-load takes a tensor's block
    to be its shape divided by its scale grid, which holds for every shape the published
    checkpoints have (multiples of 128, or a single block) and for no such one. Safetensors
    headers only: nothing is read but the tensors' shapes."""
    for key, scale in tensors.items():
        weight = tensors.get(key.removesuffix("_scale_inv")) if key.endswith(".weight_scale_inv") else None
        if weight is None or len(scale.shape) < 2:
            continue
        for size, cells, side in zip(weight.shape[-2:], scale.shape[-2:], block):
            if cells > 1 and size % side:
                return f"{key.removesuffix('_scale_inv')} {list(weight.shape)} (scales {list(scale.shape)})"
    return None


def _transformers_fp8_kernel_loads() -> bool:
    """Whether transformers' fine-grained FP8 GEMM kernel (fetched through the `kernels` package
    from the hub, then cached) is available here."""
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

    try:
        load_finegrained_fp8_kernel()
    except (ImportError, OSError, RuntimeError):
        return False
    return True
