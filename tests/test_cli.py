"""The `dflash` command: one front door to every command (the old dflash-* names stay, and say the
same), its help and version, and a mistake in the overrides — Hydra's composition errors
included — refused in one line that names the key, with exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash import __version__
from dflash.cli import COMMANDS, HYDRA_COMMANDS
from tests.conftest import SLOW_MACHINE_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent


def dflash(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m dflash ARGS` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "dflash", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )


def test_every_old_command_name_is_a_dflash_command_running_the_same_function():
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    pairs = (line.split(" = ") for line in section.splitlines() if " = " in line and not line.startswith("#"))
    scripts = {name.strip(): target.strip().strip('"') for name, target in pairs}
    assert scripts.pop("dflash") == "dflash.cli:main"
    assert scripts == {
        f"dflash-{name}": f"{module}:main"
        for name, (module, _) in COMMANDS.items()
        if f"dflash-{name}" in scripts
    }
    assert len(scripts) == 8  # train, eval, regen, prep, export, report, diff, schedule kept their names


def test_version_and_help_name_dflash_and_every_command():
    version = dflash("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"dflash {__version__}"
    listing = dflash("--help")
    assert listing.returncode == 0
    for name in COMMANDS:
        assert f"\n  {name} " in listing.stdout, name
    unknown = dflash("trian")
    assert unknown.returncode == 2 and "did you mean train?" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", HYDRA_COMMANDS)
def test_a_hydra_commands_help_lists_each_group_with_its_options_and_no_schema(command):
    result = dflash(command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"usage: dflash {command} ")
    assert "_schema" not in text and "schema/" not in text
    assert "  target " in text and "tiny*" in text  # each group with its options, the default marked
    if command != "regen":
        assert "  scheduler       interleave*, shuffle" in text
        assert "  noise           feature, mask_ramp, none*" in text
    assert "common overrides:" in text and "docs/quickstart.md" in text
    assert text.rstrip().endswith(f"dflash {__version__}")
    assert dflash(command, "--version").stdout.strip() == f"dflash {__version__}"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "loss.gamm=5",
            "unknown config key 'loss.gamm': no dflash setting reads it; did you mean loss.gamma?",
        ),
        (
            "scheduler=shufle",
            "scheduler=shufle: no such option (options: interleave, shuffle); did you mean scheduler=shuffle?",
        ),
        ("optimizer.lr=abc", "optimizer.lr: Value 'abc' of type 'str' could not be converted to Float"),
        # A component's schema is not an option of its group.
        (
            "scheduler=interleave_schema",
            "scheduler=interleave_schema: no such option (options: interleave, shuffle)",
        ),
        (
            "+loss.gamm=5",
            "unknown config key 'loss.gamm': no dflash setting reads it; did you mean loss.gamma?",
        ),
    ],
)
def test_a_typo_in_the_overrides_is_one_line_naming_the_key_and_exits_2(override, says, tmp_path):
    result = dflash("train", override, "debug=fast", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash"), result.stderr
    assert says in lines[0]
    assert "+loss.gamm" not in lines[0] or override.startswith("+")  # never invites the + form
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything trained


def test_a_regen_typo_is_refused_the_same_way():
    result = dflash("regen", "input=[a.jsonl]", "output=b.jsonl", "sampling.temprature=1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "dflash regen: error: unknown config key 'sampling.temprature': no dflash setting reads it; "
        "did you mean sampling.temperature?"
    )


def complete(line: str, bin_dir: Path) -> list[str]:
    """What `eval "$(dflash completion bash)"` offers for `line` (the cursor at its end), in bash,
    with `dflash` on PATH as a user's install has it."""
    script = dflash("completion", "bash")
    assert script.returncode == 0, script.stderr
    words = line.split(" ")
    program = bin_dir / "dflash"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} -m dflash "$@"\n')
    program.chmod(0o755)
    driver = (
        f"{script.stdout}\n"
        f"COMP_LINE='{line}'; COMP_POINT={len(line)}; COMP_CWORD={len(words) - 1}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)})\n"
        '_dflash_complete; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(bin_dir)}
    result = subprocess.run(
        ["bash", "-c", driver], capture_output=True, text=True, env=env, timeout=SLOW_MACHINE_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_shell_completion_offers_commands_then_each_hydra_commands_groups_and_options(tmp_path):
    """`dflash tr<TAB>` -> train; `dflash train sched<TAB>` -> the group; `scheduler=<TAB>` -> its
    options, never a schema node; the same through another Hydra command."""
    assert complete("dflash tr", tmp_path) == ["train"]
    assert "scheduler=" in complete("dflash train sched", tmp_path)
    assert complete("dflash train debug=fast scheduler=", tmp_path) == [
        "scheduler=interleave",
        "scheduler=shuffle",
    ]
    assert complete("dflash train noise=", tmp_path) == ["noise=feature", "noise=mask_ramp", "noise=none"]
    gpus = complete("dflash eval gpu=", tmp_path)
    assert "gpu=cpu" in gpus and not [word for word in gpus if "schema" in word]
