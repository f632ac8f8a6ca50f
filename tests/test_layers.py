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
    ["dflash.errors", "dflash.digest", "dflash.config"],
    ["dflash.models"],
    ["dflash.data"],
    [
        "dflash.blocks",
        "dflash.block_mask",
        "dflash.loss",
        "dflash.noise",
        "dflash.checkpoint",
        "dflash.distributed",
        "dflash.sync_detector",
        "dflash.run_lock",
        "dflash.spec_decode",
        "dflash.config_checks",
    ],
    ["dflash.decoding", "dflash.eval_prompts", "dflash.eval_report", "dflash.evaluate", "dflash.regen"],
    ["dflash.step"],
    ["dflash.pipeline"],
    ["dflash.monitor"],
    ["dflash.trainer"],
    ["dflash.run"],
    ["dflash.build", "dflash.callbacks"],
    ["dflash.train", "dflash.tools", "dflash"],
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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down(path):
    module = module_name(path)
    own = layer_of(module)
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target} (layer {layer_of(target)} > {own})"
        for line, target in imports_of(path)
        if layer_of(target) > own
    ]
    assert not upward, "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The test above can fail: a module of the model layer importing the trainer is caught."""
    fake = PACKAGE / "models" / "target.py"
    source = fake.read_text() + "\nfrom dflash.trainer.sync import SyncTrainer\n"
    probe = tmp_path / "target.py"
    probe.write_text(source)
    imported = [target for _, target in imports_of(probe)]
    assert "dflash.trainer.sync" in imported
    assert layer_of("dflash.trainer.sync") > layer_of(module_name(fake))
