"""Where a target's feature forward spends its FLOPs and its time, part by part.

The parts of a decoder layer: `full attention` (self_attn), `linear attention` (Gated DeltaNet,
linear_attn), `router` (the MoE gate), `experts` (the routed experts), `shared expert` (with its
gate), `dense MLP` (a layer without experts). Whatever a layer does outside them (norms,
residual adds, the MoE block's sums) is `other`.

Useful FLOPs are counted honestly (benchmarks/RESULTS.md reports MFU from them):
- matmuls: 2 x weight elements x tokens for every projection a token runs (the 2-D weights);
- experts: only the `num_experts_per_tok` experts a token is routed to;
- full attention: causal, query t sees t + 1 keys (4 x head_dim x heads per visible pair);
- Gated DeltaNet's recurrence: per token and value head, the state read-out (q . S) and the
  rank-one update (k v^T), 2 x 2 x key_dim x value_dim; the short convolution is not counted.
Only the layers the feature stack runs (up to the deepest feature layer) count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from dflash.target.families import is_deltanet_layer
from dflash.target.model import FrozenTarget

PARTS = ("full attention", "linear attention", "router", "experts", "shared expert", "dense MLP")


def layer_parts(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(part, module) of one decoder layer; the shared expert's gate counts with the expert."""
    if isinstance(getattr(layer, "self_attn", None), nn.Module):
        yield "full attention", layer.self_attn
    if is_deltanet_layer(layer):
        yield "linear attention", layer.linear_attn
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return
    experts = getattr(mlp, "experts", None)
    if experts is None:
        yield "dense MLP", mlp
        return
    yield "router", mlp.gate
    yield "experts", experts
    for name in ("shared_expert", "shared_expert_gate"):
        if isinstance(getattr(mlp, name, None), nn.Module):
            yield "shared expert", getattr(mlp, name)


def feature_layers(target: FrozenTarget) -> list[nn.Module]:
    return list(target.model.base_model.layers[: target.feature_layers])


def _matrix_elements(module: nn.Module) -> int:
    """Elements of the module's 2-D weights: its projections (nn.Linear, or a router's bare
    weight); norms and biases are 1-D, a convolution's kernel 3-D."""
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


def _expert_elements_per_token(experts: nn.Module, config) -> float:
    """Weight elements one token multiplies in the routed experts: top-k of them."""
    top_k = config.num_experts_per_tok
    fused = [p for name, p in experts.named_parameters(recurse=False) if p.dim() == 3]
    if fused:  # transformers 5: [num_experts, out, in] tensors
        return sum(p.numel() for p in fused) * top_k / fused[0].shape[0]
    return _matrix_elements(experts) * top_k / len(experts)  # a ModuleList of expert MLPs


def token_weight_bytes(target: FrozenTarget) -> float:
    """Weight bytes one token's decoding step reads: every weight of the model but the routed
    experts, of which only the `num_experts_per_tok` a token uses (a batch-1 step's floor is
    these bytes over the memory bandwidth)."""
    total = 0.0
    experts = {id(p) for layer in target.model.base_model.layers for p in _routed_expert_params(layer)}
    for parameter in target.model.parameters():
        if id(parameter) not in experts:
            total += parameter.numel() * parameter.element_size()
    for layer in target.model.base_model.layers:
        mlp_experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if mlp_experts is not None:
            element = next(mlp_experts.parameters()).element_size()
            total += _expert_elements_per_token(mlp_experts, target.config) * element
    return total


def _routed_expert_params(layer: nn.Module) -> list[nn.Parameter]:
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return [] if experts is None else list(experts.parameters())


def part_flops(target: FrozenTarget, *, batch: int, seq_len: int) -> dict[str, float]:
    """Useful FLOPs of one feature forward over [batch, seq_len] tokens, per part."""
    config = target.config
    tokens = batch * seq_len
    visible_pairs = batch * seq_len * (seq_len + 1) / 2
    flops: dict[str, float] = defaultdict(float)
    for layer in feature_layers(target):
        for part, module in layer_parts(layer):
            if part == "experts":
                flops[part] += 2 * _expert_elements_per_token(module, config) * tokens
                continue
            flops[part] += 2 * _matrix_elements(module) * tokens
            if part == "full attention":
                head_dim = (
                    getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                )
                flops[part] += 4 * config.num_attention_heads * head_dim * visible_pairs
            elif part == "linear attention":
                state = config.linear_key_head_dim * config.linear_value_head_dim
                flops[part] += 4 * config.linear_num_value_heads * state * tokens
    return dict(flops)


class PartTimer:
    """CUDA events around every part module of the feature stack's layers (forward hooks), so
    one forward says how long each part took on the device. Events are recorded on the current
    stream and read after a synchronize, once the forward is done."""

    def __init__(self, target: FrozenTarget):
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[int, torch.cuda.Event] = {}
        self._hooks = []
        for layer in feature_layers(target):
            for part, module in layer_parts(layer):
                self._hooks.append(module.register_forward_pre_hook(self._start))
                self._hooks.append(
                    module.register_forward_hook(lambda m, _i, _o, part=part: self._stop(m, part))
                )

    def _start(self, module: nn.Module, _inputs) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open[id(module)] = event

    def _stop(self, module: nn.Module, part: str) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((part, self._open.pop(id(module)), end))

    def collect(self) -> dict[str, float]:
        """Milliseconds per part since the last collect (synchronizes the device)."""
        torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for part, start, end in self._pending:
            totals[part] += start.elapsed_time(end)
        self._pending.clear()
        return dict(totals)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
