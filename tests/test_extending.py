"""User code plugged in by config alone: the examples of docs/extending.md, written into modules
outside the package, run: a callback receives every hook in a normal run; a batch order, a noise
schedule and a metric sink replace or join the built-ins by overrides alone; a training metric
added to `FIELDS` reaches every sink; a drafter variant of one's own (its options, drafter class,
training side and export rules, registered by register_variant and register_export), loaded as
the plug-in the doc declares (DFLASH_PLUGINS or an entry point), trains in the real `dflash
train`, decodes, exports and loads back as itself, and is refused in the doc's line without the
plug-in; a component or callback that cannot be built is refused
before anything loads."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.run.launch import build_run
from tests.conftest import FAST, SLOW_MACHINE_TIMEOUT_S, one_sample_batch, record_wandb_rows

DOC = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def doc_blocks() -> list[str]:
    """The python blocks of docs/extending.md."""
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def doc_example(defines: str) -> str:
    """The python block of docs/extending.md that defines `defines` (a class or a name)."""
    return next(block for block in doc_blocks() if f"class {defines}" in block or f"\n{defines} = " in block)


def test_the_documented_batch_order_noise_and_sink_run_from_overrides_alone(tmp_path, make_cfg, monkeypatch):
    """`scheduler._target_`, `noise._target_` on noise=mask_ramp's keys, and a new
    `logger.sinks` entry: the run plans, masks and logs with the user's classes."""
    from dflash.run.runner import Run

    (tmp_path / "my_plugins.py").write_text(doc_example("LongestFirst"))
    monkeypatch.syspath_prepend(str(tmp_path))
    losses = tmp_path / "losses.csv"
    cfg = make_cfg(
        [
            "scheduler._target_=my_plugins.LongestFirst",
            "noise=mask_ramp",
            "noise._target_=my_plugins.CosineMaskRamp",
            "noise.warmup_steps=500",
            "+logger.sinks.csv._target_=my_plugins.CsvSink",
            f"+logger.sinks.csv.path={losses}",
            "train.total_steps=6",
            "logger.every_steps=2",
        ]
    )
    run: Run = build_run(cfg)
    planner = run.trainer.planner
    buckets = [batch.bucket for batch in planner.epoch(0)]
    assert type(planner).__name__ == "LongestFirst" and len(set(buckets)) > 1
    assert buckets == sorted(buckets, reverse=True)  # the built-in interleave would alternate them
    noise = run.trainer.step_fn.noise
    assert type(noise).__name__ == "CosineMaskRamp"
    # noise=mask_ramp's start (0.5) on a cosine: half way at step 250, as the linear ramp is too,
    # but above it before (the linear ramp: 0.375 at step 125).
    assert noise.keep_fraction(0) == 0.5 and abs(noise.keep_fraction(250) - 0.25) < 1e-9
    assert noise.keep_fraction(125) > 0.42 and noise.keep_fraction(500) < 1e-12
    summary = run.execute()
    rows = losses.read_text().splitlines()
    assert rows[0] == "step,loss,tau_sim" and [row.split(",")[0] for row in rows[1:]] == ["2", "4", "6"]
    assert float(rows[-1].split(",")[1]) == summary["train/loss"]
    assert (Path(cfg.paths.output_dir) / "metrics.jsonl").is_file()  # the built-in sinks still log


def test_the_documented_training_metric_reaches_every_sink(make_cfg, monkeypatch, capsys):
    """One `Field` appended to `FIELDS` (docs/extending.md): its window sums are pooled as it
    says, and `train/<name>` reaches metrics.jsonl, the W&B run and the console line."""
    import torch

    from dflash.monitor.sinks import EVAL_STEP
    from dflash.monitor.train_metrics import train_metrics
    from dflash.step import metrics
    from dflash.step.loss import LossStats

    namespace: dict = {}
    exec(doc_example("WEIGHT_PER_BLOCK"), namespace)
    monkeypatch.setattr(metrics, "FIELDS", metrics.FIELDS + (namespace["WEIGHT_PER_BLOCK"],))

    # Pooled over two replicas' windows: the sum of weights over the sum of blocks.
    batch = one_sample_batch()
    windows = []
    for weight, blocks in ((3.0, 2.0), (1.0, 2.0)):
        sums = metrics.StepMetrics(block_size=4, num_buckets=1, device=torch.device("cpu"))
        one = torch.tensor(1.0)
        stats = LossStats(
            weighted_ce=one,
            weight=torch.tensor(weight),
            correct=torch.ones(4),
            counted=torch.ones(4),
            accepted=one,
            blocks=torch.tensor(blocks),
            rounds=one,
        )
        sums.add(stats, torch.tensor(1.0), batch, anchors=1)
        windows.append(sums.publish(end_step=1, lr=1e-3))
    assert train_metrics([windows])["train/weight_per_block"] == pytest.approx(4.0 / 4.0)

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_cfg(["logger=wandb", "train.total_steps=4", "logger.every_steps=2"])
    run = build_run(cfg)
    sent = record_wandb_rows(run, monkeypatch)
    run.execute()
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    ticks = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in ticks] == [2, 4]
    assert all(row["train/weight_per_block"] > 0 for row in ticks)
    sent_ticks = [row for row in sent if "train/loss" in row and EVAL_STEP not in row]
    assert [row["train/weight_per_block"] for row in sent_ticks] == [
        row["train/weight_per_block"] for row in ticks
    ]
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(console) == 2 and all("weight_per_block=" in line for line in console)


def doc_snippet(language: str, containing: str) -> str:
    """The block of docs/extending.md in `language` that holds `containing`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)
    return next(block for block in blocks if containing in block)


@pytest.fixture
def user_variant(tmp_path, monkeypatch, variant_registries):
    """docs/extending.md's variant written into `my_variants.py` outside the package and loaded
    as the plug-in the doc declares (`DFLASH_PLUGINS=my_variants`); every variant registry gets
    back its entries afterwards (other tests iterate every registered variant)."""
    from dflash.config.plugins import ENV_VAR, load_plugins

    (tmp_path / "my_variants.py").write_text(doc_example("TemperedConfig"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_variants", None)
    assert f"{ENV_VAR}=my_variants" in doc_snippet("bash", "variant=tempered")
    load_plugins({ENV_VAR: "my_variants"})

    yield sys.modules["my_variants"]
    sys.modules.pop("my_variants", None)


def test_the_documented_drafter_variant_trains_decodes_and_reloads_as_itself(
    user_variant, variant_registries, make_cfg, monkeypatch
):
    """`variant=tempered` composes from the user's dataclass (options and their rule), trains
    with its loss, decodes in the final evaluation, and its checkpoint loads back as its own
    drafter class through the registry."""
    import torch

    from dflash.export.zlab import load_drafter
    from dflash.target.model import FrozenTarget

    with monkeypatch.context() as patch:
        patch.setattr(FrozenTarget, "from_config", lambda *args, **kwargs: pytest.fail("a model loaded"))
        with pytest.raises(ValueError, match=r"variant\.temperature=0\.0: must be > 0"):
            build_run(make_cfg(["variant=tempered", "variant.temperature=0"]))
    cfg = make_cfg(["variant=tempered", "variant.temperature=1.5", "train.total_steps=4"])
    run = build_run(cfg)
    variant = run.trainer.step_fn.block_settings.variant
    assert type(variant) is user_variant.TemperedVariant and variant.temperature == 1.5
    # Its loss: DFlash's CE of the logits at the temperature (the hidden states divided).
    seen = []
    hidden = torch.randn(1, 4, 8)
    with monkeypatch.context() as patch:
        patch.setattr(user_variant, "draft_loss", lambda hidden, *args, **kwargs: seen.append(hidden))
        variant.block_loss(
            hidden, lm_head=None, drafter=None, blocks=None, final_BSH=None, logits_chunk=0, compiled=False
        )
    assert torch.equal(seen[0], hidden / 1.5)
    summary = run.execute()
    assert summary["eval/lossless_frac"] == 1.0 and summary["train/loss"] > 0  # decodes as the target does
    checkpoint = Path(summary["checkpoint"])
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["train_temperature"] == 1.5
    assert json.dumps(saved["dflash_variant"], sort_keys=True) in DOC.read_text()  # as the doc shows it
    assert type(load_drafter(checkpoint)) is user_variant.TemperedDrafter
    # Without the plug-in: refused in the doc's line, not read as a DFlash drafter.
    variant_registries.forget("my_variants")
    refusal = doc_snippet("text", "is not registered").strip().split(".json: ", 1)[1]
    with pytest.raises(ValueError) as refused:
        load_drafter(checkpoint)
    assert str(refused.value) == f"{checkpoint / 'config.json'}: {refusal}"


def documented_command(tmp_path: Path, command: str, *args: str, plugin: bool = True):
    """The doc's `dflash COMMAND` as a shell runs it, from the directory holding `my_variants.py`,
    with the doc's `export` line (this checkout's dflash after the doc's directory: an installed
    dflash needs nothing more); `plugin=False`: the variable left out."""
    setting, train = doc_snippet("bash", "variant=tempered").strip().splitlines()
    env = dict(os.environ)
    for assignment in shlex.split(setting.removeprefix("export ")):
        name, value = assignment.split("=", 1)
        env[name] = value.replace("$PWD", str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.environ.get("PYTHONPATH", "")])
    if not plugin:
        del env["DFLASH_PLUGINS"]
    words = shlex.split(train) if command == "train" else ["dflash", command]
    assert words[0] == "dflash" and words[1] == command
    return subprocess.run(
        [sys.executable, "-m", "dflash", *words[1:], *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=SLOW_MACHINE_TIMEOUT_S,
    )  # fmt: skip


def test_the_documented_plugin_trains_and_exports_in_the_real_dflash_commands(tmp_path, data_cache):
    """The doc's module and commands: `dflash train` imports the plug-in DFLASH_PLUGINS names,
    composes `variant=tempered` and its option, and trains; its checkpoint records the plug-in,
    `dflash export check` reads it as the variant's (its registered export rules) and, without
    the plug-in, refuses it in the doc's line."""
    (tmp_path / "my_variants.py").write_text(doc_example("TemperedConfig"))
    run_dir = tmp_path / "run"
    sized = [*FAST, "train.total_steps=2", f"paths.output_dir={run_dir}", f"paths.cache_dir={data_cache}"]
    trained = documented_command(tmp_path, "train", *sized)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "=== dflash run summary ===" in trained.stdout
    resolved = (run_dir / "config_resolved.yaml").read_text()
    assert "variant:\n  _target_: my_variants.TemperedVariant\n  temperature: 1.5\n" in resolved
    checkpoint = run_dir / "checkpoints" / "last"
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["train_temperature"] == 1.5 and saved["dflash_variant"]["module"] == "my_variants"
    checked = documented_command(tmp_path, "export", "check", str(checkpoint))
    assert checked.returncode == 0 and checked.stdout.startswith(f"ok: {checkpoint}"), checked.stderr
    refused = documented_command(tmp_path, "export", "check", str(checkpoint), plugin=False)
    refusal = doc_snippet("text", "is not registered").strip().split(".json: ", 1)[1]
    assert refused.returncode == 2 and refusal in refused.stderr


def test_a_plugin_that_cannot_be_imported_is_the_documented_line(monkeypatch, capsys):
    from dflash import cli

    monkeypatch.setenv("DFLASH_PLUGINS", "my_variants")  # not on the path here
    monkeypatch.delitem(sys.modules, "my_variants", raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "--cfg", "job"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == doc_snippet("text", "cannot be imported")


def test_the_documented_entry_point_declares_the_plugin(tmp_path, monkeypatch):
    """The doc's pyproject.toml table, installed (its dist-info: all importlib.metadata reads),
    declares `my_variants` to every command with no variable set."""
    import tomllib

    from dflash.config.plugins import ENTRY_POINT_GROUP, declared_plugins
    from tests.test_plugins import install_distribution

    table = tomllib.loads(doc_snippet("toml", ENTRY_POINT_GROUP))["project"]["entry-points"][
        ENTRY_POINT_GROUP
    ]
    install_distribution(tmp_path, "my-variants", table)
    monkeypatch.syspath_prepend(str(tmp_path))
    declared = [(p.module, p.declared_by) for p in declared_plugins({})]
    assert ("my_variants", "entry point tempered of my-variants") in declared


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["scheduler._target_=my_missing.Order"], "scheduler._target_='my_missing.Order' cannot be imported"),
        (
            ["noise._target_=collections.Counter.most_common"],
            "noise: collections.Counter.most_common does not take",
        ),
        (
            ["+logger.sinks.csv._target_=json.JSONDecoder"],
            "logger.sinks.csv: json.JSONDecoder does not take",
        ),
        (
            ["pipeline._target_=dflash.step.noise.NoNoise"],
            "pipeline: dflash.step.noise.NoNoise does not take",
        ),
        (["scheduler._target_=os"], "scheduler._target_='os' is a module, not a class or function"),
        (["+logger.sinks.x._target_=math.pi"], "logger.sinks.x._target_='math.pi' is a float, not a class"),
        (["+callbacks.bad.path=/tmp/x"], "callbacks.bad needs a _target_"),
        (["+callbacks.bad._target_=no_such_module.Nope"], "callbacks.bad: cannot build no_such_module.Nope"),
        (["+callbacks.bad._target_=pathlib.Path"], r"callbacks.bad: pathlib.Path defines none of the hooks"),
    ],
)
def test_a_component_or_callback_that_cannot_serve_is_refused_before_any_model_loads(
    overrides, message, make_cfg, monkeypatch
):
    from dflash.target.model import FrozenTarget

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the components and callbacks were checked")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    with pytest.raises(ValueError, match=message):
        build_run(make_cfg(overrides))


def test_the_documented_callback_receives_every_hook_of_a_run(tmp_path, data_cache):
    (tmp_path / "my_callbacks.py").write_text(doc_example("RecordingCallback"))
    hooks = tmp_path / "hooks.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [
            sys.executable, "-m", "dflash.train", *FAST, "train.total_steps=6", "checkpoint.every_steps=3",
            "logger.every_steps=2", f"paths.cache_dir={data_cache}", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.rec._target_=my_callbacks.RecordingCallback", f"+callbacks.rec.path={hooks}",
        ],
        capture_output=True, text=True, env=env, timeout=SLOW_MACHINE_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in hooks.read_text().splitlines()]
    names = [call["hook"] for call in calls]
    assert names[0] == "on_train_start" and names[-1] == "on_train_end" and names.count("on_train_start") == 1
    logged = [call for call in calls if call["hook"] == "on_log"]
    train_rows = [call for call in logged if "train/loss" in call["keys"]]
    assert [call["step"] for call in train_rows] == [2, 4, 6] and all(call["loss"] > 0 for call in train_rows)
    assert any("eval/tau" in call["keys"] for call in logged)  # the final evaluation's row too
    checkpoints = [call for call in calls if call["hook"] == "on_checkpoint"]
    assert [call["step"] for call in checkpoints][:2] == [3, 6]
    assert all(Path(call["path"], "model.safetensors").is_file() for call in checkpoints)
    (evaluation,) = [call for call in calls if call["hook"] == "on_eval"]
    assert evaluation["tau"] >= 1.0 and calls[-1]["steps"] == 6
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["config"]["callbacks"]["rec"]["_target_"] == "my_callbacks.RecordingCallback"


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_preflight_checks_each_component_with_the_arguments_the_launcher_builds_it_with(
    pipeline, make_cfg, monkeypatch
):
    """A user class's signature is matched before any weights load against
    preflight.COMPONENT_RUNTIME; the launcher's builds must pass exactly those runtime arguments
    (and `context` to every sink), or a class admitted early would fail after the load, or a
    good one be refused."""
    from dflash.config import components
    from dflash.run.preflight import COMPONENT_RUNTIME

    built_with: dict[str, set[str]] = {}
    check = components.check_buildable

    def recording(node, key, *, runtime=(), exclude=()):
        built_with[key] = set(runtime)
        return check(node, key, runtime=runtime, exclude=exclude)

    # build() looks check_buildable up at call time; preflight's own checks hold the original.
    monkeypatch.setattr(components, "check_buildable", recording)
    run = build_run(make_cfg([f"pipeline={pipeline}", "train.total_steps=2"]))
    run.trainer.monitor.close(True)
    assert {key: built_with[key] for key in COMPONENT_RUNTIME} == {
        key: set(names) for key, names in COMPONENT_RUNTIME.items()
    }
    sinks = {key: names for key, names in built_with.items() if key.startswith("logger.sinks.")}
    assert sinks and all(names == {"context"} for names in sinks.values())


def test_the_documented_trainer_inputs_are_the_ones_a_trainer_receives():
    """docs/extending.md's `pipeline` row names `TrainerInputs` and lists exactly its fields, in
    order; every built-in trainer takes them as `inputs` and nothing else a run does not set."""
    import dataclasses
    import inspect

    from dflash.trainer.async_trainer import AsyncTrainer
    from dflash.trainer.lifecycle import TRAINER_INPUTS, TrainerInputs
    from dflash.trainer.sync import SyncTrainer

    (row,) = [line for line in DOC.read_text().splitlines() if line.startswith("| `pipeline` |")]
    documented = re.search(r"TrainerInputs` \(`([^`]*)`\)", row).group(1).split(", ")
    assert documented == [field.name for field in dataclasses.fields(TrainerInputs)]
    for trainer in (SyncTrainer, AsyncTrainer):
        parameters = inspect.signature(trainer).parameters
        assert parameters[TRAINER_INPUTS].annotation in (TrainerInputs, "TrainerInputs")
        required = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty]
        assert required == [TRAINER_INPUTS]


@pytest.mark.parametrize("key", ["scheduler", "logger.sinks.bad"])
def test_a_component_whose_constructor_raises_is_one_line_naming_the_key(
    key, tmp_path, make_cfg, monkeypatch
):
    # A module name of its own, forgotten afterwards: tests/test_plugins.py imports a
    # `broken_plugin` that must fail, and a cached module of that name would import fine.
    (tmp_path / "raising_component.py").write_text(
        "class Broken:\n    def __init__(self, **kwargs):\n        raise RuntimeError('no licence server')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prefix = "+" if key.startswith("logger") else ""
    try:
        with pytest.raises(ValueError, match=rf"^{re.escape(key)}: building raising_component.Broken failed \(RuntimeError: no licence server\)"):  # fmt: skip
            build_run(make_cfg([f"{prefix}{key}._target_=raising_component.Broken"]))
    finally:
        sys.modules.pop("raising_component", None)


def test_the_documented_variant_pieces_name_every_hook_a_built_in_variant_answers():
    """docs/extending.md's "Add a drafter variant" names each hook of the drafter class and the
    training class that a built-in variant answers differently from DFlash: a hook added or
    renamed in the code is named there too, or a user writing a variant never hears of it."""
    from dflash.config.variant_schema import BUILT_IN_VARIANTS
    from dflash.drafters.backbone import DFlashDrafter
    from dflash.drafters.drafter_registry import registered_drafters
    from dflash.step.variant import DFlashVariant
    from dflash.step.variant_registry import registered_variants

    section = DOC.read_text().split("## Add a drafter variant", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\w+", section))
    unnamed = {}
    for base, registry in ((DFlashDrafter, registered_drafters()), (DFlashVariant, registered_variants())):
        for variant in BUILT_IN_VARIANTS:
            for cls in registry[variant.name].__mro__[: registry[variant.name].__mro__.index(base)]:
                hooks = {key for key in vars(cls) if hasattr(base, key) and not key.startswith("_")}
                # reset_parameters: torch's own hook for the weights' init, not dflash's
                for hook in hooks - named - {"reset_parameters"}:
                    unnamed.setdefault(base.__name__, set()).add(hook)
    assert not unnamed, unnamed
