"""Multi-device layouts on CPU: which devices each process and role get, the target tables each
drafter device holds, replica identity, and the split the run recommends."""

from __future__ import annotations

import pytest
import torch

from dflash.config.devices import ProcessSlot, resolve_device_split
from dflash.distributed import ProcessGroupInfo
from dflash.pipeline.replicas import check_replicas_identical, weights_digest
from dflash.pipeline.roles import RoleTimes, role_lines
from dflash.run.launch import build_run
from dflash.target.target_head import TargetHead, heads_for
from dflash.train import train
from tests.conftest import SLOW_MACHINE_TIMEOUT_S, compose_config
from tests.test_dflash_rules import tiny_drafter, tiny_target

# -- devices per process and role --------------------------------------------------------------


def torchrun_slot(local_rank: int, nproc_per_node: int, nodes: int = 1) -> ProcessSlot:
    return ProcessSlot.from_env(
        {
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(nproc_per_node),
            "WORLD_SIZE": str(nproc_per_node * nodes),
        }
    )


def test_one_process_per_gpu_gives_each_rank_its_own_gpu():
    single = compose_config(["gpu=single", "pipeline=async"])
    assert [resolve_device_split(single, 2, torchrun_slot(r, 2)) for r in (0, 1)] == [
        (["cuda:0"], ["cuda:0"]),
        (["cuda:1"], ["cuda:1"]),
    ]
    # 2 processes on an 8-GPU node, each splitting its 4 GPUs 1 + 3.
    split = compose_config(["gpu=split", "gpu.target=1", "pipeline=async"])
    assert resolve_device_split(split, 8, torchrun_slot(1, 2)) == (["cuda:4"], ["cuda:5", "cuda:6", "cuda:7"])
    # One process per node owns the whole node.
    assert resolve_device_split(split, 2, torchrun_slot(0, 1, nodes=2)) == (["cuda:0"], ["cuda:1"])


def test_shared_devices_take_several_replicas_round_robin():
    cfg = compose_config(["gpu=single", "gpu.drafter=2", "pipeline=async"])
    assert resolve_device_split(cfg, 1) == (["cuda:0"], ["cuda:0", "cuda:0"])
    cfg = compose_config(["gpu=single", "gpu.target=2", "gpu.drafter=3", "pipeline=async"])
    assert resolve_device_split(cfg, 2) == (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1", "cuda:0"])


@pytest.mark.parametrize(
    "overrides,visible,slot,message",
    [
        (["gpu=single"], 2, (0, 4), "4 processes on this node .* two ranks would share a GPU"),
        (["gpu=single"], 3, (0, 2), "3 visible CUDA devices.* do not divide evenly among 2 processes"),
        (["gpu=split", "gpu.target=1"], 2, (0, 2), r"needs 2 CUDA devices; 1 CUDA devices per process"),
        (["gpu=split", "gpu.target=2"], 2, (0, 1), r"gpu.target=2 \+ gpu.drafter=rest needs 3"),
        (["gpu=single", "gpu.target=2"], 1, (0, 1), "gpu.target=2 target devices"),
        (["gpu=single"], 0, (0, 1), "no CUDA device is visible"),
    ],
)
def test_layouts_that_cannot_work_are_refused_with_the_reason(overrides, visible, slot, message):
    cfg = compose_config(overrides + ["pipeline=async"])
    with pytest.raises(ValueError, match=message):
        resolve_device_split(cfg, visible, torchrun_slot(*slot))


def test_hidden_devices_are_named(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='3'"):
        resolve_device_split(compose_config(["gpu=split", "gpu.target=1"]), 1)


def test_uneven_processes_per_node_are_refused():
    with pytest.raises(ValueError, match="WORLD_SIZE=3 is not a multiple of LOCAL_WORLD_SIZE=2"):
        ProcessSlot.from_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "3"})


def test_torchrun_with_the_sync_pipeline_is_refused_before_any_model_loads(make_cfg, monkeypatch):
    from dflash.target.model import FrozenTarget

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the layout was validated")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ValueError, match="pipeline=sync runs in one process, but torchrun started WORLD_SIZE=2"
    ):
        build_run(make_cfg(["pipeline=sync"]))


# -- the target's tables on every drafter device ----------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_each_drafter_device_gets_one_frozen_copy_shared_by_its_replicas(tied):
    target = tiny_target()
    if tied:
        target.model.lm_head.weight = target.model.get_input_embeddings().weight
    # "meta" stands in for a second GPU: a device that holds no target.
    heads = heads_for(["cpu", "meta", "meta", "cpu"], [target])
    own, copy_a, copy_b, own_again = heads
    assert own.embed_tokens is target.embed_tokens and own.lm_head is target.lm_head  # no copy
    assert own_again is own and copy_a is copy_b  # one set of tables per device
    assert copy_a.device == torch.device("meta")
    assert copy_a.embed_tokens.weight.shape == target.embed_tokens.weight.shape
    assert copy_a.lm_head.weight.shape == target.lm_head.weight.shape
    assert (copy_a.lm_head.weight is copy_a.embed_tokens.weight) == tied
    assert not any(p.requires_grad for p in copy_a.parameters())


def test_a_copied_head_computes_what_the_target_computes():
    target = tiny_target()
    copy = TargetHead.copy_of(target, torch.device("cpu"))
    assert copy.embed_tokens.weight is not target.embed_tokens.weight
    ids = torch.randint(0, 500, (2, 8))
    assert torch.equal(copy.embed_tokens(ids), target.embed_tokens(ids))
    hidden = torch.randn(2, 8, target.config.hidden_size)
    assert torch.equal(copy.lm_head(hidden), target.lm_head(hidden))


# -- replicas stay identical --------------------------------------------------------------------


def test_weights_digest_sees_a_single_bit():
    drafter = tiny_drafter(tiny_target())
    twin = tiny_drafter(tiny_target())
    assert weights_digest(drafter) == weights_digest(twin)
    with torch.no_grad():
        weight = twin.fc.weight
        weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(float("inf")))
    assert weights_digest(drafter) != weights_digest(twin)
    with pytest.raises(RuntimeError, match="replicas diverged .* rank 0 replica 1"):
        check_replicas_identical([drafter, twin], ProcessGroupInfo())
    assert check_replicas_identical([drafter, drafter], ProcessGroupInfo()) == weights_digest(drafter)


def test_two_replica_run_reports_identical_replicas_and_role_shares(make_cfg):
    summary = train(make_cfg(["pipeline=async", "gpu.target=2", "gpu.drafter=2", "train.total_steps=6"]))
    assert summary["replicas"] == 2 and len(summary["replica_digest"]) == 16
    for role in ("target", "drafter"):
        assert 0.0 < summary[f"roles/{role}_busy_frac"] <= 1.0
        assert summary[f"roles/{role}_s_per_batch"] > 0.0
    assert 0.0 <= summary["roles/data_wait_frac"] <= 1.0
    lines = role_lines(summary)
    assert lines[0].startswith("replicas          2, identical")
    assert not any("split advice" in line for line in lines)  # a CPU run advises no GPU split


# -- the split recommendation ------------------------------------------------------------------


def test_split_advice_balances_the_measured_role_times():
    # Paper shape on one H200: the drafter step costs ~2.6x the target forward.
    times = RoleTimes(target_s_per_batch=0.100, drafter_s_per_batch=0.263)
    # 8 GPUs: 2 + 6 moves min(2/0.1, 6/0.263) = 20 batches/s; 3 + 5 only 19.0; 5 + 3 only 11.4.
    assert times.best_num_targets(8) == 2
    assert times.batches_per_s(5, 3) < times.batches_per_s(2, 6)
    assert times.best_num_targets(2) == 1
    assert times.advice(8).startswith("8 GPUs: gpu=split gpu.target=2 (2 target + 6 drafter, ~")
    # A target-heavy workload (long contexts, few anchors) flips it.
    assert RoleTimes(target_s_per_batch=0.3, drafter_s_per_batch=0.1).best_num_targets(8) == 6
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        times.best_num_targets(1)


def test_summary_prints_the_advice_for_this_node_and_for_eight_gpus():
    summary = {
        "replicas": 1,
        "node_gpus": 2,
        "roles/target_busy_frac": 0.4,
        "roles/drafter_busy_frac": 0.95,
        "roles/data_wait_frac": 0.02,
        "roles/target_s_per_batch": 0.010,
        "roles/drafter_s_per_batch": 0.026,
    }
    text = "\n".join(role_lines(summary))
    assert "roles busy        target 40%, drafter 95%, drafters waiting for data 2%" in text
    assert "per batch         target 10.0 ms, drafter 26.0 ms (CUDA-event time)" in text
    assert "split advice      2 GPUs: gpu=split gpu.target=1" in text
    assert "split advice      8 GPUs: gpu=split gpu.target=2" in text


def _layout_rank(rank: int, init_file: str, errors) -> None:
    import torch.distributed as dist

    from dflash.distributed import require_same_layout

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        drafters = ["cuda:1"] if rank == 0 else ["cuda:1", "cuda:2", "cuda:3"]  # a node with other GPUs
        require_same_layout(ProcessGroupInfo(rank, 2), ["cuda:0"], drafters)
        errors.put((rank, None))
    except ValueError as exc:
        errors.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_layouts_are_refused_before_any_model_loads(tmp_path):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    errors = context.Queue()
    mp.start_processes(
        _layout_rank, args=(str(tmp_path / "init"), errors), nprocs=2, join=True, start_method="spawn"
    )
    outcomes = dict(errors.get(timeout=SLOW_MACHINE_TIMEOUT_S) for _ in range(2))
    for rank in (0, 1):  # every rank stops, each with the whole picture
        assert "rank 0: 1 target + 1 drafter, rank 1: 1 target + 3 drafter" in outcomes[rank]
