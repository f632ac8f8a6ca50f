"""The docs against what they describe: every relative link in README.md and docs/ lands on a file
(and heading) and every repository path they name exists; the README opens with the set-up,
`make train` and `make test` and keeps no timing history; the torch range is one, stated by
pyproject and satisfied by the Makefile's pin and the install commands of the README and the
quickstart; the quickstart's commands run from where it says to run them (a checkout's root);
the README's and docs/configuration.md's `dflash train` examples compose; and
docs/configuration.md's table lists exactly the options of every config group."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from packaging.requirements import Requirement

from dflash.cli import COMMANDS
from dflash.tools.compose import compose_config
from tests.conftest import SLOW_MACHINE_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def prose(text: str) -> str:
    """The text outside code blocks and inline code (where `[x](y)` is an example, not a link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def bash_lines(text: str) -> list[str]:
    """The command lines of a doc's bash blocks: continuations joined, comments and blanks out."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_heading(doc: Path):
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:: not this repository's
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.relative_to(ROOT)}: {target} (no {path})"
        if anchor:
            assert anchor in anchors(path), f"{doc.relative_to(ROOT)}: {target} (no such heading)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_doc_names_exists(doc: Path):
    """Paths under the repository's own folders, in code or prose (`scripts/x.py`, docs/y.md),
    named from the repository's root; a glob names at least one file. (tests/ is left out: the
    docs also name other projects' test fixtures.)"""
    named = re.findall(r"(?<![\w/.~-])((?:scripts|docs|conf|benchmarks)/[\w./*-]*\w)", doc.read_text())
    missing = {path for path in named if not list(ROOT.glob(path))}
    assert not missing, f"{doc.relative_to(ROOT)} names {sorted(missing)}"


def test_every_test_file_has_its_row_in_the_tests_readme_and_every_row_its_file():
    """tests/README.md is where a newcomer finds which file holds a behaviour to; a file
    without a row is found only by grepping, a row without a file sends them nowhere."""
    table = (ROOT / "tests" / "README.md").read_text()
    listed = set(re.findall(r"^\| `(test_\w+\.py)` \|", table, flags=re.MULTILINE))
    present = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert sorted(present - listed) == [], "test files without a row in tests/README.md"
    assert sorted(listed - present) == [], "rows of tests/README.md naming no test file"


def test_the_readme_opens_with_the_setup_and_keeps_no_history():
    """Set-up, `make train` and `make test` on the first screen; short enough to read through; and
    no timing history (a measurement's commit belongs in benchmarks/RESULTS.md)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first_screen = "\n".join(lines[:40])
    assert "make train" in first_screen and "make test" in first_screen and "pip install" in first_screen
    assert len(lines) < 160
    commits = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", prose("\n".join(lines)))
    assert not commits


# -- torch: one range ----------------------------------------------------------------------------


def pyproject_section(name: str) -> str:
    """One table of pyproject.toml, as text (tomllib is Python 3.11+; dflash runs on 3.10)."""
    return (ROOT / "pyproject.toml").read_text().split(f"\n[{name}]\n", 1)[1].split("\n[", 1)[0]


def torch_requirement() -> Requirement:
    dependencies = pyproject_section("project").split("dependencies = [", 1)[1].split("]\n", 1)[0]
    (torch,) = [Requirement(r) for r in re.findall(r'^\s*"(torch\b[^"]*)"', dependencies, re.M)]
    return torch


def make_install_lines(*variables: str) -> list[str]:
    """The commands `make install` would run on a fresh clone (make -n: none of them runs)."""
    dry = subprocess.run(
        ["make", "-n", "-B", "install", *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    return dry.stdout.splitlines()


def torch_specs_named(text: str) -> list[Requirement]:
    """Every torch requirement a doc writes (`torch==2.13.0`, `'torch>=2.11,<2.14'`)."""
    return [Requirement(s.rstrip(",")) for s in re.findall(r"\btorch(?:[<>=!~]=?[\w.*+]+,?)+", text)]


def test_the_makefile_pins_a_torch_inside_the_range_and_can_take_the_cpu_index():
    allowed = torch_requirement().specifier
    (line,) = [line for line in make_install_lines() if "pip install" in line and '"torch' in line]
    pinned = Requirement(shlex.split(line)[-1])
    assert [s.operator for s in pinned.specifier] == ["=="], line
    assert allowed.contains(next(iter(pinned.specifier)).version), f"{line}: outside torch{allowed}"
    cpu_index = "https://download.pytorch.org/whl/cpu"
    (line,) = [line for line in make_install_lines(f"TORCH_INDEX={cpu_index}") if '"torch' in line]
    assert line.endswith(f"--index-url {cpu_index}")


@pytest.mark.parametrize("name", ["README.md", "docs/quickstart.md", "Makefile"])
def test_the_docs_name_the_torch_range_pyproject_states(name: str):
    """A range a doc gives is pyproject's; a pinned release is inside it (docs and packaging
    cannot drift apart)."""
    allowed = torch_requirement().specifier
    named = torch_specs_named((ROOT / name).read_text())
    for requirement in named:
        if [s.operator for s in requirement.specifier] == ["=="]:
            assert allowed.contains(next(iter(requirement.specifier)).version), f"{name}: {requirement}"
        else:
            assert requirement.specifier == allowed, f"{name}: {requirement}, pyproject: torch{allowed}"
    if name == "README.md":  # its CPU install: the range, from PyTorch's CPU index
        cpu = [line for line in bash_lines((ROOT / name).read_text()) if "whl/cpu" in line]
        assert cpu and all(torch_specs_named(line) for line in cpu)


# -- the quickstart's commands ---------------------------------------------------------------------


def quickstart_commands() -> list[list[str]]:
    """The quickstart's bash lines as argument lists, its shell variables ($M, $ID) expanded."""
    variables: dict[str, str] = {}
    commands = []
    for line in bash_lines((ROOT / "docs" / "quickstart.md").read_text()):
        assignment = re.fullmatch(r"(\w+)=(\S+)(?:\s+#.*)?", line)
        if assignment:
            variables[assignment[1]] = assignment[2]
            continue
        expanded = re.sub(r"\$(\w+)", lambda m: variables[m[1]], line)
        commands.append(shlex.split(expanded, comments=True))
    return commands


def test_the_quickstart_commands_run_from_a_checkout_root():
    """Each of the quickstart's commands, run from the repository root as it says: pip's install
    resolves this checkout and its extra (a dry run, nothing fetched), and every dflash command
    composes its config (`--cfg job`: overrides checked, no model loaded)."""
    extras = re.findall(r"^([\w-]+) = \[", pyproject_section("project.optional-dependencies"), re.M)
    ran = []
    for args in quickstart_commands():
        if args[:2] == ["pip", "install"]:
            (spec,) = [a for a in args[2:] if not a.startswith("-")]
            asked = {extra for group in re.findall(r"\[([\w,-]+)\]", spec) for extra in group.split(",")}
            assert asked <= set(extras), spec
            command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps"]
            command += ["--no-build-isolation", *args[2:]]
        elif args[0] == "dflash":
            assert args[1] in COMMANDS, args
            command = [sys.executable, "-m", "dflash", *args[1:], "--cfg", "job"]
        else:
            assert args[:3] == ["python", "-m", "sglang.launch_server"], (
                f"a command this test does not run: {args}"
            )
            continue  # the serving engine: not installed here
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
        )
        assert result.returncode == 0, f"{shlex.join(args)}:\n{result.stdout}{result.stderr}"
        ran.append(args[:2])
    assert ran == [["pip", "install"], ["dflash", "regen"], ["dflash", "prep"], ["dflash", "train"]]


# -- `dflash train` examples and the configuration guide's table ----------------------------------


def train_overrides(args: list[str]) -> list[list[str]]:
    """The configs a `dflash train ARGS` line composes: one per job of a `-m` sweep; Hydra's own
    flags (`--cfg job`, `--info defaults-tree`) left out."""
    overrides = []
    words = iter(args)
    for word in words:
        if word in ("--cfg", "--info"):
            next(words)
        elif word != "-m":
            overrides.append(word)
    parsed = OverridesParser.create().parse_overrides(overrides)
    jobs: list[list[str]] = [[]]
    for override in parsed:
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [None]
        key = override.get_key_element()
        text = [override.input_line] if values == [None] else [f"{key}={value}" for value in values]
        jobs = [job + [choice] for job in jobs for choice in text]
    return jobs


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_the_train_examples_compose(name: str):
    lines = [shlex.split(line, comments=True) for line in bash_lines((ROOT / name).read_text())]
    examples = [args[2:] for args in lines if args[:2] == ["dflash", "train"]]
    assert len(examples) >= 5
    for args in lines:
        if args[0] == "dflash":
            assert args[1] in COMMANDS, args
    for args in examples:
        for overrides in train_overrides(args):
            compose_config(overrides)  # refuses an unknown key, option or type


def test_the_configuration_table_lists_exactly_each_groups_options():
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([\w/]+)` \| ([^|]*) \|", text, re.M)
    conf = ROOT / "conf"
    groups = {
        str(folder.relative_to(conf))
        for folder in conf.rglob("*")
        if folder.is_dir() and list(folder.glob("*.yaml"))
    }
    assert sorted(group for group, _ in rows) == sorted(groups)
    for group, options in rows:
        files = {path.stem for path in (conf / group).glob("*.yaml")}
        assert set(re.findall(r"`(\w+)`", options)) == files, group
