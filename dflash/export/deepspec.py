"""The DSpark drafter directory in DeepSpec's layout (deepseek-ai/DeepSpec: what its trainer
saves and its released `dspark_*` checkpoints hold), which SGLang, vLLM and llama.cpp's
converter read: written for every DSpark checkpoint, read back wherever dflash reads a drafter.

What differs from the z-lab DFlash layout (docs/EXPORT.md, "DSpark"):
- `architectures: ["Qwen3DSparkModel"]` (the class each reader builds);
- `mask_token_id`, `target_layer_ids` (decoder-layer ids, as the z-lab ones), `num_anchors` at
  the top level; dflash keeps `dflash_config` beside them with the same values, for readers that
  look there first;
- the heads' fields `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov`, and their tensors (`markov_head.*`, `confidence_head.proj.*`);
- the weights may bundle the target's `embed_tokens.weight` and `lm_head.weight` (DeepSpec's own
  loader reads them from the drafter directory; the engines take the target's and skip them).

A drafter's config inside dflash is the z-lab one plus the heads' fields; `to_deepspec` and
`from_deepspec` convert between the two forms.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dflash.drafters.dspark import MARKOV_HEAD_TYPES, DSparkDrafter, markov_head_class
from dflash.export.rules import DFLASH_FIELDS, Layout, VariantExport

DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"  # deepspec/modeling/dspark/qwen3/config.py
# The heads' config.json keys, the reference's names (deepspec/modeling/dspark/qwen3/modeling.py).
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# The target's tables, [vocab, hidden]: DeepSpec's own loader takes both from the drafter
# directory (the engines take the target's), so a directory for it bundles them.
BUNDLED_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# DSparkSpeculatorConfig's defaults (speculators/models/dspark/config.py): a field it left out
# of config.json reads as these.
SPECULATORS_DEFAULTS = {
    "sample_from_anchor": True,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def is_deepspec(config: dict[str, Any]) -> bool:
    return config.get("architectures") == [DEEPSPEC_ARCHITECTURE]


def _top_or_nested(config: dict[str, Any], key: str) -> Any:
    return config.get(key, (config.get("dflash_config") or {}).get(key))


def head_problems(config: dict[str, Any]) -> list[str]:
    """The heads' fields: what the reference's loader asserts, and what a reader would build
    differently from what was trained."""
    problems = []
    rank = config.get("markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return [f"markov_rank is {rank!r}: an integer >= 0 is needed"]
    head_type = config.get("markov_head_type")
    if rank > 0 and (not isinstance(head_type, str) or not head_type):
        problems.append(
            f"markov_head_type is {head_type!r}: {', '.join(MARKOV_HEAD_TYPES)} (or the import path of a "
            "head class of your own) is needed; SGLang refuses a Markov head without it"
        )
    elif rank > 0:
        try:
            markov_head_class(head_type)  # the class the drafter is built with (dflash eval, convert)
        except ValueError as exc:
            problems.append(str(exc))
    enabled = config.get("enable_confidence_head")
    if not isinstance(enabled, bool):
        problems.append(f"enable_confidence_head is {enabled!r}: true or false is needed")
    with_markov = config.get("confidence_head_with_markov")
    if enabled and not isinstance(with_markov, bool):
        # vLLM reads a missing key as false, SGLang as markov_rank > 0: another input width.
        problems.append(
            f"confidence_head_with_markov is {with_markov!r}: true or false is needed with a "
            "confidence head (vLLM reads it missing as false, SGLang as markov_rank > 0)"
        )
    elif enabled and with_markov and rank == 0:
        problems.append("confidence_head_with_markov is true without a Markov head (markov_rank 0)")
    if config.get("sample_from_anchor", True) is not True:
        problems.append(
            "sample_from_anchor is false: block slot 0 would be the bonus token, not a prediction; "
            "dflash's DSpark (and DeepSpec's) predicts token a + k + 1 at every slot k"
        )
    return problems


def deepspec_problems(config: dict[str, Any]) -> list[str]:
    """What keeps a config.json from being a DSpark drafter in DeepSpec's layout."""
    problems = []
    if config.get("architectures") != [DEEPSPEC_ARCHITECTURE]:
        problems.append(
            f"architectures is {config.get('architectures')!r}, not [{DEEPSPEC_ARCHITECTURE!r}] "
            "(SGLang, vLLM and llama.cpp's converter pick the DSpark drafter class by it)"
        )
    nested = config.get("dflash_config") or {}
    for key in ("mask_token_id", "target_layer_ids"):
        if config.get(key) is None:
            problems.append(f"{key} is missing at the top level (DeepSpec's loader asserts it)")
        elif key in nested and nested[key] != config[key]:
            problems.append(f"{key} {config[key]!r} differs from dflash_config.{key} {nested[key]!r}")
    anchors = config.get("num_anchors")
    if not isinstance(anchors, int) or anchors <= 0:
        problems.append(f"num_anchors is {anchors!r}: DeepSpec's loader asserts a positive integer")
    return problems + head_problems(config)


def from_deepspec(config: dict[str, Any]) -> dict[str, Any]:
    """The in-memory (z-lab + heads) form of a DeepSpec-layout config (deepspec_problems == [])."""
    zlab = {key: value for key, value in config.items() if key not in ("mask_token_id", "target_layer_ids")}
    zlab["architectures"] = ["DFlashDraftModel"]
    zlab["dflash_config"] = {
        "mask_token_id": config["mask_token_id"],
        "target_layer_ids": list(config["target_layer_ids"]),
    }
    return zlab


def to_deepspec(zlab: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpec-layout config.json of an in-memory DSpark drafter config."""
    config = dict(zlab)
    config["architectures"] = [DEEPSPEC_ARCHITECTURE]
    for key in ("mask_token_id", "target_layer_ids"):
        config[key] = _top_or_nested(zlab, key)
    return config


def own_head(config: dict[str, Any]) -> bool:
    """A Markov head class of the user's own (`markov_head_type` an import path): dflash builds
    it, no engine does, and which tensors it holds is its own business."""
    return config.get("markov_rank", 0) > 0 and config.get("markov_head_type") not in MARKOV_HEAD_TYPES


def head_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the heads a DSpark config describes (the reference's modules:
    markov_w1 = Embedding(V, r), markov_w2 = Linear(r, V, bias=False), gate_proj = Linear(H + r, r),
    joint_proj = Linear(2r + H, 3r), confidence proj = Linear(H (+ r), 1)); a head of the user's
    own is left out (`own_head`)."""
    vocab, hidden, rank = config["vocab_size"], config["hidden_size"], config["markov_rank"]
    shapes: dict[str, tuple[int, ...]] = {}
    if rank > 0 and not own_head(config):
        shapes["markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (vocab, rank)
        if config.get("markov_head_type") == "gated":
            shapes["markov_head.gate_proj.weight"] = (rank, hidden + rank)
            shapes["markov_head.gate_proj.bias"] = (rank,)
        elif config.get("markov_head_type") == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
            shapes["markov_head.joint_proj.bias"] = (3 * rank,)
    if config.get("enable_confidence_head"):
        width = hidden + (rank if config.get("confidence_head_with_markov") else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def reader_limits(config: dict[str, Any]) -> list[str]:
    """Readers that refuse (loudly) a DSpark drafter of this config, one line each: not contract
    problems (the drafter is well formed), but which engine cannot serve it."""
    limits = []
    rank, head_type = config.get("markov_rank", 0), config.get("markov_head_type")
    if rank == 0:
        limits.append(
            "markov_rank 0: SGLang and llama.cpp refuse a DSpark drafter without a Markov head (vLLM "
            "builds its head from markov_rank whatever it is; a rank of 0 there is untried)"
        )
    elif own_head(config):
        limits.append(
            f"markov_head_type {head_type}: a head class of your own; dflash reads it, no engine builds it"
        )
    elif head_type != "vanilla":
        limits.append(
            f"markov_head_type {head_type}: vLLM and llama.cpp build the vanilla head only (SGLang and "
            "DeepSpec build it)"
        )
    if config.get("enable_confidence_head") and not config.get("confidence_head_with_markov"):
        limits.append(
            "a confidence head without the Markov embedding: llama.cpp's loader expects its input "
            "to be hidden + markov_rank wide and refuses the directory"
        )
    return limits


def _to_deepspec(zlab: dict[str, Any], **_: Any) -> dict[str, Any]:
    return to_deepspec(zlab)


DEEPSPEC = Layout(
    name="deepspec",
    recognises=is_deepspec,
    problems=deepspec_problems,
    to_zlab=from_deepspec,
    from_zlab=_to_deepspec,
    described="a DSpark config",
    bundled=BUNDLED_TENSORS,
)


class DSparkExport(VariantExport):
    """A DSpark drafter's export rules: DeepSpec's layout natively, speculators' `dspark`
    (speculators/models/dspark/config.py): the DFlash speculators config plus `sample_from_anchor`
    (true: every block slot predicts, block_size proposals), the heads' fields at the top level
    and their tensors under DeepSpec's names."""

    drafter = DSparkDrafter
    speculators_type: ClassVar[str | None] = "dspark"
    speculators_architecture: ClassVar[str | None] = "DSparkDraftModel"  # the class speculators saves
    speculators_defaults: ClassVar[dict[str, Any]] = SPECULATORS_DEFAULTS
    speculators_top_fields = DFLASH_FIELDS + HEAD_FIELDS + ("mask_token_id", "target_layer_ids")
    llama_cpp_spec_type = "draft-dspark"
    size_fields = ("vocab_size",)  # the heads' shapes are vocabulary-wide

    def tensor_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        return head_tensors(config)

    def own_tensors(
        self, config: dict[str, Any], found: dict[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        if not own_head(config):
            return {}
        return {name: shape for name, shape in found.items() if name.startswith("markov_head.")}

    def reader_limits(self, config: dict[str, Any], *, layout: str) -> list[str]:
        refused = (
            ["the speculators layout of a DSpark drafter: SGLang refuses it (it reads DeepSpec's)"]
            if layout == "speculators"
            else []
        )
        return refused + reader_limits(config)

    def speculators_problems(self, config: dict[str, Any]) -> list[str]:
        return head_problems(config)

    def speculators_fields(self, zlab: dict[str, Any]) -> dict[str, Any]:
        # Every block slot predicts (the anchor's too).
        return {"sample_from_anchor": True, **{key: zlab[key] for key in HEAD_FIELDS}}

    def zlab_from_speculators(self, config: dict[str, Any], zlab: dict[str, Any]) -> None:
        zlab.update({key: config[key] for key in HEAD_FIELDS})
