"""The drafter variants' export rules and the layouts, each registered once. Export, convert,
`dflash export check`, serving and the warm start find a drafter's rules here by its
`variant_name` (`export_for`), a config's by asking each registered variant whether the config
is its own (`export_for_config`), and a directory's layout by asking each layout
(`layout_of`); none tests for a variant.

The built-in variants' rules and layouts are entered from the package's one list of them
(dflash/config/variant_schema.py BUILT_IN_VARIANTS), each by its import path in this floor; this
module names no variant. A variant of one's own registers a `VariantExport` subclass
(dflash/export/rules.py) with `register_export`, beside its drafter class's `register_drafter`;
a drafter without one is refused at its first export, naming the call that is missing. The
registry refuses a second rule set under a taken name, and can be iterated, so one test runs
every entry through every layout it declares.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from dflash.config.variant_schema import BUILT_IN_VARIANTS, built_in_piece
from dflash.drafters.backbone import DFlashDrafter
from dflash.export import speculators
from dflash.export.rules import Config, Layout, VariantExport

_EXPORTS: dict[str, VariantExport] = {}
_LAYOUTS: dict[str, Layout] = {}


def register_export(spec: VariantExport) -> VariantExport:
    """Register a variant's export rules under its drafter's `variant_name`."""
    taken = _EXPORTS.get(spec.variant)
    if taken is not None and type(taken) is not type(spec):
        raise ValueError(
            f"export rules of {spec.variant!r} are registered already ({type(taken).__qualname__})"
        )
    _EXPORTS[spec.variant] = spec
    return spec


def register_layout(layout: Layout) -> Layout:
    """Register a layout (a reader's format) under its name; the z-lab one stays last (it
    recognises any config the others do not)."""
    taken = _LAYOUTS.get(layout.name)
    if taken is not None and taken is not layout:
        raise ValueError(f"the layout {layout.name!r} is registered already")
    _LAYOUTS[layout.name] = layout
    return layout


def registered_exports() -> dict[str, VariantExport]:
    return dict(_EXPORTS)


def export_for(drafter: DFlashDrafter | type[DFlashDrafter]) -> VariantExport:
    """The export rules registered for a drafter's variant."""
    spec = _EXPORTS.get(drafter.variant_name)
    if spec is None:
        raise ValueError(
            f"the drafter variant {drafter.variant_name!r} registers no export rules: "
            "register them with dflash.export.export_registry.register_export"
        )
    return spec


def export_for_config(config: Config) -> VariantExport:
    """The rules of the variant a z-lab-form config describes, else the backbone's. Each
    variant's rules claim a config by fields no other variant's carries, so at most one claims a
    config dflash writes (tests/test_variant_contract.py); one carrying two variants' fields
    is held to the first registered one's rules."""
    claims = (
        spec for spec in _EXPORTS.values() if spec.drafter is not DFlashDrafter and spec.describes(config)
    )
    return next(claims, _EXPORTS[DFlashDrafter.variant_name])


def speculators_types() -> dict[str, VariantExport]:
    """speculators_model_type -> the variant's rules, for each variant the speculators layout holds."""
    return {
        spec.speculators_type: spec
        for spec in _EXPORTS.values()
        if spec.speculators_type is not None and "speculators" in spec.layouts
    }


def layout_named(name: str) -> Layout:
    return _LAYOUTS[name]


def layout_of(config: Config) -> Layout:
    """The layout a raw config.json is in (the z-lab one when no other recognises it)."""
    others = [layout for name, layout in _LAYOUTS.items() if name != ZLAB.name]
    return next((layout for layout in others if layout.recognises(config)), ZLAB)


def bundled_tables() -> tuple[str, ...]:
    """The target tables any layout may hold beside a drafter's tensors."""
    return tuple(dict.fromkeys(name for layout in _LAYOUTS.values() for name in layout.bundled))


def _zlab_of(config: Config, **_: Any) -> Config:
    return config


def _speculators_of(zlab: Config, *, spec: VariantExport, verifier: dict[str, Any] | None = None) -> Config:
    return speculators.to_speculators(zlab, spec=spec, verifier=verifier)


def _known(function, config: Config):
    return function(config, speculators_types())


ZLAB = Layout(
    name="zlab",
    recognises=lambda config: True,
    problems=lambda config: [],
    to_zlab=_zlab_of,
    from_zlab=_zlab_of,
    described="a z-lab config",
)
SPECULATORS = Layout(
    name="speculators",
    recognises=speculators.is_speculators,
    problems=partial(_known, speculators.speculators_problems),
    to_zlab=partial(_known, speculators.from_speculators),
    from_zlab=_speculators_of,
    described="a speculators config",
    bundled=speculators.BUNDLED_TENSORS,
    # Its loader builds both tables uninitialised and fills them from the verifier only when they
    # read as NaN, which memory transformers leaves uninitialised does not: a directory without
    # them drafts from garbage tables without an error.
    tables_required=(
        "speculators' loader reads the target's embedding and LM head from the drafter directory "
        "(its own save_pretrained writes both)"
    ),
    records_depth=False,
    serving_problems=partial(_known, speculators.serving_problems),
    read_state=speculators.drafter_state,
)

register_layout(SPECULATORS)
for _variant in BUILT_IN_VARIANTS:
    register_export(built_in_piece(_variant.export, floor="dflash.export")())
    for _layout in _variant.layouts:
        register_layout(built_in_piece(_layout, floor="dflash.export"))
register_layout(ZLAB)
