"""The drafter variants' one registration: a variant's training side (its `DFlashVariant`
subclass, dflash/step/variant.py), its drafter class and its config group option, all under the
variant's name, by one public call.

    from dflash.step.variant_registry import register_variant

    @register_variant
    class MyVariant(DFlashVariant):
        name = "mine"                      # == MyDrafter.variant_name
        drafter_class = MyDrafter          # a DFlashDrafter subclass (dflash/drafters/backbone.py)
        options = MyVariantConfig          # a VariantConfig dataclass, _target_ naming MyVariant
        metric_fields = (...)              # figure_names, figures, summary_key, summary_line, ...

`register_variant` puts the drafter class in the models floor's registry
(dflash/drafters/drafter_registry.py `register_drafter`: decoding, export and resume find it there), the
training class here (the trainer, the metrics, the run summary and the checks ask it), and the
options in `COMPONENT_OPTIONS["variant"]`, so the variant's keys are checked at composition;
a variant with no conf/variant/<name>.yaml gets its schema as the option `variant=<name>`. Two
registries because the models floor may not import the step floor (tests/test_layers.py); one
call, so the two never disagree.

Each name is taken once: a second class under a taken name is refused (the same class again is
a no-op), and nothing is registered unless all of it can be. `registered_variants()` iterates
them in registration order (the built-ins first), so one test runs every entry through training.

The built-ins go through the same call, from the package's one list of them
(dflash/config/variant_schema.py BUILT_IN_VARIANTS): each entry's options name the training class
(`_target_`), whose `drafter_class` must be the one the drafter registry entered from the same
entry, so the list cannot name two halves of different variants.
"""

from __future__ import annotations

import dataclasses
from importlib import resources

from dflash.config.schema import COMPONENT_OPTIONS
from dflash.config.variant_schema import BUILT_IN_VARIANTS, built_in_piece
from dflash.drafters.drafter_registry import register_drafter, registered_drafters
from dflash.step.variant import DFlashVariant

_VARIANTS: dict[str, type[DFlashVariant]] = {}
_CONF_MODULE = "dflash.conf"  # the package's YAML options (dflash/tools/compose.py reads them)


def _refusal(variant_class: type[DFlashVariant]) -> str | None:
    """Why `variant_class` cannot be registered (None: it can)."""
    name = variant_class.name
    drafter_name = variant_class.drafter_class.variant_name
    if drafter_name != name:
        return (
            f"variant {name!r}: its drafter_class {variant_class.drafter_class.__qualname__} is registered "
            f"as {drafter_name!r}; give both the same name"
        )
    for registry, taken, mine in (
        ("variant", _VARIANTS.get(name), variant_class),
        ("drafter variant", registered_drafters().get(name), variant_class.drafter_class),
        ("variant option", COMPONENT_OPTIONS["variant"].get(name), variant_class.options),
    ):
        if taken is not None and taken is not mine:
            return f"{registry} {name!r} is registered already ({taken.__qualname__})"
    if variant_class.summary_key is not None and variant_class.summary_key.split("/", 1)[-1] not in (
        variant_class.figure_names
    ):
        return f"variant {name!r}: its summary_key {variant_class.summary_key!r} is none of its figure_names"
    unreported = [
        figure for figure in variant_class.console_figures if figure not in variant_class.figure_names
    ]
    if unreported:
        return f"variant {name!r}: its console_figures {unreported} are none of its figure_names"
    if variant_class.summary_key is not None and (
        variant_class.summary_line.__func__ is DFlashVariant.summary_line.__func__
    ):
        return f"variant {name!r}: it has a summary_key but no summary_line of its own"
    target = next(
        (f.default for f in dataclasses.fields(variant_class.options) if f.name == "_target_"), None
    )
    if target != f"{variant_class.__module__}.{variant_class.__qualname__}":
        return (
            f"variant {name!r}: its options {variant_class.options.__qualname__} build {target!r}, "
            f"not {variant_class.__module__}.{variant_class.__qualname__}"
        )
    return None


def register_variant(variant_class: type[DFlashVariant]) -> type[DFlashVariant]:
    """Register a variant's training class, its drafter class and its options under its `name`
    (usable as a class decorator); a ValueError, registering nothing, where one is taken."""
    refusal = _refusal(variant_class)
    if refusal is not None:
        raise ValueError(refusal)
    name = variant_class.name
    register_drafter(variant_class.drafter_class)
    _VARIANTS[name] = variant_class
    if name not in COMPONENT_OPTIONS["variant"]:
        COMPONENT_OPTIONS["variant"][name] = variant_class.options
        if not resources.files(_CONF_MODULE).joinpath("variant", f"{name}.yaml").is_file():
            from hydra.core.config_store import ConfigStore

            ConfigStore.instance().store(group="variant", name=name, node=variant_class.options)
    return variant_class


def registered_variants() -> dict[str, type[DFlashVariant]]:
    """Every registered variant's training class by name, in registration order."""
    return dict(_VARIANTS)


def variant_figure_names() -> set[str]:
    """Every registered variant's own figures: the train/ and val/ keys a run may report beside
    DFlash's."""
    return {name for variant in _VARIANTS.values() for name in variant.figure_names}


for _variant in BUILT_IN_VARIANTS:
    # The training class is the one the options build (their `_target_`).
    register_variant(built_in_piece(_variant.options._target_, floor="dflash.step"))
