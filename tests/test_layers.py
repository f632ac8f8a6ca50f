"""Imports point down: a module may import from its own layer or a lower one, never from a layer
above it (docs/ARCHITECTURE.md §5 draws the same map). The order is written once, here, one
floor per folder.

Every `import dflash...` / `from dflash... import` is checked, function-level ones included (a
deferred import still couples the modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"

# Bottom to top, one floor per folder (a top-level module is its own folder). A module belongs
# to the floor of its longest listed prefix. EXCEPTIONS: modules on another floor than their
# folder's, each with its reason in docs/ARCHITECTURE.md §5 (at most 3).
LAYERS: list[list[str]] = [
    [
        "dflash",  # the package's __init__ alone: its version, no imports
        "dflash.errors",
        "dflash.digest",
        "dflash.stopwatch",
        "dflash.lock",
        "dflash.distributed",
        "dflash.config",
    ],
    ["dflash.torch_runtime"],
    ["dflash.target"],
    ["dflash.drafters"],
    ["dflash.data"],
    ["dflash.step"],
    ["dflash.export"],
    ["dflash.decoding"],
    ["dflash.eval"],
    ["dflash.serving"],
    ["dflash.regen"],
    ["dflash.pipeline"],
    ["dflash.monitor"],
    ["dflash.trainer"],
    ["dflash.run"],
    ["dflash.train", "dflash.tools"],
    ["dflash.cli", "dflash.__main__", "dflash.completion"],
]
EXCEPTIONS: list[str] = []


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            # "dflash" itself names only the package's __init__, not every module under it.
            covers = module == prefix or (prefix != "dflash" and module.startswith(prefix + "."))
            if covers and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it")
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dflash"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("dflash")]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of(module_name(path))


def upward_imports(path: Path, module: str) -> list[str]:
    """`file:line: imports X` for every import of `path` (as module `module`) from a higher layer."""
    own = layer_of(module)
    return [
        f"{path.name}:{line}: imports {target} (layer {layer_of(target)} > {own})"
        for line, target in imports_of(path)
        if layer_of(target) > own
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down(path):
    upward = upward_imports(path, module_name(path))
    assert not upward, "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check above can fail: the target floor's model.py with a deferred import of the
    trainer added is reported, at that line; unchanged it is clean."""
    original = PACKAGE / "target" / "model.py"
    probe = tmp_path / "model.py"
    source = original.read_text()
    probe.write_text(source + "\n\ndef later():\n    from dflash.trainer.sync import SyncTrainer\n")
    assert upward_imports(original, "dflash.target.model") == []
    line = source.count("\n") + 4
    assert upward_imports(probe, "dflash.target.model") == [
        f"model.py:{line}: imports dflash.trainer.sync (layer {layer_of('dflash.trainer')} > {layer_of('dflash.target')})"
    ]


def test_floors_follow_folders():
    """Every floor lists whole folders (or top-level modules); a module on another floor than its
    folder's is one of at most 3 EXCEPTIONS, each explained in docs/ARCHITECTURE.md §5."""
    split = [prefix for floor in LAYERS for prefix in floor if prefix.count(".") > 1]
    assert sorted(split) == sorted(EXCEPTIONS) and len(EXCEPTIONS) <= 3
    package_map = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text().split("## §5", 1)[1]
    for module in EXCEPTIONS:
        assert module.replace(".", "/").removeprefix("dflash/") in package_map, module
