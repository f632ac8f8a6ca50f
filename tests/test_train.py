"""The reference trainer end to end: outputs, resume equivalence, atomic checkpoints, sinks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.export.zlab import load_drafter
from dflash.run.launch import build_run
from dflash.train import train
from dflash.trainer import checkpoint as checkpoint_module
from tests.conftest import SLOW_MACHINE_TIMEOUT_S

SHORT = ["train.total_steps=8", "logger.every_steps=1", "checkpoint.every_steps=4"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row}


def test_train_writes_metrics_checkpoints_and_summary(make_cfg):
    cfg = make_cfg(SHORT)
    summary = train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    for key in (
        "train/loss",
        "train/acc",
        "train/acc_pos_1",
        "train/tau_sim",
        "train/tau_block",
        "train/tau_decode",
        "train/grad_norm",
        "train/lr",
        "perf/tokens_per_s",
    ):
        assert all(isinstance(r[key], float) for r in rows if "train/loss" in r), key
    assert "eval/tau" in rows[-1] and rows[-1]["eval/tau"] >= 1.0
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000004", "step_0000008"]
    assert not (ckpts / "last").is_symlink() and checkpoint_module.checkpoint_behind_last(ckpts) == (
        ckpts / "step_0000008"
    )
    assert summary["eval/lossless_frac"] == 1.0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    # The wait before the first step (with torch.compile, its compile), within the run's time.
    assert 0 < summary["first_step_s"] <= summary["wall_s"]
    assert (run_dir / "config_resolved.yaml").read_text().count("gamma: 4.0") == 1
    state = torch.load(ckpts / "last" / "trainer_state.pt", weights_only=True)  # never arbitrary pickles
    assert state["position"]["step"] == 8
    assert load_drafter(ckpts / "last").block_size == 4
    # What `objective=` accepts is checked before training: it must cover every numeric summary key.
    from dflash.run.checks import is_summary_metric

    numeric = [k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert numeric and [k for k in numeric if not is_summary_metric(k)] == []


def test_resume_continues_with_the_same_batches_and_losses(make_cfg, tmp_path):
    full = make_cfg(SHORT)
    train(full)
    full_dir = Path(full.paths.output_dir)
    resumed = make_cfg(SHORT + [f"resume={full_dir / 'checkpoints' / 'step_0000004'}"], tmp_path / "resumed")
    train(resumed)
    expected = losses(full_dir)
    got = losses(tmp_path / "resumed")
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[s] == expected[s] for s in got), (got, expected)  # bitwise on CPU


def test_failed_checkpoint_write_keeps_the_previous_one(make_cfg, monkeypatch):
    cfg = make_cfg(["train.total_steps=4", "checkpoint.every_steps=2"])
    run = build_run(cfg)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if run.trainer.position.step == 4:
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    with pytest.raises(
        OSError,
        match=r"writing checkpoint .*step_0000004 failed \(disk full\); the previous "
        rf"checkpoint {ckpts.resolve()}/step_0000002 is intact",
    ):
        run.execute()
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000002"]
    assert checkpoint_module.checkpoint_behind_last(ckpts).name == "step_0000002"
    assert torch.load(ckpts / "last" / "trainer_state.pt", weights_only=True)["position"]["step"] == 2


def test_a_step_written_again_and_cut_off_keeps_the_earlier_copy_and_last(make_cfg, monkeypatch, tmp_path):
    """The same step saved again (a resume from an earlier step): a signal between moving the old
    directory aside and renaming the new one in leaves `last` whole, and the next save clears up."""
    run = build_run(make_cfg(["train.total_steps=2"]))
    root = tmp_path / "checkpoints"

    def save():
        return checkpoint_module.save_checkpoint(
            root, 2, run.trainer.drafter, {"n": 1}, "run: 1\n", keep_last=2
        )

    save()
    real_replace = checkpoint_module.os.replace

    def cut_off(source, destination):
        if Path(source).name.startswith(".tmp-"):  # the new step going in
            raise KeyboardInterrupt
        real_replace(source, destination)

    monkeypatch.setattr(checkpoint_module.os, "replace", cut_off)
    with pytest.raises(KeyboardInterrupt):
        save()
    monkeypatch.undo()
    assert load_drafter(root / "last").block_size == 4
    assert torch.load(root / "last" / checkpoint_module.STATE_FILE, weights_only=True) == {"n": 1}
    assert save() == root / "step_0000002"
    assert sorted(p.name for p in root.iterdir()) == ["last", "step_0000002"]


def test_corrupt_checkpoint_is_refused_naming_the_path(make_cfg, tmp_path):
    cfg = make_cfg(["train.total_steps=2"])
    train(cfg)
    last = (Path(cfg.paths.output_dir) / "checkpoints" / "last").resolve()
    (last / "trainer_state.pt").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=f"resume={last}.*trainer_state.pt is corrupt"):
        build_run(make_cfg([f"resume={last}"], tmp_path / "x"))
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        build_run(make_cfg([f"resume={tmp_path / 'missing'}"]))


def test_a_failing_job_still_closes_every_sink(make_cfg, monkeypatch):
    cfg = make_cfg(["train.total_steps=3"])
    run = build_run(cfg)
    closed = []

    class Spy:
        def log(self, metrics, step):
            pass

        def close(self, ok):
            closed.append(ok)

    run.trainer.monitor.sinks.append(Spy())

    def boom(*args, **kwargs):
        raise RuntimeError("drafter step failed")

    monkeypatch.setattr(run.trainer, "step_fn", boom)
    with pytest.raises(RuntimeError, match="drafter step failed"):
        run.execute()
    assert closed == [False]


def test_wandb_sink_offline_records_the_run(make_cfg, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = make_cfg(["logger=wandb", "train.total_steps=2", "logger.every_steps=1"])
    train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


@pytest.mark.slow
def test_make_train_default_run_learns_and_decodes_losslessly(tmp_path, data_cache):
    """What `make train` runs: the CLI, the full tiny default, its summary."""
    result = subprocess.run(
        [sys.executable, "-m", "dflash.train", f"hydra.run.dir={tmp_path}", f"paths.cache_dir={data_cache}"],
        capture_output=True,
        text=True,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "=== dflash run summary ===" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train/acc"] > summary["train/acc_first_window"] + 0.2
    assert summary["eval/tau"] > 1.2
    assert summary["eval/lossless_frac"] == 1.0
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and (
        tmp_path / ".hydra" / "overrides.yaml"
    ).is_file()
    assert (tmp_path / "metrics.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "last" / "model.safetensors").is_file()


def test_resume_into_a_different_drafter_is_refused_naming_the_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(["train.total_steps=2"])
    train(cfg)
    last = (Path(cfg.paths.output_dir) / "checkpoints" / "last").resolve()
    with pytest.raises(ValueError, match=f"resume={last} .*drafter.num_layers: checkpoint 2, this run 3"):
        build_run(make_cfg([f"resume={last}", "drafter.num_layers=3"], tmp_path / "other"))


@pytest.mark.parametrize(
    "override,message",
    [
        # Same shapes, other meaning: the weights would load and train the wrong drafter.
        (
            "drafter.target_layer_ids=[0,5]",
            r"drafter.target_layer_ids: checkpoint \[1, 3\], this run \[0, 5\]",
        ),
        ("drafter.mask_token_id=7", "drafter.mask_token_id: checkpoint 511, this run 7"),
        ("drafter.block_size=8", "drafter.block_size: checkpoint 4, this run 8"),
        ("target.init_seed=1", "target.init_seed: checkpoint 0, this run 1"),
    ],
)
def test_resume_with_another_meaning_is_refused_naming_both_values(
    make_cfg, tmp_path, override, message, monkeypatch
):
    from dflash.target.model import FrozenTarget

    cfg = make_cfg(["train.total_steps=2"])
    train(cfg)
    last = (Path(cfg.paths.output_dir) / "checkpoints" / "last").resolve()

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the checkpoint was checked")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    with pytest.raises(
        ValueError, match=f"resume={last} was trained for another drafter or target .*{message}"
    ):
        build_run(make_cfg([f"resume={last}", override], tmp_path / "other"))


def test_a_llama_target_with_tied_embeddings_trains_and_decodes_losslessly(make_cfg, tiny_llama_dir):
    """target=hf takes any architecture: a Llama whose LM head is its embedding table. The
    drafter scores with that one table and exports only its own weights."""
    from safetensors import safe_open

    cfg = make_cfg(
        ["target=hf", f"target.path={tiny_llama_dir}", "train.total_steps=4", "logger.every_steps=2"]
    )
    summary = train(cfg)
    assert summary["eval/lossless_frac"] == 1.0 and summary["steps"] == 4
    exported = Path(summary["checkpoint"]) / "model.safetensors"
    with safe_open(str(exported), "pt") as handle:
        keys = list(handle.keys())
    assert keys and not any("embed" in k or "lm_head" in k for k in keys)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_first_step_hooks_run_once_after_the_first_step(make_cfg, pipeline):
    """Both trainers call `at_first_step` hooks once, after the first optimizer step: the run
    settles its compile counters there, so later graphs are warned about as mid-run compiles."""
    run = build_run(make_cfg(["train.total_steps=4", f"pipeline={pipeline}"]))
    optimizer = run.trainer.step_fn.optimizer
    updates_seen = []  # AdamW's step count of the first parameter when the hook ran
    run.trainer.at_first_step(lambda: updates_seen.append(int(next(iter(optimizer.state.values()))["step"])))
    run.execute()
    assert updates_seen == [1]


def test_init_from_starts_a_fresh_run_from_a_drafters_weights(make_cfg, tmp_path):
    """drafter.init_from: another run's (or a z-lab export's) weights, a fresh optimizer and
    schedule; a drafter of another shape is refused naming the key, before any training."""
    from safetensors.torch import load_file

    build_run(make_cfg(["train.total_steps=4"], tmp_path / "first")).execute()
    last = tmp_path / "first" / "checkpoints" / "last"
    run = build_run(make_cfg([f"drafter.init_from={last}", "train.total_steps=4"], tmp_path / "second"))
    saved = load_file(str(last / "model.safetensors"))
    weights = run.trainer.drafter.state_dict()
    assert saved and all(
        torch.equal(weights[name].to(tensor.dtype), tensor) for name, tensor in saved.items()
    )
    fresh = build_run(make_cfg(["train.total_steps=4"], tmp_path / "fresh")).trainer.drafter.state_dict()
    assert any(not torch.equal(fresh[name].to(t.dtype), t) for name, t in saved.items())  # not the init
    assert run.trainer.position.step == 0 and not run.trainer.step_fn.optimizer.state
    run.execute()  # trains on from those weights
    with pytest.raises(
        ValueError, match=r"drafter.init_from=.* was trained for another drafter.*drafter.num_layers"
    ):
        build_run(make_cfg([f"drafter.init_from={last}", "drafter.num_layers=3"], tmp_path / "other"))
    with pytest.raises(ValueError, match=r"drafter.init_from=.*missing: no such drafter directory"):
        build_run(make_cfg([f"drafter.init_from={tmp_path / 'missing'}"], tmp_path / "none"))


def test_training_reads_a_save_to_disk_directory_and_records_its_digest(
    make_cfg, tmp_path, tiny_chat_dir, tiny_conversations
):
    """A `datasets` save_to_disk directory in data.files trains like its records, and data.json
    names it with one digest over its files' names and contents (the same each time it is read)."""
    import datasets

    from dflash.data.files import source_digest
    from tests.conftest import conversation_overrides

    saved = tmp_path / "saved"
    rows = [json.loads(line) for line in tiny_conversations.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    summary = train(make_cfg(conversation_overrides(tiny_chat_dir, [saved]) + ["train.total_steps=2"]))
    recorded = json.loads((Path(summary["checkpoint"]) / "data.json").read_text())
    assert recorded["files"] == [{"path": str(saved), "sha256": source_digest(saved)}]
    assert recorded["samples"] > 0


def test_cp_r_of_last_is_a_checkpoint_that_loads_and_resumes(make_cfg, tmp_path):
    """`last` is a directory of hard links to the newest step's files, not a symlink: `cp -r`
    copies a checkpoint (a relative link would arrive dangling), which loads and resumes."""
    cfg = make_cfg(["train.total_steps=4", "checkpoint.every_steps=2"])
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    last, step = ckpts / "last", ckpts / "step_0000004"
    assert last.is_dir() and not last.is_symlink()
    assert sorted(p.name for p in last.iterdir()) == sorted(p.name for p in step.iterdir())
    assert all((last / p.name).samefile(p) for p in step.iterdir())  # no bytes copied
    # The final evaluation's card, in the step and in last alike.
    assert "**tau " in (last / "README.md").read_text() == (step / "README.md").read_text()
    copy = tmp_path / "copied"
    subprocess.run(["cp", "-r", str(last), str(copy)], check=True, timeout=60)
    shutil.rmtree(Path(cfg.paths.output_dir))  # the copy stands alone
    assert load_drafter(copy).block_size == 4
    resumed = build_run(make_cfg([f"resume={copy}", "train.total_steps=6"], tmp_path / "resumed"))
    assert resumed.trainer.position.step == 4
    resumed.execute()
    assert (
        checkpoint_module.checkpoint_behind_last(tmp_path / "resumed" / "checkpoints").name == "step_0000006"
    )


@pytest.mark.parametrize("exchange", [True, False])
def test_last_is_swapped_whole_and_replaces_the_symlink_older_runs_left(tmp_path, monkeypatch, exchange):
    """publish_last builds the new `last` beside the old one and swaps it in: an older run's
    symlink gives way to a directory, a later step replaces the earlier one, nothing staged stays;
    the same where the C library has no renameat2 (the old `last` moved aside first)."""
    if not exchange:

        class NoRenameat2:
            def __init__(self, *args, **kwargs):
                pass

        monkeypatch.setattr(checkpoint_module.ctypes, "CDLL", NoRenameat2)
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step:07d}").mkdir(parents=True)
        (root / f"step_{step:07d}" / checkpoint_module.STATE_FILE).write_text(str(step))
    (root / "last").symlink_to("step_0000002")
    checkpoint_module.publish_last(root, root / "step_0000002")
    assert not (root / "last").is_symlink()
    assert checkpoint_module.checkpoint_behind_last(root) == root / "step_0000002"
    checkpoint_module.publish_last(root, root / "step_0000004")
    assert (root / "last" / checkpoint_module.STATE_FILE).read_text() == "4"
    assert sorted(p.name for p in root.iterdir()) == ["last", "step_0000002", "step_0000004"]
