"""Drafter variants are asked, never tested for: outside a variant's own files and the registries,
no code runs `isinstance` on a variant's drafter class or spells a variant's name. A consumer
that branches on the class or the name (a decoder, an exporter, resume) treats a variant it was
not written for as plain DFlash without an error; one that asks the drafter object
(dflash/drafters/backbone.py: `draft_block`, `verify_len`, `native_layout`, ...) or the registry
(dflash/drafters/drafter_registry.py) serves every registered variant alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dflash.config.variant_schema import BUILT_IN_VARIANTS, built_in_piece
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import register_drafter, registered_drafters

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"

# Where variants are listed by name: the one list of the built-ins beside their options
# (BUILT_IN_VARIANTS), and the training side's variant classes (each its own `name`).
REGISTRIES = {
    "step/variant.py",
    "config/variant_schema.py",
}
# The registries a variant enters and the config group's options: each reads BUILT_IN_VARIANTS
# and names no variant's piece, so a built-in is added by one entry there.
LIST_READERS = (
    "drafters/drafter_registry.py",
    "step/variant_registry.py",
    "export/export_registry.py",
    "config/schema.py",
)
# A variant's own files besides those whose name carries the variant's (dspark.py, dspark_loss.py).
OWN_FILES = {"dspark": {"export/deepspec.py"}}
# Still branching on a variant's name, to move onto the variant objects: each entry names what
# is left there. An entry that no longer offends fails the test (the list only shrinks).
NOT_YET_MOVED: set[str] = set()


def variants() -> dict[str, type[DFlashDrafter]]:
    return {name: cls for name, cls in registered_drafters().items() if cls is not DFlashDrafter}


def is_own(relative: str, name: str) -> bool:
    return name in Path(relative).stem or relative in OWN_FILES.get(name, set())


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the tree's docstring nodes (prose may name any variant)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in(text: str) -> list[str]:
    """The variant names a string spells as words (`dspark`, `variant=dspark`, an f-string's
    `dspark   ce ...`), not inside a longer name, a dotted path (`dflash.drafters.dspark`) or another
    program's hyphenated word (llama.cpp's `draft-dspark`)."""
    return [name for name in variants() if re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w./-])", text)]


def offences(source: str, relative: str) -> list[str]:
    """What the module at `relative` (under dflash/) does that only a variant's own files and the
    registries may: an `isinstance`/`issubclass` on a variant's drafter class, or a variant's
    name as a string."""
    if relative in REGISTRIES:
        return []
    found = []
    classes = {cls.__name__: name for name, cls in variants().items()}
    tree = ast.parse(source, filename=relative)
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            for name in names_in(node.value):
                if not is_own(relative, name):
                    found.append(f"{relative}:{node.lineno}: the variant name {name!r}")
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


def figure_homes(name: str) -> set[str]:
    """The modules (relative to dflash/) that define a variant's drafter class, its bases past
    the backbone and its round tally: where its per-round figures are recorded and read."""
    drafter = variants()[name]
    classes = [cls for cls in drafter.__mro__ if cls.__module__.startswith("dflash.")]
    if drafter.round_tally is not None:
        classes.append(drafter.round_tally)
    return {cls.__module__.removeprefix("dflash.").replace(".", "/") + ".py" for cls in classes}


def figure_offences(source: str, relative: str, figures: dict[str, set[str]]) -> list[str]:
    """Where the module at `relative` reads or spells a variant's per-round figure (`figures`:
    figure name -> the variants recording it), as a string or an attribute, outside those
    variants' own files and the modules that record and tally it: shared code that knows a
    variant's figures."""
    found = []
    for node in ast.walk(ast.parse(source, filename=relative)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelled = node.value
        elif isinstance(node, ast.Attribute):
            spelled = node.attr
        else:
            continue
        owners = figures.get(spelled, set())
        if owners and not any(is_own(relative, owner) or relative in figure_homes(owner) for owner in owners):
            found.append(f"{relative}:{node.lineno}: the round figure {spelled!r} of {sorted(owners)}")
    return found


def package_offences(scan, names: dict[str, set[str]]) -> list[str]:
    """What `scan` finds in every module of the package outside the registries."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative not in REGISTRIES:
            found += scan(path.read_text(), relative, names)
    return found


def test_no_variants_round_figure_is_read_outside_the_variant():
    """The decoders carry, the journal keeps and the evaluation tallies a variant's per-round
    figures by asking the drafter (`add_round_figures`, `round_tally`): none of them spells one."""
    from tests.test_variant_contract import MarginDrafter  # registers a variant defined outside dflash/

    figures: dict[str, set[str]] = {}
    for name, drafter in variants().items():
        for figure in getattr(drafter.round_tally, "figures", ()):
            figures.setdefault(figure, set()).add(name)
    assert {"confidence", "selector_changed", *MarginDrafter.round_tally.figures} <= set(figures)
    found = package_offences(figure_offences, figures)
    assert not found, found
    # The scan itself: a decoder appending a figure, a tally reading one by its string.
    probe = 'def probe(result, extra):\n    result.confidence.append(extra)\n    return result.round_figures["selector_changed"]\n'
    assert len(figure_offences(probe, "decoding/reference.py", figures)) == 2


def reported_figures() -> dict[str, set[str]]:
    """Each field a registered variant's round tally reports (`reports`): name -> the variants."""
    reported: dict[str, set[str]] = {}
    for name, drafter in variants().items():
        for field in getattr(drafter.round_tally, "reports", ()):
            reported.setdefault(field, set()).add(name)
    return reported


def eval_figure_offences(source: str, relative: str, reported: dict[str, set[str]]) -> list[str]:
    """Where the module at `relative` spells a variant's evaluation figure (`reported`: field
    name -> the variants whose tally reports it), as a word of a string (a metric pattern, a
    lookup) or an attribute, outside those variants' own files and their tallies' modules."""
    found = []
    tree = ast.parse(source, filename=relative)
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            spelled = [
                field for field in reported if re.search(rf"(?<!\w){re.escape(field)}(?!\w)", node.value)
            ]
        elif isinstance(node, ast.Attribute):
            spelled = [node.attr] if node.attr in reported else []
        else:
            continue
        for field in spelled:
            owners = reported[field]
            if not any(is_own(relative, owner) or relative in figure_homes(owner) for owner in owners):
                found.append(f"{relative}:{node.lineno}: the evaluation figure {field!r} of {sorted(owners)}")
    return found


def test_no_variants_evaluation_figure_is_named_outside_the_variant():
    """The checks take a tally's fields as `objective=` and the evaluation table prints them by
    asking the registered drafters' tallies (`reports`, `table_lines`): no shared module (the
    report, the objective's patterns) spells one. The result's fields of the built-ins' names,
    declared for the output's sake, are the exception (declarations, not spellings)."""
    from tests.test_variant_contract import MarginDrafter  # registers a variant defined outside dflash/

    reported = reported_figures()
    assert {"confidence_tau", "selector_change_frac", *MarginDrafter.round_tally.reports} <= set(reported)
    found = package_offences(eval_figure_offences, reported)
    assert not found, found
    # The scan itself: an objective pattern listing a figure, a table reading one.
    probe = 'PATTERN = r"eval/[^/]+/(tau|confidence_tau)"\ndef line(r):\n    return f"{r.selector_change_frac:.1%}"\n'
    assert len(eval_figure_offences(probe, "run/checks.py", reported)) == 2
    assert eval_figure_offences(probe, "drafters/dspark_tally.py", {"confidence_tau": {"dspark"}}) == []


def test_the_guard_sees_a_type_test_and_a_name():
    """The scan itself: a module testing a variant's class, or naming it, is reported; the
    variant's own files may."""
    probe = 'def probe(d):\n    return isinstance(d, DSparkDrafter) or d.kind == "dflash2"\n'
    found = offences(probe, "decoding/reference.py")
    assert any("isinstance on DSparkDrafter" in line for line in found), found
    assert any("'dflash2'" in line for line in found), found
    assert offences(probe.replace("dflash2", "dspark"), "drafters/dspark.py") == []
    summary_line = 'def line(ce):\n    return f"dspark            ce {ce}"\n'
    assert offences(summary_line, "run/runner.py") == ["run/runner.py:2: the variant name 'dspark'"]
    assert offences('"""How dspark drafts."""\nPATH = "dflash.drafters.dspark"\n', "run/runner.py") == []


def piece_paths(variant) -> tuple[str, ...]:
    return (variant.drafter, variant.export, variant.options._target_, *variant.layouts)


def built_in_pieces() -> set[str]:
    """The names the built-in variants' own pieces go by in code (their classes, layouts and
    modules), the backbone's (the base classes every registry types with) left out."""
    backbone, *others = BUILT_IN_VARIANTS
    shared = {path.rpartition(".")[0].rpartition(".")[2] for path in piece_paths(backbone)}
    names = set()
    for variant in others:
        for path in piece_paths(variant):
            module, _, name = path.rpartition(".")
            names |= {name, module.rpartition(".")[2]}
        names.add(variant.options.__name__)
    return names - shared


def names_used(source: str) -> set[str]:
    """Every identifier a module's code uses: names, attributes, imported modules and names."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used |= set(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            used |= set(node.module.split("."))
    return used


@pytest.mark.parametrize("relative", LIST_READERS)
def test_the_registries_name_no_built_in_variant(relative):
    """Adding a built-in edits BUILT_IN_VARIANTS alone: no registry imports or names a variant's
    class, rules, layout or module (a plug-in's go through the same register_* calls)."""
    named = names_used((PACKAGE / relative).read_text()) & built_in_pieces()
    assert not named, f"{relative} names {sorted(named)}"


def test_the_guard_sees_a_registry_naming_a_built_in():
    pieces = built_in_pieces()
    assert {"DSparkDrafter", "DFlash2Export", "DEEPSPEC", "LiLiCorrVariantConfig", "lilicorr_rules"} <= pieces
    assert not pieces & {"DFlashDrafter", "VariantExport", "DFlashVariant", "variant", "rules"}
    assert names_used("from dflash.export import deepspec\nx = deepspec.DEEPSPEC\n") & pieces == {
        "deepspec",
        "DEEPSPEC",
    }


def test_the_built_in_list_is_what_every_registry_holds():
    """Each entry's name is its drafter's `variant_name` and its training class's `name`, and
    every registry and the config group hold the entries, in the list's order, before any other."""
    from dflash.config.schema import COMPONENT_OPTIONS
    from dflash.export.export_registry import registered_exports
    from dflash.step.variant_registry import registered_variants

    names = [variant.name for variant in BUILT_IN_VARIANTS]
    for registry in (
        registered_drafters(),
        registered_variants(),
        registered_exports(),
        COMPONENT_OPTIONS["variant"],
    ):
        assert list(registry)[: len(names)] == names
    for variant in BUILT_IN_VARIANTS:
        drafter = registered_drafters()[variant.name]
        assert drafter.variant_name == registered_variants()[variant.name].name == variant.name
        assert registered_exports()[variant.name].drafter is drafter
        assert COMPONENT_OPTIONS["variant"][variant.name] is variant.options


def test_a_built_in_piece_is_imported_from_its_registrys_floor_only():
    with pytest.raises(ValueError, match="outside dflash.drafters"):
        built_in_piece("dflash.step.variant.DSparkVariant", floor="dflash.drafters")
    assert built_in_piece("dflash.drafters.backbone.DFlashDrafter", floor="dflash.drafters") is DFlashDrafter


def test_the_registry_refuses_a_second_class_under_a_taken_name():
    class Impostor(DFlashDrafter):
        variant_name = "dspark"

    with pytest.raises(ValueError, match="'dspark' is registered already"):
        register_drafter(Impostor)


def test_the_export_registry_refuses_other_rules_or_a_second_layout_under_a_taken_name():
    """The export side keeps the same promise (docs/extending.md): another class's rules for a
    taken variant, or another layout under a taken name, are refused and the first ones stay;
    the same rules again (a plug-in imported twice) change nothing."""
    import dataclasses

    from dflash.export import export_registry as registry
    from dflash.export.deepspec import DEEPSPEC, DSparkExport

    class ImpostorExport(DSparkExport):
        pass

    before = registry.registered_exports()
    with pytest.raises(ValueError, match=r"export rules of 'dspark' are registered already \(DSparkExport\)"):
        registry.register_export(ImpostorExport())
    registry.register_export(DSparkExport())
    assert registry.registered_exports().keys() == before.keys()
    assert type(registry.registered_exports()["dspark"]) is DSparkExport
    with pytest.raises(ValueError, match="the layout 'deepspec' is registered already"):
        registry.register_layout(dataclasses.replace(DEEPSPEC))
    assert registry.register_layout(DEEPSPEC) is DEEPSPEC and registry.layout_named("deepspec") is DEEPSPEC


def test_each_training_variant_is_a_registered_drafter_variant_and_prints_its_summary_line():
    """The training side's variants (dflash/step/variant.py) go by the registered drafters' names,
    and a run summary holding a variant's figures prints that variant's own line, word for word
    as before the lines moved onto the variants."""
    from dflash.run.runner import format_summary
    from dflash.step.variant_registry import registered_variants

    assert set(registered_variants()) <= set(registered_drafters())
    summary = {"run_dir": "r", "checkpoint": "c", "steps": 3, "wall_s": 1.0, "pipeline": "sync"}
    figures = ("ce", "l1", "confidence_loss", "confidence_abs_error", "tau_prob", "selector_ce")
    figures += (
        "candidate_recall",
        "candidate_mass",
        "selector_changed",
        "unary_tau_decode",
        "oracle_tau_decode",
    )
    summary.update({f"train/{name}": 0.5 for name in figures})
    summary["train/selector_changed_correct"] = float("nan")  # no changed pick: no share printed
    lines = format_summary(summary).splitlines()
    assert (
        "dspark            ce 0.500, l1 0.500, confidence 0.500 (|error| 0.500); "
        "tau from the target's probabilities 0.500"
    ) in lines
    assert (
        "dflash2           unary ce 0.500, selector ce 0.500; candidates recall 0.500, mass 0.500; "
        "selector changed 0.500 of picks; tau_decode unary 0.500, oracle 0.500"
    ) in lines
    plain = {key: value for key, value in summary.items() if not key.startswith("train/")}
    assert not [
        line for line in format_summary(plain).splitlines() if line.startswith(("dspark ", "dflash2 "))
    ]
