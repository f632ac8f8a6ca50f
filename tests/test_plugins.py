"""Plug-ins (dflash/config/plugins.py): a module declared by an installed package's
`dflash.plugins` entry point or by DFLASH_PLUGINS is imported by every command that composes a
config or reads a checkpoint, so its `variant=NAME` composes in the real `dflash train`; one that
fails to import is one line naming it, where it was declared and its error, exit 2; and a
checkpoint of a plug-in's drafter variant names the variant and its module, so a process without
the plug-in refuses it instead of reading it as plain DFlash, and reads it as its own with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import cli
from dflash.config.plugins import ENTRY_POINT_GROUP, ENV_VAR, PluginError, declared_plugins, load_plugins
from tests.conftest import SLOW_MACHINE_TIMEOUT_S

# A drafter variant of one's own, the least one: DFlash's drafter, loss and export rules under
# another name, its config recording one option (how `describes` finds it again); registered as
# docs/extending.md shows.
ECHO_VARIANT = """
from dataclasses import dataclass

from dflash.config.variant_schema import VariantConfig, variant_options
from dflash.export.export_registry import register_export
from dflash.export.rules import VariantExport
from dflash.drafters.backbone import DFlashDrafter
from dflash.step.variant import DFlashVariant
from dflash.step.variant_registry import register_variant


@dataclass
class EchoConfig(VariantConfig):
    _target_: str = "echo_variant.EchoVariant"
    echo: int = 1


class EchoDrafter(DFlashDrafter):
    variant_name = "echo"

    @classmethod
    def describes(cls, config) -> bool:
        return "echo" in (config if isinstance(config, dict) else vars(config))


class EchoExport(VariantExport):
    drafter = EchoDrafter


register_export(EchoExport())


@register_variant
@dataclass(frozen=True)
@variant_options(EchoConfig)
class EchoVariant(DFlashVariant):
    name = "echo"
    drafter_class = EchoDrafter
    options = EchoConfig

    def drafter_config(self, config):
        config.echo = self.echo
        return config
"""
BROKEN = 'raise RuntimeError("needs the frobnicator")\n'
# The commands that neither compose a run config nor read a drafter: they load no plug-in.
NEITHER_CONFIG_NOR_CHECKPOINT = {"report", "diff", "prompts", "demo", "completion"}


PLUGIN_MODULES = ("echo_variant", "broken_plugin", "my_pkg")


@pytest.fixture
def registry(variant_registries):
    """The drafter registry (dflash/drafters/drafter_registry.py); every variant registry gets back its
    entries afterwards and a plug-in module imported here is forgotten (other tests iterate every
    registered variant, and load the plug-in anew)."""
    from dflash.drafters import drafter_registry as variants

    before = set(sys.modules)
    yield variants
    for name in set(sys.modules) - before:
        if name.startswith(PLUGIN_MODULES):
            del sys.modules[name]


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory on sys.path holding the echo variant and a module that fails to import."""
    directory = tmp_path / "plugins"
    directory.mkdir()
    (directory / "echo_variant.py").write_text(ECHO_VARIANT)
    (directory / "broken_plugin.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.delenv(ENV_VAR, raising=False)
    return directory


def install_distribution(site: Path, name: str, entry_points: dict[str, str]) -> None:
    """What `pip install` leaves of a package declaring `dflash.plugins` entry points: its
    dist-info directory (importlib.metadata reads nothing else)."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")


def test_an_installed_packages_entry_point_is_imported(plugin_dir, registry, monkeypatch):
    package = plugin_dir / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_variant.py").write_text("import echo_variant  # noqa: F401\n")
    install_distribution(plugin_dir, "my-pkg", {"my_variant": "my_pkg.my_variant"})
    monkeypatch.syspath_prepend(str(plugin_dir))  # clears importlib.metadata's caches: it sees the dist

    assert "echo" not in registry.registered_drafters()
    (plugin,) = [p for p in declared_plugins({}) if p.module.startswith("my_pkg")]
    assert plugin.declared_by == "entry point my_variant of my-pkg"
    load_plugins({})
    assert registry.registered_drafters()["echo"].__module__ == "echo_variant"


def test_a_broken_entry_point_names_its_distribution(plugin_dir, registry, monkeypatch):
    install_distribution(plugin_dir, "my-broken", {"broken": "broken_plugin"})
    monkeypatch.syspath_prepend(str(plugin_dir))
    with pytest.raises(PluginError) as caught:
        load_plugins({})
    assert str(caught.value) == (
        "plug-in broken_plugin (entry point broken of my-broken) cannot be imported: "
        "RuntimeError: needs the frobnicator"
    )


def test_the_variable_names_modules_in_order_each_once(plugin_dir, registry):
    environ = {ENV_VAR: " echo_variant, ,json,echo_variant "}
    assert [(p.module, p.declared_by) for p in declared_plugins(environ)] == [
        ("echo_variant", ENV_VAR),
        ("json", ENV_VAR),
    ]
    load_plugins(environ)
    assert "echo" in registry.registered_drafters()
    with pytest.raises(
        PluginError, match=r"'echo_variant\.py' is not a module name \(name the module, echo_variant,"
    ):
        declared_plugins({ENV_VAR: "echo_variant.py"})
    with pytest.raises(
        PluginError, match=r"plug-in no_such_plugin \(DFLASH_PLUGINS\) cannot be imported: .*PYTHONPATH"
    ):
        load_plugins({ENV_VAR: "no_such_plugin"})


def minimal_command_line(name: str, tmp_path: Path) -> list[str]:
    """Arguments `dflash NAME` accepts and would act on at once (`--cfg job`: a Hydra command
    that went past its plug-ins prints the config and ends, it runs nothing)."""
    if name == "export":
        return ["export", "check", str(tmp_path)]
    if name in cli.HYDRA_COMMANDS:
        return [name, "--cfg", "job"]
    return [name, f"ckpt={tmp_path}"]


@pytest.mark.parametrize("name", sorted(set(cli.COMMANDS) - NEITHER_CONFIG_NOR_CHECKPOINT))
def test_every_command_that_reads_a_config_or_checkpoint_stops_at_a_broken_plugin(
    name, plugin_dir, registry, tmp_path, monkeypatch, capsys
):
    """In one line naming the module, the variable and its error; exit 2, before anything else."""
    monkeypatch.setenv(ENV_VAR, "broken_plugin")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as stopped:
        cli.main(minimal_command_line(name, tmp_path))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"dflash {name}: error: plug-in broken_plugin (DFLASH_PLUGINS) cannot be imported: "
        "RuntimeError: needs the frobnicator\n"
    )


def test_the_real_dflash_train_composes_a_plugins_variant(plugin_dir):
    """`DFLASH_PLUGINS=echo_variant dflash train variant=echo`: no launcher script."""
    env = {
        **os.environ,
        ENV_VAR: "echo_variant",
        "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "dflash", "train", "variant=echo", "variant.echo=3", "--cfg", "job"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=SLOW_MACHINE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "variant:\n  _target_: echo_variant.EchoVariant\n  echo: 3\n" in result.stdout


def test_a_plugins_option_asked_for_without_the_plugin_points_at_plug_ins(plugin_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "variant=echo", "--cfg", "job"])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dflash train: error: variant=echo: no such option (options: dflash, ")
    assert line.endswith("needs its plug-in (DFLASH_PLUGINS, or a dflash.plugins entry point)")


def test_a_training_job_loads_the_plugins_itself(plugin_dir, registry, make_cfg, monkeypatch):
    """A sweep launcher's job in a process of its own never passed the command's start: `train`
    imports the plug-ins before anything loads (a ValueError there: the job's one-line error)."""
    from dflash.target.model import FrozenTarget
    from dflash.train import train

    cfg = make_cfg()
    monkeypatch.setattr(FrozenTarget, "from_config", lambda *args, **kwargs: pytest.fail("a model loaded"))
    monkeypatch.setenv(ENV_VAR, "broken_plugin")
    with pytest.raises(PluginError, match="plug-in broken_plugin .* needs the frobnicator"):
        train(cfg)


@pytest.fixture
def echo_checkpoint(plugin_dir, registry, variant_registries, tmp_path):
    """A drafter of the echo variant exported as a checkpoint's drafter is, then the plug-in
    forgotten: this process is one that never imported it."""
    from dflash.export.zlab import export_drafter
    from tests.test_dflash_rules import tiny_drafter_config, tiny_target

    load_plugins({ENV_VAR: "echo_variant"})
    drafter_class = registry.registered_drafters()["echo"]
    config = tiny_drafter_config(tiny_target())
    config.echo = 2
    directory = tmp_path / "echo-checkpoint"
    export_drafter(drafter_class(config), directory)
    variant_registries.forget("echo_variant")
    return directory


REFUSAL = "drafter variant echo (from module echo_variant) is not registered: install/enable the plug-in"


def test_a_plugin_checkpoint_names_its_variant_and_module(echo_checkpoint):
    config = json.loads((echo_checkpoint / "config.json").read_text())
    assert config["dflash_variant"] == {"name": "echo", "module": "echo_variant"}


@pytest.mark.parametrize("reader", ["load_drafter", "resume", "export check"])
def test_a_plugin_checkpoint_is_refused_without_the_plugin_and_read_with_it(reader, echo_checkpoint):
    """Each way a checkpoint is read (eval, served, val and export convert load it; a resume and
    drafter.init_from compare it first; export check runs the loader's checks) refuses it naming
    the variant and its module; with the plug-in loaded it is the variant's own drafter."""
    from dflash.export.contract import check_export
    from dflash.export.zlab import load_drafter
    from dflash.run.resume import check_resume_matches
    from tests.test_dflash_rules import tiny_drafter_config, tiny_target

    run_config = tiny_drafter_config(tiny_target())  # the resuming run's: the checkpoint's own
    run_config.echo = 2

    def read():
        if reader == "load_drafter":
            return load_drafter(echo_checkpoint)
        if reader == "export check":
            return check_export(echo_checkpoint, target=None)
        return check_resume_matches(echo_checkpoint, run_config, {})

    if reader == "export check":
        (problem,) = read()
        assert problem == f"{echo_checkpoint / 'config.json'}: {REFUSAL} (DFLASH_PLUGINS=echo_variant, or the dflash.plugins entry point of its package)"  # fmt: skip
    else:
        with pytest.raises(ValueError, match=REFUSAL.replace("(", r"\(").replace(")", r"\)")):
            read()
    load_plugins({ENV_VAR: "echo_variant"})
    if reader == "load_drafter":
        drafter = read()
        assert type(drafter).variant_name == "echo" and drafter.config.echo == 2
    elif reader == "export check":
        assert read() == []
    else:
        read()  # the same drafter and target: nothing to refuse


def test_dflash_export_check_refuses_it_in_one_line_and_passes_with_the_plugin(
    echo_checkpoint, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["export", "check", str(echo_checkpoint)])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dflash export: {echo_checkpoint / 'config.json'}: {REFUSAL}")
    monkeypatch.setenv(ENV_VAR, "echo_variant")
    cli.main(["export", "check", str(echo_checkpoint)])
    assert capsys.readouterr().out.startswith(f"ok: {echo_checkpoint} keeps the export contract")


def test_a_plugin_drafter_converted_to_speculators_is_refused_without_the_plugin_too(
    echo_checkpoint, variant_registries, tmp_path
):
    """The speculators layout nests the record with the layer's fields; read back, it still
    names the variant: refused without the plug-in, the variant's drafter with it."""
    from dflash.export.zlab import load_drafter, write_layout
    from tests.test_export_bytes import VERIFIER, target_dir

    load_plugins({ENV_VAR: "echo_variant"})
    converted = tmp_path / "echo-speculators"
    write_layout(
        load_drafter(echo_checkpoint),
        converted,
        "speculators",
        target_dir=target_dir(tmp_path),
        verifier=VERIFIER,
    )
    assert type(load_drafter(converted)).variant_name == "echo"
    variant_registries.forget("echo_variant")
    with pytest.raises(ValueError, match="drafter variant echo .* is not registered"):
        load_drafter(converted)


def test_the_built_in_variants_record_nothing():
    """Their checkpoints stay byte for byte what they were (tests/test_export_bytes.py); a
    subclass that only instruments a variant is that variant, and records nothing either. The
    built-ins: the package's YAML options (a test module's own variant is a plug-in, and records)."""
    from dflash.drafters.backbone import DFlashDrafter
    from dflash.drafters.drafter_registry import registered_drafters
    from dflash.drafters.plugin_record import variant_record
    from dflash.tools.compose import CONF_DIR

    built_in = sorted(path.stem for path in (CONF_DIR / "variant").glob("*.yaml"))
    assert built_in and set(built_in) <= set(registered_drafters())

    class Instrumented(DFlashDrafter):
        calls = 0

    assert [variant_record(registered_drafters()[name]) for name in built_in] == [{}] * len(built_in)
    assert variant_record(Instrumented) == {}


def test_the_plugins_are_read_from_the_environment_as_it_is_at_the_call(plugin_dir, registry, monkeypatch):
    """A command reads DFLASH_PLUGINS when it starts, whatever mapping `os.environ` was when
    dflash.config.plugins was imported (a default argument bound then would keep an old one)."""
    monkeypatch.setattr(os, "environ", {**os.environ, ENV_VAR: "echo_variant"})
    assert [p.module for p in load_plugins()] == ["echo_variant"]
    assert "echo" in registry.registered_drafters()
