"""What export, convert, `dflash export check`, serving and the warm start ask about a drafter
variant, and the shape of a layout (a reader's on-disk format). A variant's answers are one
`VariantExport` subclass beside its layout code (DSpark's in dflash/export/deepspec.py, DFlash2's
in dflash/export/dflash2_rules.py), registered once (dflash/export/export_registry.py `register_export`);
the consumers ask the registered object, never test a config or a class for a variant.

`VariantExport` itself holds the DFlash backbone's answers: a variant overrides only what its
readers read differently. The readers' formats are written once, in the layouts' modules
(zlab.py, speculators.py, deepspec.py); a variant's object fills in its names, fields, tensors
and refusals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from dflash.drafters.backbone import DFlashDrafter

Config = dict[str, Any]


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _no_problems(config: Config) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One reader's on-disk format of a drafter directory. Configs inside dflash are in the
    z-lab form; a layout converts to and from it."""

    name: str
    # Whether a raw config.json is in this layout (the z-lab layout: anything the others are not).
    recognises: Callable[[Config], bool]
    # What keeps a raw config.json in this layout from being read (before `to_zlab`).
    problems: Callable[[Config], list[str]]
    to_zlab: Callable[[Config], Config]
    # The layout's config.json from a z-lab-form one: (zlab, spec=VariantExport, verifier=...).
    from_zlab: Callable[..., Config]
    # How a config of this layout is called in a read error ("a speculators config").
    described: str
    # The target's tables the layout may hold beside the drafter's tensors ([vocab, hidden]);
    # the run's target provides them, so reading leaves them out.
    bundled: tuple[str, ...] = ()
    # Why the layout must hold them (None: it may): convert refuses to write it without a target.
    tables_required: str | None = None
    # Whether it records the target's depth (num_target_layers).
    records_depth: bool = True
    # What the layout's serving readers read beyond dflash (a raw config that `problems` passes).
    serving_problems: Callable[[Config], list[str]] = _no_problems
    # The drafter's own tensors of a model.safetensors in this layout, (path, raw config) ->
    # {name: tensor} (None: every tensor but the bundled tables).
    read_state: Callable[[Path, Config], dict[str, torch.Tensor]] | None = None


# z-lab top-level fields that the speculators layout keeps outside transformer_layer_config.
DFLASH_FIELDS = ("architectures", "block_size", "num_target_layers", "dflash_config", "num_anchors")


class VariantExport:
    """One drafter variant's export rules, reader by reader; this class answers for the DFlash
    backbone. `drafter` is the registered drafter class (dflash/drafters/drafter_registry.py): its
    `native_layout` is the layout its checkpoints are written in, `other_layouts` the ones
    `dflash export convert` also writes. Configs are z-lab-form dicts unless a name says
    otherwise."""

    drafter: ClassVar[type[DFlashDrafter]] = DFlashDrafter
    other_layouts: ClassVar[tuple[str, ...]] = ("speculators",)
    # The z-lab layout's `architectures` (SGLang and vLLM pick the drafter class by it).
    zlab_architecture: ClassVar[str] = "DFlashDraftModel"
    # The speculators layout: speculators_model_type, the class speculators saves the drafter
    # as, its config's defaults for fields a config.json leaves out, the z-lab top-level fields
    # kept outside transformer_layer_config, and why a wrong class misleads its readers.
    speculators_type: ClassVar[str | None] = "dflash"
    speculators_architecture: ClassVar[str | None] = "DFlashDraftModel"
    speculators_defaults: ClassVar[Config] = {}
    speculators_top_fields: ClassVar[tuple[str, ...]] = DFLASH_FIELDS
    speculators_class_reason: ClassVar[str] = "the class speculators builds and vLLM maps"
    # llama-server's --spec-type for the drafter (dflash/serving/llamacpp.py); None: llama.cpp
    # has no loader for the variant, and `dflash served` refuses it before converting anything.
    llama_cpp_spec_type: ClassVar[str | None] = "draft-dflash"
    # Config fields beyond the backbone's sizes that the tensors' shapes read.
    size_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def variant(self) -> str:
        return self.drafter.variant_name

    @property
    def layouts(self) -> tuple[str, ...]:
        """Every layout the variant writes, its native one first."""
        return (self.drafter.native_layout, *self.other_layouts)

    def describes(self, config: Config) -> bool:
        """Whether a z-lab-form config is this variant's (by default: its drafter class's rule)."""
        return self.drafter.describes(SimpleNamespace(**config))

    def field_problems(self, config: Config) -> list[str]:
        """The variant's fields, as every reader (dflash's loader among them) needs them."""
        return []

    def layout_problems(self, config: Config, *, layout: str) -> list[str]:
        """The variant's rules of one layout's readers, beyond `field_problems`."""
        return []

    def needs_rope_theta(self, config: Config) -> bool:
        """Whether the z-lab layout must carry `rope_theta` (transformers 4.57's rotary base)."""
        return True

    def tensor_shapes(self, config: Config) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of the parts the variant adds to the backbone."""
        return {}

    def own_tensors(self, config: Config, found: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Tensors of `found` (name -> shape) that belong to a part of the user's own, whose
        names and shapes no reader's rule describes."""
        return {}

    def unexpected_tensor_reason(self, name: str) -> str | None:
        """Why the variant's readers misread a tensor the contract does not list, where known."""
        return None

    def describes_tensors(self, config: Config) -> bool:
        """Whether the added parts' tensor shapes follow from this config."""
        return True

    def reader_limits(self, config: Config, *, layout: str) -> list[str]:
        """Readers that refuse a well-formed drafter of this config in `layout`, one line each."""
        return []

    def speculators_problems(self, config: Config) -> list[str]:
        """What keeps a raw speculators config (defaults filled in) from being this variant's
        drafter as speculators trained it."""
        return []

    def speculators_fields(self, zlab: Config) -> Config:
        """The speculators config's own fields of this variant (ValueError: it cannot be written)."""
        return {}

    def zlab_from_speculators(self, config: Config, zlab: Config) -> None:
        """Add the variant's fields of a raw speculators config (defaults filled in) to the
        z-lab config converted from it (in place)."""

    def speculators_serving_problems(self, config: Config) -> list[str]:
        """What vLLM's speculators path needs from a raw config beyond every variant's rules."""
        return []
