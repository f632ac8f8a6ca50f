"""Drafter variants are asked, never tested for: outside a variant's own files and the registries,
no code runs `isinstance` on a variant's drafter class or spells a variant's name. A consumer
that branches on the class or the name (a decoder, an exporter, resume) treats a variant it was
not written for as plain DFlash without an error; one that asks the drafter object
(dflash/models/drafter.py: `draft_block`, `verify_len`, `native_layout`, ...) or the registry
(dflash/models/variants.py) serves every registered variant alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash.models.drafter import DFlashDrafter
from dflash.models.variants import register_drafter, registered_drafters

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"

# Where variants are listed by name: the drafter registry, the training side's variant classes
# (each its own `name`) and the config group's options.
REGISTRIES = {"models/variants.py", "step/variant.py", "config/schema.py"}
# A variant's own files besides those whose name carries the variant's (dspark.py, dspark_loss.py).
OWN_FILES = {"dspark": {"export/deepspec.py"}}
# Still branching on a variant's name, to move onto the variant objects: each entry names what
# is left there. An entry that no longer offends fails the test (the list only shrinks).
NOT_YET_MOVED = {
    "step/metrics.py",  # _VARIANT_FIELDS and a "position" field's width, by name
    "step/loss.py",  # VARIANT_FIGURES, by name
}


def variants() -> dict[str, type[DFlashDrafter]]:
    return {name: cls for name, cls in registered_drafters().items() if cls is not DFlashDrafter}


def is_own(relative: str, name: str) -> bool:
    return name in Path(relative).stem or relative in OWN_FILES.get(name, set())


def offences(source: str, relative: str) -> list[str]:
    """What the module at `relative` (under dflash/) does that only a variant's own files and the
    registries may: an `isinstance`/`issubclass` on a variant's drafter class, or a variant's
    name as a string."""
    if relative in REGISTRIES:
        return []
    found = []
    classes = {cls.__name__: name for name, cls in variants().items()}
    for node in ast.walk(ast.parse(source, filename=relative)):
        if isinstance(node, ast.Constant) and node.value in variants() and not is_own(relative, node.value):
            found.append(f"{relative}:{node.lineno}: the variant name {node.value!r}")
        is_type_test = isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "isinstance",
            "issubclass",
        )
        if is_type_test and len(node.args) == 2:
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            for class_name in sorted(named & classes.keys()):
                if not is_own(relative, classes[class_name]):
                    found.append(f"{relative}:{node.lineno}: isinstance on {class_name}")
    return found


def test_no_variant_is_found_by_its_type_or_name_outside_its_own_files():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        problems = offences(path.read_text(), relative)
        if problems:
            found[relative] = problems
    unexpected = {relative: problems for relative, problems in found.items() if relative not in NOT_YET_MOVED}
    assert not unexpected, unexpected
    assert set(found) == NOT_YET_MOVED, (
        f"moved already, drop from NOT_YET_MOVED: {NOT_YET_MOVED - set(found)}"
    )


def test_the_guard_sees_a_type_test_and_a_name():
    """The scan itself: a module testing a variant's class, or naming it, is reported; the
    variant's own files may."""
    probe = 'def probe(d):\n    return isinstance(d, DSparkDrafter) or d.kind == "dflash2"\n'
    found = offences(probe, "decoding/reference.py")
    assert any("isinstance on DSparkDrafter" in line for line in found), found
    assert any("'dflash2'" in line for line in found), found
    assert offences(probe.replace("dflash2", "dspark"), "models/dspark.py") == []


def test_the_registry_refuses_a_second_class_under_a_taken_name():
    class Impostor(DFlashDrafter):
        variant_name = "dspark"

    with pytest.raises(ValueError, match="'dspark' is registered already"):
        register_drafter(Impostor)
