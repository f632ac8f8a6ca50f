"""The docs against what they describe: every relative link in README.md and docs/ lands on a file
(and heading) and every repository path they name exists; docs/configuration.md's `dflash train`
examples compose, and its table lists exactly the options of every config group."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from dflash.cli import COMMANDS
from dflash.tools.compose import compose_config

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


@pytest.mark.parametrize("name", ["docs/configuration.md"])
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
