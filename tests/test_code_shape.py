"""The package's shape: no module over 600 lines, and the functions over 80 lines are a known,
shrinking list (the goal is at most 3). A long function holds several jobs that each want a
name; a new one, or a listed one grown longer, fails here instead of in review."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# The functions still over MAX_FUNCTION_LINES, with their length today as a ceiling: each may only
# shrink, and its entry goes once it is cut by job (a stale entry fails nothing, so that parts cut
# elsewhere merge cleanly; delete it then). At most 3 may stay for good.
LONG_FUNCTIONS: dict[str, int] = {}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def function_lengths(path: Path, root: Path = PACKAGE.parent) -> dict[str, int]:
    """Every function's and method's length in lines (its `def` line to its last, decorators
    left out), nested ones included, by `path:name` (path relative to `root`)."""
    where = path.relative_to(root).as_posix()
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            key = f"{where}:{node.name}"
            found[key] = max(length, found.get(key, 0))
    return found


def test_no_module_is_over_600_lines():
    long = {
        path.relative_to(PACKAGE.parent).as_posix(): lines
        for path in modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_long_functions_are_the_known_ones_and_do_not_grow():
    lengths = {key: n for path in modules() for key, n in function_lengths(path).items()}
    long = {key: n for key, n in lengths.items() if n > MAX_FUNCTION_LINES}
    new = sorted(set(long) - set(LONG_FUNCTIONS))
    assert not new, (
        f"functions over {MAX_FUNCTION_LINES} lines (cut them by job): {[(k, long[k]) for k in new]}"
    )
    grown = {key: (LONG_FUNCTIONS[key], n) for key, n in long.items() if n > LONG_FUNCTIONS[key]}
    assert not grown, f"listed long functions grew (listed, now): {grown}"


def test_function_lengths_count_nested_functions_and_methods(tmp_path):
    """The measure itself: a nested function and a method are each measured, by their own lines."""
    package = tmp_path / "dflash"
    package.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "shape.py").write_text(
        f"class A:\n    def method(self):\n{body}\n\n\ndef outer():\n    def inner():\n        return 1\n    return inner\n"
    )
    found = function_lengths(package / "shape.py", root=tmp_path)
    assert found == {
        "dflash/shape.py:method": MAX_FUNCTION_LINES + 1,
        "dflash/shape.py:outer": 4,
        "dflash/shape.py:inner": 2,
    }
