"""The frozen target LLM: fused-layer context features, frozen embeddings and LM head."""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:  # transformers >= 5: hidden states recorded by hooks (older versions collect them in the loop)
    from transformers.utils.output_capturing import maybe_install_capturing_hooks as install_output_hooks
except ImportError:
    install_output_hooks = None

from dflash.config.schema import CompileScope, ExpertsKind, TargetConfig
from dflash.target import experts_tiling, fused_experts
from dflash.target.deltanet_mixer import FeatureMixer
from dflash.target.families import (
    IMAGE_TEXT_TYPES,
    is_deltanet_layer,
    model_types_of,
    refuse_unsupported,
    text_config,
)
from dflash.target.feature_graphs import FeatureGraphs
from dflash.target.fp8 import BlockFP8Experts, build_random_fp8, is_fp8_checkpoint, load_fp8_checkpoint
from dflash.target.fp8_checkpoint import check_fp8_checkpoint
from dflash.target.model_dirs import refuse_missing_model_dir
from dflash.target.router import is_top_k_router, use_feature_router
from dflash.target.short_conv import use_fla_short_conv
from dflash.target.size import refuse_missing_text_config, refuse_size_mismatch
from dflash.torch_runtime.compile import compile_shared
from dflash.torch_runtime.kernel_libraries import triton_runs
from dflash.torch_runtime.thread_records import keep_records_per_thread

log = logging.getLogger(__name__)


def causal_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, registered under a name that has no mask function: a
    forward builds no mask and runs the causal kernel, instead of inspecting position ids or a
    padding mask on the host (a GPU sync per forward). Only right-padded or unpadded inputs may
    use it.

    A cached forward of several new tokens (speculative verification) needs the causal pattern
    aligned to the end of the cache; SDPA's `is_causal` aligns it to the start, so that case
    gets an explicit lower-right mask, built on the device.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:
        attention_mask = torch.ones((q_len, kv_len), dtype=torch.bool, device=query.device).tril(
            kv_len - q_len
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


CAUSAL_ATTENTION = "dflash_causal_sdpa"
AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)


def load_target_config(cfg: TargetConfig) -> PretrainedConfig:
    """The target's language-model config, without loading any weights (used by validation).

    An image-text checkpoint (Qwen3.5, Qwen3.6) gives its `text_config`; a model_type outside
    `SUPPORTED_FAMILIES` is refused here, before anything loads (dflash/target/families.py)."""
    if cfg.path is None:
        if not cfg.arch or cfg.model_type is None:
            raise ValueError(
                f"target.path, or target.arch with target.model_type, must be set (target={cfg.name})"
            )
        refuse_unsupported(cfg.model_type, f"target.model_type (target={cfg.name})")
        # A random image-text target is its language model alone: `arch` holds text fields.
        model_type = f"{cfg.model_type}_text" if cfg.model_type in IMAGE_TEXT_TYPES else cfg.model_type
        return AutoConfig.for_model(model_type, **dict(cfg.arch))
    if cfg.fp8:
        raise ValueError(
            f"target.fp8=true quantizes a random-weight target, but target.path={cfg.path!r} is set: a "
            "checkpoint loads as published (an FP8 one is recognised by its quantization_config)"
        )
    refuse_missing_model_dir("target.path", cfg.path)
    check_fp8_checkpoint(cfg.path)  # a malformed quantization_config or FP8 scale, before any load
    try:
        config = AutoConfig.from_pretrained(cfg.path)
    except (OSError, ValueError) as exc:
        where = (
            "there"
            if Path(cfg.path).exists()
            else "from the Hugging Face hub or its cache (no such local path)"
        )
        raise ValueError(
            f"target.path={cfg.path!r}: cannot read a transformers config {where} ({exc})"
        ) from exc
    refuse_missing_text_config(cfg.path)
    refuse_unsupported(config.model_type, f"target.path={cfg.path!r}")
    if cfg.model_type is not None and cfg.model_type not in model_types_of(config):
        raise ValueError(
            f"target.path={cfg.path!r} holds a {config.model_type!r} model, but target={cfg.name} "
            f"expects target.model_type={cfg.model_type!r}"
        )
    return text_config(config)


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class TargetOutput:
    logits: torch.Tensor | None
    # [batch, seq, n_feat * hidden]: decoder layer outputs at target_layer_ids, concatenated.
    features: torch.Tensor


def feature_model(base_model: nn.Module, *, deepest: int) -> nn.Module:
    """`base_model` run only up to decoder layer `deepest`: the layers past the deepest feature
    layer, and the final norm, compute nothing the drafter reads (the paper's 8B layer choice
    stops at layer 33 of 36: 2 layers, 5.6% of the feature forward). A shallow copy sharing
    every submodule and weight, with its own module table and a config copy whose
    `num_hidden_layers` ends transformers' layer loop there. Its last hidden state is that
    layer's output as is: transformers overwrites the last captured hidden state with the
    final-norm output, which is the identity here (and the full model's hidden state at a layer
    that is not its last is un-normed too). When the deepest feature layer is the last layer
    the model itself is returned."""
    config = base_model.config
    # transformers 5 records hidden states with hooks on the decoder layers, installed on a
    # model's first forward and flagged in its __dict__. Installed now, every copy (this one,
    # `with_own_layers`') inherits the flag; installed by each, the shared layers would record
    # every hidden state twice.
    if install_output_hooks is not None:
        install_output_hooks(base_model)
    if deepest + 1 >= config.num_hidden_layers or not isinstance(
        getattr(base_model, "norm", None), nn.Module
    ):
        return base_model  # nothing to cut, or a layout whose final norm we cannot name
    stack = copy.copy(base_model)
    stack._modules = dict(base_model._modules)  # else the copy's norm would replace the model's
    stack.norm = nn.Identity()
    stack.config = copy.copy(config)
    stack.config.num_hidden_layers = deepest + 1
    if getattr(config, "layer_types", None) is not None:
        stack.config.layer_types = list(config.layer_types[: deepest + 1])
    return stack


# transformers' forward hooks that record outputs (hidden states, router logits, attentions) for
# `output_*=True`: they read a context variable, which dynamo cannot trace.
_OUTPUT_CAPTURE_HOOK = "output_capturing_hook"


def _own_module_tree(module: nn.Module, *, capture_hooks: bool) -> nn.Module:
    """A shallow copy of `module` and of every submodule below it: the same parameters and
    buffers, each module object its own. `capture_hooks=False` leaves transformers' output
    capturing hooks off the copy (other hooks stay)."""
    copied = copy.copy(module)
    copied._modules = {
        name: None if child is None else _own_module_tree(child, capture_hooks=False)
        for name, child in module._modules.items()
    }
    if not capture_hooks:
        copied._forward_hooks = type(module._forward_hooks)(
            (key, hook)
            for key, hook in module._forward_hooks.items()
            if getattr(hook, "__name__", "") != _OUTPUT_CAPTURE_HOOK
        )
    return copied


def with_own_layers(stack: nn.Module) -> nn.Module:
    """A shallow copy of a decoder stack whose decoder layers, and everything inside them, are
    shallow copies too: the same weights, but each module object its own, so compiling the
    copies (`compile_features(scope="layers")`) leaves the model's own layers, which decoding
    runs, eager. Inside a layer the copies carry no output-capturing hooks: the feature stack
    records the decoder layers' outputs only (their own hooks stay), and a router's
    logits-recording hook in every MoE layer would break each layer's graph in two."""
    copied = copy.copy(stack)
    copied._modules = dict(stack._modules)
    copied.layers = nn.ModuleList(_own_module_tree(layer, capture_hooks=True) for layer in stack.layers)
    return copied


def auto_experts(model: nn.Module, device: torch.device) -> str | None:
    """`target.experts=auto` resolved for `model` on `device`: dflash's fused kernels on CUDA where
    triton is installed and every routed-experts module is the kind they compute; otherwise
    None (transformers' default), with the reason logged."""
    if not getattr(model.config, "num_experts", None):
        return None
    if not triton_runs(device):
        return None
    for module in model.modules():
        experts = module._template[0] if isinstance(module, BlockFP8Experts) else module
        if hasattr(experts, "gate_up_proj") and hasattr(experts, "config"):
            try:
                fused_experts.refuse_unsupported(experts)
            except ValueError as exc:
                log.info("target.experts=auto: transformers' default experts (%s)", exc)
                return None
    return fused_experts.EXPERTS_IMPLEMENTATION


def refuse_unused_experts_tiling(model: nn.Module, *, experts: str | None, auto: bool) -> None:
    """`target.experts_tiling` set for a target whose routed experts do not run the fused kernels:
    refused where that was the user's choice (the key would change nothing); under
    `experts=auto`, whose choice depends on the machine, logged."""
    moe = getattr(model.config, "num_experts", None)
    implementation = experts or "transformers' default"
    why = (
        f"its routed experts run {implementation}, not the fused kernels"
        if moe
        else "this target has no routed experts"
    )
    if auto:
        log.info("target.experts_tiling unused: %s", why)
        return
    raise ValueError(
        f"target.experts_tiling sets the fused experts kernels' tiles, but {why} (set target.experts=fused, or drop the key)"
    )


def faster_target_settings(cfg: TargetConfig, config: PretrainedConfig) -> list[str]:
    """The target options a run on CUDA left off that make this target's feature forward faster
    (`experts=auto` counts as fused: where it is not, the run logged why): fused experts for a
    MoE target, the compiled stack, one graph per layer kind for MoE and hybrid stacks.
    Qwen3-Next-80B's shape, 12 layers, 4 x 3072 tokens on an H200 (benchmarks/RESULTS.md,
    2026-12-03 (night)): fused experts 117.7 ms vs grouped_mm 151.7 ms, both uncompiled; one
    graph per layer 76.4 ms vs 95.7 ms uncompiled, both fused. The run summary names them when
    the target is the slower role."""
    text = config.get_text_config()
    moe = bool(getattr(text, "num_experts", 0))
    hybrid = "linear_attention" in (getattr(text, "layer_types", None) or ())
    settings = []
    if moe and cfg.experts not in (ExpertsKind.fused, ExpertsKind.fused_w8a8, ExpertsKind.auto):
        settings.append("target.experts=fused")
    compiled = cfg.compile is not False  # null: on, on CUDA
    if not compiled:
        settings.append("target.compile=true")
    if (moe or hybrid) and (not compiled or cfg.compile_scope is not CompileScope.layers):
        settings.append("target.compile_scope=layers")
    return settings


class FrozenTarget(nn.Module):
    """Wraps an AutoModelForCausalLM; every parameter is frozen and the model stays in eval mode."""

    def __init__(self, model: nn.Module, layer_ids: list[int], *, final_state: bool = False):
        """final_state (variant=dspark, whose loss compares the draft distribution with the
        target's): `features` runs the whole stack, final norm included, and appends the final
        hidden state [B, S, H] as the last H columns of its tensor: the same forward, and one
        tensor through the pipeline's queues and device copies; never vocabulary-sized logits."""
        super().__init__()
        keep_records_per_thread()  # target threads and evaluations run it while others compile
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = list(layer_ids)
        self.final_state = final_state
        self._masked_attention = model.config._attn_implementation
        # transformers 5 renamed the forward's `past_key_values` argument to `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"
        model.config._attn_implementation = CAUSAL_ATTENTION
        # In a tuple, not a module attribute: that would register the shared layers twice.
        # The stack's own depth: `feature_model` then keeps every layer and the final norm.
        deepest = model.base_model.config.num_hidden_layers - 1 if final_state else max(self.layer_ids)
        self._feature_model = (feature_model(model.base_model, deepest=deepest),)
        self._feature_stack: Callable[..., Any] = self._feature_model[0].forward
        self._graphs: FeatureGraphs | None = None

    @property
    def feature_layers(self) -> int:
        """How many decoder layers `features` runs (up to the deepest feature layer)."""
        return self._feature_model[0].config.num_hidden_layers

    def compile_features(
        self, backend: Any = "inductor", dynamic: bool | None = True, scope: str = "stack"
    ) -> None:
        """Compile the decoder stack that `features` runs. Decoding (`forward`, `generate`) and
        `reference_features` stay eager. `dynamic`: True, batches of any size and length share
        the graphs (what training uses); None, torch's default: static shapes until a shape
        changes (scripts/bench_step.py sets the two side by side).

        `scope`: "stack", the whole stack as one function (fastest for dense stacks: every layer
        inlined into one graph); "layers", each decoder layer apart (regional compilation): the
        layers share their code, and dynamo keeps one graph per layer kind with the weights as
        inputs, so a 48-layer hybrid MoE stack compiles two graphs instead of one graph of 48
        unrolled layers. Either compiles a copy of the stack whose Gated DeltaNet mixers are
        `FeatureMixer`s (dflash/target/deltanet_mixer.py) and whose MoE routers take their top-k as
        one op (dflash/target/router.py)."""
        if scope not in ("stack", "layers"):
            raise ValueError(f"target.compile_scope={scope!r}: expected 'stack' or 'layers'")
        stack = with_own_layers(self._feature_model[0])
        for layer in stack.layers[: self.feature_layers]:
            if is_deltanet_layer(layer):
                # The copy's own mixer only (decoding keeps transformers'): transformers' calls
                # flash-linear-attention's kernels, which dynamo does not call (under
                # torch.compile transformers runs its PyTorch reference of the chunked rule, a
                # loop over 64-token chunks dynamo unrolls: on an H200, 47 s of tracing and over
                # 100 s more before inductor started, for one Qwen3-Next layer). FeatureMixer
                # calls them as custom ops, which dynamo keeps whole.
                layer.linear_attn = FeatureMixer(layer.linear_attn)
            for router in filter(is_top_k_router, layer.modules()):
                use_feature_router(router)  # the copy's own router: top-k as one kernel on CUDA
            if scope == "layers":
                # The layer's forward alone: its hooks (the hidden-state capture, which dynamo
                # cannot trace) run around the compiled graph, eagerly.
                layer.forward = compile_shared(layer.forward, backend=backend, dynamic=dynamic)
        if scope == "stack":
            self._feature_stack = compile_shared(stack.forward, backend=backend, dynamic=dynamic)
        else:
            self._feature_stack = stack.forward

    @contextmanager
    def _padded_attention(self) -> Iterator[None]:
        """The model's own masked attention, for left-padded batches. Not thread-safe."""
        self.model.config._attn_implementation = self._masked_attention
        try:
            yield
        finally:
            self.model.config._attn_implementation = CAUSAL_ATTENTION

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], pad_id: int, **generate_kwargs: Any) -> list[list[int]]:
        """The new tokens of `model.generate` over a left-padded batch of prompts (KV cache, the
        model's masked attention). For data writing, before any pipeline thread starts: it
        switches the attention implementation for its duration."""
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.int64)
            attention_mask[row, longest - len(prompt) :] = 1
        with self._padded_attention():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                pad_token_id=pad_id,
                **generate_kwargs,
            )
        return out[:, longest:].cpu().tolist()

    @classmethod
    def from_config(
        cls, cfg: TargetConfig, layer_ids: list[int], device: torch.device, *, final_state: bool = False
    ) -> FrozenTarget:
        auto = cfg.experts is ExpertsKind.auto
        fused = (
            not auto and cfg.experts is not None and _enum_value(cfg.experts) in fused_experts.IMPLEMENTATIONS
        )
        if fused and device.type != "cuda":  # before any weights are built or read
            raise ValueError(
                f"target.experts={_enum_value(cfg.experts)} runs Triton kernels on CUDA; "
                f"on {device.type} use eager, grouped_mm or batched_mm"
            )
        dtype = resolve_dtype(cfg.dtype, device)
        shared_memory = experts_tiling.shared_memory_limit(device)
        tiling_set = experts_tiling.configured(cfg.experts_tiling)
        if tiling_set:  # checked before any weights are built or read (per module once they are)
            experts_tiling.resolve(
                cfg.experts_tiling,
                weights=torch.float8_e4m3fn if cfg.fp8 else dtype,
                activations=dtype,
                shared_memory=shared_memory,
            )
        if cfg.path is None:
            config = load_target_config(cfg)
            # Initialised where it runs: a multi-billion-parameter random target built on the
            # CPU and then moved takes minutes. (A CUDA-built target differs from a CPU-built
            # one of the same seed; the same seed gives the same weights on every GPU.)
            cuda_devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda_devices), torch.device(device):
                torch.manual_seed(cfg.init_seed)
                if cfg.fp8:
                    model = build_random_fp8(config, dtype=dtype, device=device)
                else:
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            # refuses a wrong architecture, or a config larger than the weights, before reading them
            refuse_size_mismatch(cfg.path, load_target_config(cfg))
            if is_fp8_checkpoint(AutoConfig.from_pretrained(cfg.path)):
                model = load_fp8_checkpoint(cfg.path, dtype=dtype, device=device)
            else:
                model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype)
        if device.type == "cuda":
            use_fla_short_conv(model, cfg.fla_short_conv)
        experts = auto_experts(model, device) if auto else cfg.experts and _enum_value(cfg.experts)
        moe = bool(getattr(model.config, "num_experts", None))
        if experts is not None and moe:
            if experts in fused_experts.IMPLEMENTATIONS:
                fused_experts.register()
            model.set_experts_implementation(experts)
        if moe and experts in fused_experts.IMPLEMENTATIONS:
            # every fused target: defaults that fit this GPU's shared memory, the key's fields over them
            experts_tiling.use_tiling(
                model, cfg.experts_tiling, activations=dtype, shared_memory=shared_memory
            )
        elif tiling_set:
            refuse_unused_experts_tiling(model, experts=experts, auto=auto)
        return cls(model.to(device), layer_ids, final_state=final_state)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # hidden_states[0] is the embedding output, so decoder layer i is hidden_states[i + 1].
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def use_feature_graphs(self, max_shapes: int) -> None:
        """`features` replayed from CUDA graphs, one per batch shape for up to `max_shapes` shapes
        (target.cuda_graphs; dflash/target/feature_graphs.py); 0: none. Each graph is captured at its
        shape's first call, from the stack `features` runs then (compiled, if
        `compile_features` ran before)."""
        if not max_shapes:
            self._graphs = None
            return
        if self.device.type != "cuda":
            raise ValueError(
                f"target.cuda_graphs={max_shapes}: CUDA graphs need the target on a GPU, not {self.device}"
            )
        self._graphs = FeatureGraphs(self._plain_features, max_shapes=max_shapes)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Context features of right-padded ids [B, S]; runs the decoder stack without the LM head
        (from a CUDA graph of the batch's shape where `use_feature_graphs` ran).

        No attention mask, on purpose: under causal attention (and causal linear attention in
        hybrid targets) a real token never sees the padding after it, so its features are exact;
        padding positions get features nobody reads (the context a block sees ends before its
        anchor). A padding mask would make transformers inspect it on the host, a GPU sync per
        batch, and leave the fast causal kernels.
        """
        if self._graphs is not None:
            return self._graphs(input_ids)
        return self._plain_features(input_ids)

    def _plain_features(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._feature_stack(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        if self.final_state:
            # One concatenation, as `_fuse` does alone: no copy beyond it.
            layers = [out.hidden_states[i + 1] for i in self.layer_ids]
            return torch.cat([*layers, out.last_hidden_state], dim=-1)
        return self._fuse(out.hidden_states)

    @torch.no_grad()
    def reference_features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`features` through the eager stack, whether or not `compile_features` ran: a one-off
        forward (the start-up feature check) builds no graph for its shape."""
        stack = self._feature_model[0]
        return self._fuse(
            stack(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
        )

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None
    ) -> TargetOutput:
        """Logits and fused features; with `cache` (a transformers Cache), `input_ids` are the
        positions after the cached ones and the cache grows by them."""
        kwargs = {} if cache is None else {self._cache_argument: cache}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=cache is not None,
            **kwargs,
        )
        return TargetOutput(logits=out.logits, features=self._fuse(out.hidden_states))
