"""The `dflash` command: one front door to every command (the old dflash-* names stay, and say the
same: `dflash COMMAND` in usage and errors), its help and version, every example its help shows
accepted, help and completion without torch, shell completion that leaves the shell's settings
alone, and a mistake in the overrides — Hydra's composition errors included — refused in one line
that names the key, with exit 2."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import shutil
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
        # The options column starts past the longest group name (experiment/recipe).
        assert re.search(r"^  scheduler +interleave\*, shuffle$", text, re.M)
        assert re.search(r"^  noise +feature, mask_ramp, none\*$", text, re.M)
    assert "common overrides:" in text and "docs/quickstart.md" in text
    assert text.rstrip().endswith(f"dflash {__version__}")
    assert dflash(command, "--version").stdout.strip() == f"dflash {__version__}"


@pytest.mark.parametrize("command", HYDRA_COMMANDS)
def test_a_hydra_commands_job_is_named_after_the_command(command):
    """Hydra names the job (the run record's job name, the job's `<name>.log`) after the module of
    the function it decorates: each command's job keeps its own name, whoever builds its entry."""
    result = dflash(command, "--cfg", "hydra", "--package", "hydra.job")
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^name: {command}$", result.stdout, re.M), result.stdout


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


def complete(line: str, bin_dir: Path, wordbreaks: str = "\"'><=;|&(:") -> list[str]:
    """What `eval "$(dflash completion bash)"` offers for `line` (the cursor at its end), in bash,
    with `dflash` on PATH as a user's install has it: COMPREPLY, the part of each reply after the
    word's last COMP_WORDBREAKS character (bash's default set unless `wordbreaks` says otherwise),
    which is what bash replaces. The script must leave COMP_WORDBREAKS as it found it."""
    script = dflash("completion", "bash")
    assert script.returncode == 0, script.stderr
    program = bin_dir / "dflash"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} -m dflash "$@"\n')
    program.chmod(0o755)
    driver = (
        f"COMP_WORDBREAKS={shlex.quote(wordbreaks)}\n"
        f"{script.stdout}\n"
        f"COMP_LINE={shlex.quote(line)}; COMP_POINT={len(line)}\n"
        '_dflash_complete; printf "%s\\n" "${COMPREPLY[@]}"\n'
        f'[[ "$COMP_WORDBREAKS" == {shlex.quote(wordbreaks)} ]] || echo "COMP_WORDBREAKS changed" >&2\n'
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(bin_dir)}
    result = subprocess.run(
        ["bash", "-c", driver], capture_output=True, text=True, env=env, timeout=SLOW_MACHINE_TIMEOUT_S
    )
    assert result.returncode == 0 and not result.stderr, result.stderr
    return result.stdout.split()


def test_shell_completion_offers_commands_then_each_hydra_commands_groups_and_options(tmp_path):
    """`dflash tr<TAB>` -> train; `dflash train sched<TAB>` -> the group; `scheduler=<TAB>` -> its
    options, never a schema node; the same through another Hydra command. Bash breaks words at
    `=`, so it replaces what follows it: the replies are the options alone."""
    assert complete("dflash tr", tmp_path) == ["train"]
    assert "scheduler=" in complete("dflash train sched", tmp_path)
    assert complete("dflash train debug=fast scheduler=", tmp_path) == ["interleave", "shuffle"]
    assert complete("dflash train scheduler=sh", tmp_path) == ["shuffle"]
    assert complete("dflash train noise=", tmp_path) == ["feature", "mask_ramp", "none"]
    gpus = complete("dflash eval gpu=", tmp_path)
    assert "cpu" in gpus and not [word for word in gpus if "schema" in word]
    # A shell whose COMP_WORDBREAKS lacks `=` (Hydra's own script removes it) replaces the whole word.
    assert complete("dflash train scheduler=sh", tmp_path, wordbreaks=" \t\n:") == ["scheduler=shuffle"]


def test_shell_completion_offers_a_commands_subcommands_not_the_files_that_match(tmp_path):
    """`dflash export c<TAB>` in a folder holding `conf/`: check and convert."""
    (tmp_path / "conf").mkdir()
    assert complete("dflash export c", tmp_path) == ["check", "convert"]
    assert complete("dflash export con", tmp_path) == ["convert"]
    assert complete("dflash completion ", tmp_path) == ["bash", "zsh"]
    assert complete("dflash export check ", tmp_path) == []  # then the shell's own file names


@pytest.mark.skipif(shutil.which("zsh") is None, reason="no zsh on this machine")
def test_the_zsh_script_runs_the_same_completion_under_zsh(tmp_path):
    """zsh reads the script through bashcompinit and runs the same body; its words break at
    blanks only (no COMP_WORDBREAKS), so a reply is the whole `key=value` word. zsh's compgen
    leaves filtering by the typed prefix to zsh's completion system, so only replies that are
    all of their kind are compared here."""
    script = dflash("completion", "zsh")
    program = tmp_path / "dflash"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} -m dflash "$@"\n')
    program.chmod(0o755)
    driver = (
        f"{script.stdout}\n"
        "for line in 'dflash export c' 'dflash train scheduler='; do\n"
        '  COMP_LINE="$line"; COMP_POINT=${#line}; COMPREPLY=(); _dflash_complete; print -r -- "${COMPREPLY[*]}"\n'
        "done\n"
    )
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        ["zsh", "-c", driver],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert result.stdout.splitlines() == ["check convert", "scheduler=interleave scheduler=shuffle"]


def test_the_subcommands_completed_are_the_commands_own(monkeypatch, capsys):
    from dflash.completion import SUBCOMMANDS, parser

    usage = help_text("export", monkeypatch, capsys).splitlines()[0]
    assert f"{{{','.join(SUBCOMMANDS['export'])}}}" in usage, usage
    assert tuple(parser()._actions[-1].choices) == SUBCOMMANDS["completion"]


# -- one name: `dflash COMMAND` ------------------------------------------------------------------


# A mistake each command refuses at once: (arguments, the start of its one error line).
REFUSALS = {
    "train": (["nosuchkey=1"], "unknown config key 'nosuchkey'"),
    "eval": (["nosuchkey=1"], "unknown config key 'nosuchkey'"),
    "regen": (["nosuchkey=1"], "unknown config key 'nosuchkey'"),
    "prep": (["nosuchkey=1"], "unknown config key 'nosuchkey'"),
    "served": (["nosuchkey=1"], "unknown config key 'nosuchkey'"),
    "export": (["check", "/nonexistent/drafter"], "/nonexistent/drafter: no such directory"),
    "report": (["/nonexistent/run"], "/nonexistent/run/metrics.jsonl not found"),
    "diff": (["/nonexistent/run", "/nonexistent/other"], "/nonexistent/run: no such run directory"),
    "schedule": (["data.max_len=4"], "unknown config key 'data.max_len'"),
    "val": (["ckpt=/nonexistent/drafter"], "ckpt=/nonexistent/drafter: no such drafter directory"),
    "prompts": (["--limit", "many"], "argument --limit: invalid int value: 'many'"),
    "demo": (["/tmp/x", "--arch", "hidden_size=big"], "--arch hidden_size=big: give FIELD=INTEGER"),
    "completion": (["fish"], "argument shell: invalid choice: 'fish'"),
}


def in_process(command: str, args: list[str], *, alias: bool, monkeypatch, capsys) -> tuple[int, str, str]:
    """`dflash COMMAND ARGS`, or `dflash-COMMAND ARGS` as the alias pyproject.toml installs runs it
    (the module's main() under that program name), in this process: (exit code, stdout, stderr).
    For the flag commands, whose modules this process has loaded once (export's loads torch)."""
    from dflash.cli import main

    with monkeypatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        if alias:
            patch.setattr(sys, "argv", [f"/usr/local/bin/dflash-{command}", *args])
            importlib.import_module(COMMANDS[command][0]).main()
        else:
            patch.setattr(sys, "argv", ["dflash"])
            main([command, *args])
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def as_alias(command: str, *args: str) -> subprocess.CompletedProcess:
    """`dflash-COMMAND ARGS` in a process of its own (a Hydra command: Hydra keeps state)."""
    code = (
        f"import sys; sys.argv[0] = '/usr/local/bin/dflash-{command}'; "
        f"from {COMMANDS[command][0]} import main; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
    )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_calls_itself_dflash_command_in_its_usage_and_errors(command, monkeypatch, capsys):
    """`dflash COMMAND` and its alias `dflash-COMMAND` print the same usage and the same error,
    both naming `dflash COMMAND`, the name the docs teach."""
    args, says = REFUSALS[command]
    for alias in (False, True):
        if command in HYDRA_COMMANDS:
            run = as_alias if alias else lambda c, *a: dflash(c, *a)
            usage, refused = run(command, "--help"), run(command, *args)
            usage = (usage.returncode, usage.stdout, usage.stderr)
            refused = (refused.returncode, refused.stdout, refused.stderr)
        else:
            usage = in_process(command, ["--help"], alias=alias, monkeypatch=monkeypatch, capsys=capsys)
            refused = in_process(command, args, alias=alias, monkeypatch=monkeypatch, capsys=capsys)
        assert usage[0] == 0 and usage[1].startswith(f"usage: dflash {command} "), usage
        last = refused[2].strip().splitlines()[-1]
        assert refused[0] == 2 and last.startswith(f"dflash {command}: error: {says}"), refused
        assert "dflash-" not in refused[2]


def test_val_takes_the_drafter_as_ckpt_like_eval_and_still_reads_the_deprecated_flag(tmp_path, capsys):
    from dflash.tools import val

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    args, cfg, ckpt = val.read_command_line([f"ckpt={drafter}", "seed=3", "--init-trained-on", "100"])
    assert (ckpt, cfg.seed, args.init_trained_on) == (drafter, 3, 100)
    assert capsys.readouterr().err == ""
    _, cfg, ckpt = val.read_command_line(["--ckpt", str(drafter), "seed=3"])
    assert ckpt == drafter and cfg.seed == 3
    assert capsys.readouterr().err == f"dflash val: note: --ckpt is deprecated; write ckpt={drafter}\n"
    assert "deprecated" in dflash("val", "--help").stdout.split("--ckpt DIR", 2)[2]
    for argv, says in (
        ([], "needs ckpt=DIR"),
        (["--ckpt", str(drafter), f"ckpt={drafter}"], "give the drafter once"),
        ([f"ckpt={drafter}", "data.max_len=4"], "unknown config key 'data.max_len'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            val.read_command_line(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("dflash val: error: ") and says in err, err
    with pytest.raises(SystemExit):
        val.read_command_line([f"ckpt={drafter}", "--init-trained", "4", "--windw"])
    assert "unrecognized arguments: --windw" in capsys.readouterr().err


# -- every example a help text shows is accepted ----------------------------------------------


class Parsed(Exception):
    """Raised where a command has read its arguments: the examples are parsed, never run."""

    def __init__(self, rest: list[str]):
        super().__init__(rest)
        self.rest = rest


def stop_after_parsing(monkeypatch) -> None:
    """A flag command's outermost parse ends the command (a subcommand's parser, called inside
    it, returns as usual); parse_args still refuses what it does not know."""
    real = argparse.ArgumentParser.parse_known_args
    depth = 0

    def outermost(parse):
        """(namespace, rest) of `parse`, and whether no other parse encloses this one."""
        nonlocal depth
        depth += 1
        try:
            return parse(), depth == 1
        finally:
            depth -= 1

    def parse_known_args(self, args=None, namespace=None):
        (namespace, rest), done = outermost(lambda: real(self, args, namespace))
        if done:
            raise Parsed(rest)
        return namespace, rest

    def parse_args(self, args=None, namespace=None):
        (_, rest), _ = outermost(lambda: real(self, args, namespace))
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        raise Parsed([])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def help_text(command: str, monkeypatch, capsys) -> str:
    from dflash.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash"])
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def example_lines(text: str, command: str) -> list[list[str]]:
    """Every command line a help text shows: each indented line that starts with `dflash `
    (a trailing backslash continues it, `#` starts a comment), and each line of a Hydra command's
    `common overrides:` (its overrides, the column before the explanation)."""
    lines, examples = text.splitlines(), []
    for number, line in enumerate(lines):
        if line.startswith((" ", "\t")) and line.strip().startswith("dflash "):
            while line.endswith("\\"):
                number += 1
                line = line[:-1] + lines[number]
            examples.append(shlex.split(line, comments=True))
    if "common overrides:" in text:
        section = text.split("common overrides:\n", 1)[1].split("\n\n", 1)[0]
        for line in section.splitlines():
            examples.append(["dflash", command, *shlex.split(re.split(r"\s{2,}", line.strip())[0])])
    return examples


def accept_overrides(command: str, overrides: list[str]) -> None:
    """The overrides compose into a typed config of the command (no run): an unknown key, a
    missing option or a value of the wrong type fails here."""
    from dflash.config.keys import refuse_unknown_keys
    from dflash.config.schema import Config, RegenConfig
    from dflash.config.typed import typed_config
    from dflash.tools.compose import compose_config, with_defaults

    not_overrides = [word for word in overrides if "=" not in word or word.startswith("-")]
    assert not not_overrides, f"dflash {command}: {not_overrides} are no key=value overrides"
    # What a run has without the example: Hydra's run dir, and the two keys regen has no default for.
    defaults = ["paths.output_dir=/tmp/dflash-examples"]
    config_name = "regen" if command == "regen" else "config"
    if command == "regen":
        defaults += ["input=[a.jsonl]", "output=b.jsonl"]
    cfg = compose_config(with_defaults(defaults, overrides), config_name=config_name)
    refuse_unknown_keys(cfg, RegenConfig if command == "regen" else Config)
    typed_config(cfg)


def accept_example(example: list[str], monkeypatch) -> None:
    assert example[:1] == ["dflash"] and example[1] in COMMANDS, example
    command, args = example[1], example[2:]
    if command in HYDRA_COMMANDS:
        accept_overrides(command, args)
        return
    module = importlib.import_module(COMMANDS[command][0])
    with monkeypatch.context() as patch:
        stop_after_parsing(patch)
        with pytest.raises(Parsed) as parsed:
            module.main(args)
    if parsed.value.rest:  # a command that also takes the run's overrides (val, schedule)
        accept_overrides(command, parsed.value.rest)


def mentioned_keys(text: str) -> set[str]:
    """The keys of every `key=value` a Hydra command's help mentions, in its prose too (the
    notation `key=value`, `group=option` aside)."""
    found = re.findall(r"(?<![\w./=-])\+?([a-z_][\w.]*(?:/[\w.]+)*)=", text)
    return set(found) - {"key", "group"}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_example_a_commands_help_shows_is_accepted(command, monkeypatch, capsys):
    """`dflash prep --help` once recommended data.max_len=4096, which prep refuses: every example
    is composed (Hydra commands) or parsed (the others), none run."""
    from dflash.tools.hydra_app import group_options, known_keys

    text = help_text(command, monkeypatch, capsys)
    examples = example_lines(text, command)
    if command in HYDRA_COMMANDS:
        assert len(examples) >= 3, text
        config_name = "regen" if command == "regen" else "config"
        unknown = mentioned_keys(text) - known_keys(config_name) - set(group_options(config_name))
        assert not unknown, f"dflash {command} --help mentions {sorted(unknown)}"
    for example in examples:
        accept_example(example, monkeypatch)


def test_a_refused_example_fails_the_check(monkeypatch):
    """The check above is not vacuous: what the old help texts showed is refused."""
    for example in (
        ["dflash", "prep", "data.max_len=4096"],
        ["dflash", "regen", "limit=N"],
        ["dflash", "train", "train.epochs=6", "|", "train.total_steps=N"],
        ["dflash", "val", "--ckpt", "x", "--init-trained-on", "N"],
        ["dflash", "export", "convert", "a", "b", "--layout", "gguf-typo"],
    ):
        with pytest.raises((AssertionError, SystemExit, Exception)):
            accept_example(example, monkeypatch)


# -- help and completion load no torch ---------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_and_completion_load_no_torch(command):
    """`dflash COMMAND --help` and, for a Hydra command, its completion query (what TAB runs)
    import neither torch nor transformers: they answer in a fraction of a second."""
    queries = [[command, "--help"]]
    if command in HYDRA_COMMANDS:
        queries.append([command, "-sc", "query=bash"])
    code = (
        "import contextlib, io, os, sys\n"
        "from dflash.cli import main\n"
        f"os.environ['COMP_LINE'] = 'dflash-{command} sched'\n"
        f"for args in {queries!r}:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        main(args)\n"
        "    assert out.getvalue().strip(), args\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
