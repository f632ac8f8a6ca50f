"""Imports point down: a module may import from its own layer or a lower one, never from a layer
above it (docs/ARCHITECTURE.md §5 draws the same map). The order is written once, here.

Every `import dflash...` / `from dflash... import` is checked, function-level ones included (a
deferred import still couples the modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"

# Bottom to top. A module belongs to the layer of its longest listed prefix.
LAYERS: list[list[str]] = [
    # "dflash" is the package's __init__ alone (its version; it imports nothing).
    ["dflash", "dflash.errors", "dflash.digest", "dflash.config", "dflash.step.variants", "dflash.stopwatch"],
    ["dflash.models"],
    ["dflash.data"],
    [
        "dflash.step.blocks",
        "dflash.step.block_mask",
        "dflash.step.loss",
        "dflash.step.noise",
        "dflash.export",
        "dflash.distributed",
        "dflash.sync_detector",
        "dflash.run.lock",
        "dflash.decoding.reference",
        "dflash.run.checks",
    ],
    ["dflash.decoding", "dflash.eval", "dflash.regen", "dflash.run.inputs"],
    ["dflash.step", "dflash.trainer.cadence", "dflash.trainer.checkpoint"],
    ["dflash.pipeline"],
    ["dflash.monitor"],
    ["dflash.trainer"],
    ["dflash.run.runner"],
    ["dflash.run"],
    ["dflash.train", "dflash.tools"],
    ["dflash.cli", "dflash.__main__"],
]


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
    """The check above can fail: the model layer's target.py with a deferred import of the
    trainer added is reported, at that line; unchanged it is clean."""
    original = PACKAGE / "models" / "target.py"
    probe = tmp_path / "target.py"
    source = original.read_text()
    probe.write_text(source + "\n\ndef later():\n    from dflash.trainer.sync import SyncTrainer\n")
    assert upward_imports(original, "dflash.models.target") == []
    line = source.count("\n") + 4
    assert upward_imports(probe, "dflash.models.target") == [
        f"target.py:{line}: imports dflash.trainer.sync (layer {layer_of('dflash.trainer')} > 1)"
    ]
