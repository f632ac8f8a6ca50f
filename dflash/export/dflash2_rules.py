"""The DFlash2 rules of a drafter directory (docs/EXPORT.md, "DFlash2 drafters"), in both layouts
its readers load:

- the z-lab layout of the released DFlash2 checkpoints (z-lab/Qwen3.8-27B-DFlash2), which the
  z-lab reference, SGLang, vLLM and llama.cpp's converter read: `architectures:
  ["DFlash2DraftModel"]`, the four DFlash2 fields INSIDE `dflash_config` (vLLM indexes them there
  and fails without them; SGLang reads them there only and, without them, builds a drafter with
  no convolution or no selector, silently), `is_causal: false` at the top level;
- the speculators layout (`speculators_model_type: dflash2`, vLLM's speculators path): the same
  fields flat beside `block_size`, and no field for the unary logits' transforms.

Both hold the same tensors (dflash/drafters/dflash2.py): per layer `attention_conv` and `mlp_conv`
(`base_kernel` [2, k, H]: side, tap, channel; `kernel_projection.weight` [2 k G, H]), and
`candidate_selector.{predecessor,successor}_codebook` [V, r], stored WITHOUT `.weight` (SGLang
skips a `.weight` codebook silently and drafts with zero codebooks), beside
`candidate_selector.hidden_projection.weight` [r, H]. Configs here are in the z-lab form (a
speculators config converted by dflash/export/speculators.py) unless a name says otherwise.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dflash.config.shape_defaults import largest_servable_top_k, selector_fits_llama_cpp
from dflash.drafters.dflash2 import DFLASH2_ARCHITECTURE, DFLASH2_KEYS, UNARY_KEYS, DFlash2Drafter
from dflash.export.rules import VariantExport, positive_int

# DFlash2SpeculatorConfig's defaults (speculators/models/dflash2/config.py): a field a
# speculators config.json leaves out reads as these there.
SPECULATORS_DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "sliding_window_non_causal": True,
    "sample_from_anchor": False,
}
# The DFlash2 fields no other variant's config carries (LiLiCorr's convolutions take the other
# two, under DFlash2's names).
SELECTOR_KEYS = ("selector_rank", "selector_top_k")
CONV_MODULES = ("attention_conv", "mlp_conv")
SELECTOR = "candidate_selector"
CODEBOOKS = (f"{SELECTOR}.predecessor_codebook", f"{SELECTOR}.successor_codebook")
# The parts each DFlash2 field switches on in SGLang (it builds them only when both are set).
_PART_OF = {
    "conv_kernel_size": "convolutions",
    "conv_group_size": "convolutions",
    "selector_rank": "selector",
    "selector_top_k": "selector",
}


def is_dflash2(config: dict[str, Any]) -> bool:
    """A DFlash2 drafter's config (z-lab form): its architecture, or a selector field inside
    dflash_config or at the top level (a misplaced field is a DFlash2 export to check). The
    convolutions' fields claim nothing: a LiLiCorr drafter's convolutions carry them too."""
    nested = _settings(config)
    return DFLASH2_ARCHITECTURE in (config.get("architectures") or []) or any(
        key in nested or key in config for key in SELECTOR_KEYS
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("dflash_config")
    return nested if isinstance(nested, dict) else {}


def field_problems(config: dict[str, Any]) -> list[str]:
    """The DFlash2 fields of a z-lab-form config: where every reader looks for them, and the
    values any of them refuses (SGLang, vLLM, speculators: group size dividing the hidden size;
    speculators: kernel within a block, top-K within the vocabulary)."""
    settings = _settings(config)
    problems = []
    for key in DFLASH2_KEYS:
        value = settings.get(key)
        if value is None:
            where = " (it is at the top level, where vLLM and SGLang do not look)" if key in config else ""
            problems.append(
                f"dflash_config.{key} is missing{where}: vLLM fails on it (KeyError), SGLang builds "
                f"the drafter without its {_PART_OF[key]}, silently"
            )
        elif not positive_int(value):
            problems.append(f"dflash_config.{key} is {value!r}: a positive integer is needed")
    if problems:
        return problems  # the rules below read these fields
    kernel, group = settings["conv_kernel_size"], settings["conv_group_size"]
    top_k = settings["selector_top_k"]
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    if isinstance(hidden, int) and hidden % group:
        problems.append(
            f"dflash_config.conv_group_size {group} does not divide hidden_size {hidden} (SGLang, vLLM, "
            "speculators and llama.cpp refuse it)"
        )
    block = config.get("block_size", settings.get("block_size"))
    if isinstance(block, int) and kernel > block:
        problems.append(
            f"dflash_config.conv_kernel_size {kernel} is larger than block_size {block}: taps past "
            "the block's start read zeros only (speculators refuses it)"
        )
    if isinstance(vocab, int) and top_k > vocab:
        problems.append(
            f"dflash_config.selector_top_k {top_k} is larger than vocab_size {vocab} (speculators "
            "refuses it; the others fail at their first top-K)"
        )
    return problems + unary_problems(settings)


def unary_problems(settings: dict[str, Any]) -> list[str]:
    """A released drafter's transforms of its unary logits (z-lab's `compute_logits`)."""
    problems = []
    multiplier = settings.get("output_multiplier")
    if multiplier is not None and (not _number(multiplier) or multiplier <= 0):
        problems.append(
            f"dflash_config.output_multiplier is {multiplier!r}: a positive number is needed (SGLang refuses "
            "anything else)"
        )
    cap = settings.get("final_logit_softcapping")
    if cap is not None and (not _number(cap) or cap < 0):
        problems.append(
            f"dflash_config.final_logit_softcapping is {cap!r}: null (or 0) for none, else a positive number"
        )
    return problems


def describes_tensors(config: dict[str, Any]) -> bool:
    """Whether the DFlash2 tensors' shapes follow from this config (field_problems gives why not)."""
    settings = _settings(config)
    return (
        all(positive_int(settings.get(key)) for key in DFLASH2_KEYS)
        and positive_int(config.get("vocab_size"))
        and config["hidden_size"] % settings["conv_group_size"] == 0
    )


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the convolutions and the selector (describes_tensors must hold):
    `base_kernel` [2 sides, k taps, H], `kernel_projection` [2 k G, H] (its output viewed as
    side, tap, group), the codebooks [V, r] without `.weight`, `hidden_projection` [r, H]."""
    settings = _settings(config)
    hidden, vocab, rank = config["hidden_size"], config["vocab_size"], settings["selector_rank"]
    shapes = conv_tensor_shapes(
        config, kernel_size=settings["conv_kernel_size"], group_size=settings["conv_group_size"]
    )
    shapes[f"{SELECTOR}.hidden_projection.weight"] = (rank, hidden)
    for codebook in CODEBOOKS:
        shapes[codebook] = (vocab, rank)
    return shapes


def conv_tensor_shapes(
    config: dict[str, Any], *, kernel_size: int, group_size: int
) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the block-local convolutions around every layer's attention and
    MLP: `base_kernel` [2 sides, k taps, H], `kernel_projection` [2 k G, H] (G = H / group size).
    DFlash2's, and LiLiCorr's when it carries them (dflash/export/lilicorr_rules.py)."""
    hidden = config["hidden_size"]
    groups = hidden // group_size
    return {
        f"layers.{i}.{conv}.{tensor}": shape
        for i in range(config["num_hidden_layers"])
        for conv in CONV_MODULES
        for tensor, shape in (
            ("base_kernel", (2, kernel_size, hidden)),
            ("kernel_projection.weight", (2 * kernel_size * groups, hidden)),
        )
    }


def unexpected_tensor_reason(name: str) -> str | None:
    """Why a DFlash2 reader misreads a tensor the contract does not list, where it is known."""
    if name.removesuffix(".weight") in CODEBOOKS:
        return (
            "the codebooks are stored without `.weight`: SGLang skips this name and drafts with a zero "
            "codebook, silently; vLLM refuses it"
        )
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (
            "a DFlash2 drafter carries no embedding or LM head: vLLM would take it as the drafter's own, "
            "and the selector's candidates come from that head"
        )
    return None


def lattice_problems(config: dict[str, Any]) -> list[str]:
    """llama.cpp's loader needs hidden_size >= top_k (top_k + 1) ("hidden size is too small for
    the selector lattice"). A rule of the z-lab layout, which llama.cpp's converter reads (a
    drafter it refuses is not written or passed); a note in the speculators layout (reader_limits)."""
    hidden, top_k = config.get("hidden_size"), _settings(config).get("selector_top_k")
    if not (positive_int(hidden) and positive_int(top_k)) or selector_fits_llama_cpp(hidden, top_k):
        return []
    fits = largest_servable_top_k(hidden)
    return [
        f"dflash_config.selector_top_k {top_k}: hidden_size {hidden} < {top_k} x {top_k + 1} = "
        f"{top_k * (top_k + 1)}, which llama.cpp refuses ('hidden size is too small for the selector "
        f"lattice'); train with variant.selector_top_k <= {fits}"
    ]


def reader_limits(config: dict[str, Any]) -> list[str]:
    """Readers that refuse a well-formed DFlash2 drafter of this config (in the speculators
    layout, which llama.cpp does not read), one line each."""
    return [f"{problem}; SGLang and vLLM serve it" for problem in lattice_problems(config)]


# -- the speculators layout (raw speculators config.json) --------------------------------------


def _logit_scaling(fields: dict[str, Any]) -> list[str]:
    """The unary-logit transforms (output_multiplier, final_logit_softcapping) `fields` sets."""
    return [key for key in UNARY_KEYS if fields.get(key) is not None]


def speculators_fields(zlab: dict[str, Any]) -> dict[str, Any]:
    """The speculators config's DFlash2 fields of a z-lab-form DFlash2 config; refused (ValueError)
    when the drafter transforms its unary logits: the speculators layout has no field for that."""
    settings = _settings(zlab)
    scaling = _logit_scaling(settings)
    if scaling:
        raise ValueError(
            f"a DFlash2 drafter with {', '.join(f'{k}={settings[k]}' for k in scaling)}: the speculators layout "
            "has no field for it (speculators would train and serve its logits untransformed); export "
            "it in the z-lab layout (--layout zlab), which SGLang and vLLM serve with it"
        )
    return {
        **{key: settings[key] for key in DFLASH2_KEYS},
        "sample_from_anchor": False,  # position 0 is the given token, as in DFlash
        "sliding_window_non_causal": True,  # every layer sees its block bidirectionally
    }


def zlab_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The dflash_config entries of a speculators DFlash2 config (speculators_problems == [])."""
    with_defaults = {**SPECULATORS_DEFAULTS, **config}
    return {key: with_defaults[key] for key in DFLASH2_KEYS}


def speculators_problems(config: dict[str, Any]) -> list[str]:
    """What keeps a speculators DFlash2 config from being a drafter dflash reads as speculators
    trained it."""
    with_defaults = {**SPECULATORS_DEFAULTS, **config}
    problems = [
        f"{key} is {with_defaults[key]!r}: a positive integer is needed"
        for key in DFLASH2_KEYS
        if not positive_int(with_defaults[key])
    ]
    if with_defaults["sample_from_anchor"] is not False:
        problems.append(
            "sample_from_anchor is true: speculators refuses it for DFlash2 (block position 0 is the "
            "given token, as in DFlash)"
        )
    if config.get("draft_vocab_size") is None:
        problems.append(
            "draft_vocab_size is missing (speculators would read 32000): DFlash2 needs the target's whole vocabulary"
        )
    scaling = _logit_scaling(config)
    if scaling:
        problems.append(
            f"{', '.join(scaling)} in a speculators config: speculators has no such field (it trains and "
            "serves the logits untransformed) and vLLM's reading of it is unverified; use the z-lab layout"
        )
    return problems


def speculators_serving_problems(config: dict[str, Any]) -> list[str]:
    """What vLLM's speculators path needs from a speculators DFlash2 config beyond the rules of
    every speculators config (speculators.serving_problems): `is_causal` where vLLM looks for it."""
    layer = config.get("transformer_layer_config") or {}
    if "sliding_attention" in (layer.get("layer_types") or []) and layer.get("is_causal") is not False:
        return [
            f"transformer_layer_config.is_causal is {layer.get('is_causal')!r}: vLLM lifts these fields "
            "to the top level and reads is_causal first; without false it runs sliding layers causally"
        ]
    return []


class DFlash2Export(VariantExport):
    """A DFlash2 drafter's export rules: the released checkpoints' z-lab layout natively,
    speculators' `dflash2` (speculators/models/dflash2/config.py): the DFlash speculators config
    plus the four DFlash2 fields at the top level, `sample_from_anchor: false`,
    `sliding_window_non_causal: true`, architectures `["DFlash2DraftModel"]`; no field for the
    unary logits' transforms, so a drafter with them is not written there."""

    drafter = DFlash2Drafter
    zlab_architecture = DFLASH2_ARCHITECTURE
    speculators_type: ClassVar[str | None] = "dflash2"
    speculators_architecture: ClassVar[str | None] = DFLASH2_ARCHITECTURE
    speculators_defaults: ClassVar[dict[str, Any]] = SPECULATORS_DEFAULTS
    speculators_class_reason = "vLLM serves it as DFlash, without the selector, otherwise"

    def describes(self, config: dict[str, Any]) -> bool:
        return is_dflash2(config)

    def field_problems(self, config: dict[str, Any]) -> list[str]:
        return field_problems(config)

    def layout_problems(self, config: dict[str, Any], *, layout: str) -> list[str]:
        return lattice_problems(config) if layout == "zlab" else []

    def needs_rope_theta(self, config: dict[str, Any]) -> bool:
        # The released DFlash2 configs (written by transformers 5.15) carry the rotary base in
        # rope_parameters alone; one beside it must still agree (dflash writes both).
        return "rope_theta" in config

    def tensor_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(config)

    def unexpected_tensor_reason(self, name: str) -> str | None:
        return unexpected_tensor_reason(name)

    def describes_tensors(self, config: dict[str, Any]) -> bool:
        return describes_tensors(config)

    def reader_limits(self, config: dict[str, Any], *, layout: str) -> list[str]:
        if layout != "speculators":
            return []  # llama.cpp's limit is a contract rule in the z-lab layout (lattice_problems)
        return [
            "the speculators layout of a DFlash2 drafter: vLLM serves it; SGLang and llama.cpp's converter read "
            "the z-lab layout (dflash export convert DIR DST --layout zlab --target TARGET)"
        ] + reader_limits(config)

    def speculators_problems(self, config: dict[str, Any]) -> list[str]:
        return speculators_problems(config)

    def speculators_fields(self, zlab: dict[str, Any]) -> dict[str, Any]:
        return speculators_fields(zlab)

    def zlab_from_speculators(self, config: dict[str, Any], zlab: dict[str, Any]) -> None:
        zlab["dflash_config"].update(zlab_fields(config))

    def speculators_serving_problems(self, config: dict[str, Any]) -> list[str]:
        return speculators_serving_problems(config)
