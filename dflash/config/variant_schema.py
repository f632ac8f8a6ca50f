"""The drafter variants' config group (`variant`): one structured config per variant, each naming
the variant class it builds (dflash/step/variant.py) and holding that variant's own options.

A variant's options are written once, here: the field, its type, its default and the comment that
says what it does. The YAML option (conf/variant/NAME.yaml) starts from the dataclass and repeats
none of them; the training side's class takes them with `variant_options`. `dflash train
variant=NAME --cfg job` prints them composed.

The built-in variants are listed once, at the end (BUILT_IN_VARIANTS): each with its options and
where its other pieces live, so the registries of every floor name none of them.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional, TypeVar, get_type_hints

from omegaconf import MISSING


class FusedTerms(str, Enum):
    """How DSpark's fused LM-head loss computes its vocabulary-wide terms per chunk of rows
    (dflash/step/dspark_loss.py)."""

    auto = "auto"  # triton on CUDA where triton is installed, else inductor
    inductor = "inductor"  # the PyTorch formula (compiled with the drafter; eager when it is not)
    triton = "triton"  # one Triton kernel, three passes over the vocabulary per row (CUDA)


class MarkovHeadType(str, Enum):
    """DSpark's sequential head (deepseek-ai/DeepSpec `markov_head_type`; dflash/drafters/dspark.py)."""

    vanilla = "vanilla"  # bias W2(W1[x_{k-1}]): rank-r transition from the previous token
    gated = "gated"  # W1[x_{k-1}] scaled by a gate read from [h_k; W1[x_{k-1}]]
    rnn = "rnn"  # a gated recurrent state over the block


@dataclass
class VariantConfig:
    """`_target_`: the drafter variant (dflash/step/variant.py): which drafter is built, which
    block position predicts which token, the loss over them, and what the target must hand over.
    Orthogonal to `drafter` (depth, block size, windows) and `loss` (position weights, chunking)."""

    _target_: str = MISSING


VariantClass = TypeVar("VariantClass", bound=type)


def variant_options(config_class: type[VariantConfig]) -> Callable[[VariantClass], VariantClass]:
    """A class decorator for a variant's training side, applied under `@dataclass`: the class
    takes `config_class` as its `options` and gains its options (every field but `_target_`) as fields of its own, with their
    types and defaults, in their order. A variant built without a config (a test, a tool) then
    has the same defaults a composed `variant=NAME` has, and adding an option is one field here.

        @dataclass(frozen=True)
        @variant_options(DSparkVariantConfig)
        class DSparkVariant(DFlashVariant): ...
    """
    hints = get_type_hints(config_class)  # resolved: the class's module need not import them

    def take(cls: VariantClass) -> VariantClass:
        own = dict(cls.__dict__.get("__annotations__", {}))
        for option in fields(config_class):
            if option.name == "_target_":
                continue
            if option.name in own:
                # Two declarations of one option would drift apart: the point of this decorator.
                raise TypeError(
                    f"{cls.__qualname__}.{option.name} is an option of {config_class.__qualname__}: "
                    "declare it there only"
                )
            own[option.name] = hints[option.name]
            if option.default is not NO_DEFAULT:
                setattr(cls, option.name, option.default)
            elif option.default_factory is not NO_DEFAULT:
                setattr(cls, option.name, field(default_factory=option.default_factory))
        cls.__annotations__ = own
        cls.options = config_class  # the schema `variant=NAME` composes, named once here
        return cls

    return take


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
    # Import path of a head class of your own (dflash.drafters.dspark.MarkovHead's interface, built
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
class LiLiCorrVariantConfig(VariantConfig):
    """LiLiCorr (arXiv 2608.20530; NVIDIA Model-Optimizer): the DFlash backbone, its top-K
    candidates per draft slot scored by a small transformer over the lattice, drafts by a greedy
    walk; loss DFlash's CE + ce_weight lattice CE + margin_weight hinge + penalty_weight distractor
    penalty (dflash/step/lilicorr_loss.py). Defaults: ModelOpt's lilicorr.yaml (`base`)."""

    _target_: str = "dflash.step.lilicorr_variant.LiLiCorrVariant"
    # Candidates per draft slot (a power of two: SGLang's and vLLM's loaders refuse others).
    candidate_topk: int = 8
    # Width of the lattice transformer and of its factor vectors. null: the drafter's hidden size
    # (the recipe's lilicorr_hidden_size and lilicorr_factor_dim, 1024, are for a 4096-wide
    # Qwen3-8B drafter).
    hidden_size: Optional[int] = None
    factor_dim: Optional[int] = None
    num_layers: int = 2
    num_heads: int = 8
    mlp_ratio: float = 2.0
    # The factors are cosines times this fixed scale; vector_eps floors the vectors' norms.
    logit_scale: float = 8.0
    vector_eps: float = 1.0e-4
    # Absolute weights of the lattice terms beside DFlash's CE (no outer factor); `margin` is the
    # hinge's width in log-factor units (the recipe's `margin` composition: 0.125 / 0.125 / 0.25).
    ce_weight: float = 0.25  # dflash_lilicorr_w_ce
    margin_weight: float = 0.0  # dflash_lilicorr_w_margin
    penalty_weight: float = 0.25  # dflash_lilicorr_w_pen
    margin: float = 2.0  # dflash_lilicorr_margin
    # DFlash2's block-local convolutions around every draft sublayer (ModelOpt's LiLiCorr+conv,
    # identity at init; what a DFlash2 checkpoint warm-starting the run brings): both or neither.
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None

    def __post_init__(self) -> None:
        topk = self.candidate_topk
        if topk < 1 or topk & (topk - 1):
            raise ValueError(
                f"variant.candidate_topk={topk}: must be a power of two (SGLang's and vLLM's rule)"
            )
        if (self.conv_kernel_size is None) != (self.conv_group_size is None):
            raise ValueError("variant.conv_kernel_size and variant.conv_group_size: set both or neither")
        for key in (
            "num_layers",
            "num_heads",
            "hidden_size",
            "factor_dim",
            "conv_kernel_size",
            "conv_group_size",
        ):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"variant.{key}={value}: must be >= 1")
        for key in ("mlp_ratio", "logit_scale"):
            if not getattr(self, key) > 0:  # `not >`: nan fails too
                raise ValueError(f"variant.{key}={getattr(self, key)}: must be > 0")
        if not 0.0 < self.vector_eps < 0.5:
            raise ValueError(f"variant.vector_eps={self.vector_eps}: must be in (0, 0.5)")
        weights = ("ce_weight", "margin_weight", "penalty_weight")
        for key in weights:
            if not getattr(self, key) >= 0:
                raise ValueError(f"variant.{key}={getattr(self, key)}: must be >= 0")
        if not any(getattr(self, key) > 0 for key in weights):
            # The head would get no gradient and be exported at its random init.
            raise ValueError(
                "variant=lilicorr with variant.ce_weight, variant.margin_weight and variant.penalty_weight "
                "all 0 never trains the lattice head: set one > 0 (the recipe's: 0.25, 0, 0.25)"
            )
        if self.margin_weight > 0 and not self.margin > 0:
            raise ValueError(f"variant.margin={self.margin}: must be > 0 when variant.margin_weight > 0")


@dataclass(frozen=True)
class BuiltInVariant:
    """One of the package's own drafter variants, each piece named where it lives: its options
    (the class above; their `_target_` is the training class, dflash/step), its drafter class
    (dflash/drafters), its export rules and any layout of its own (dflash/export; the z-lab and
    speculators layouts are every variant's). The pieces above this floor are import paths, not
    imports: each floor's registry imports its own pieces of every entry (`built_in_piece`), so
    imports keep pointing down (tests/test_layers.py)."""

    name: str
    options: type[VariantConfig]
    drafter: str
    export: str
    layouts: tuple[str, ...] = ()


# The built-in variants, in registration order (the backbone first): a built-in is one entry here.
# The drafter registry (dflash/drafters/drafter_registry.py), the training side's
# (dflash/step/variant_registry.py), the export rules' and layouts' (dflash/export/export_registry.py)
# and the config group's options (dflash/config/schema.py COMPONENT_OPTIONS) read this list and
# name no variant; a plug-in's variant enters the same registries through their register_* calls.
BUILT_IN_VARIANTS: tuple[BuiltInVariant, ...] = (
    BuiltInVariant(
        "dflash",
        DFlashVariantConfig,
        drafter="dflash.drafters.backbone.DFlashDrafter",
        export="dflash.export.rules.VariantExport",
    ),
    BuiltInVariant(
        "dspark",
        DSparkVariantConfig,
        drafter="dflash.drafters.dspark.DSparkDrafter",
        export="dflash.export.deepspec.DSparkExport",
        layouts=("dflash.export.deepspec.DEEPSPEC",),
    ),
    BuiltInVariant(
        "dflash2",
        DFlash2VariantConfig,
        drafter="dflash.drafters.dflash2.DFlash2Drafter",
        export="dflash.export.dflash2_rules.DFlash2Export",
    ),
    BuiltInVariant(
        "lilicorr",
        LiLiCorrVariantConfig,
        drafter="dflash.drafters.lilicorr.LiLiCorrDrafter",
        export="dflash.export.lilicorr_rules.LiLiCorrExport",
    ),
)


def built_in_piece(path: str, *, floor: str) -> Any:
    """The object at `path` ("package.module.name"), which must lie in the package `floor` (the
    registry's own: a registry imports no module above it)."""
    module, _, name = path.rpartition(".")
    if not module.startswith(f"{floor}."):
        raise ValueError(f"{path}: a built-in variant's piece outside {floor} (imported from {floor} only)")
    return getattr(importlib.import_module(module), name)
