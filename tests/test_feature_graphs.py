"""target.cuda_graphs: the feature forward replayed from a CUDA graph of each batch shape
(dflash/target/feature_graphs.py). A replay must give the forward's features, whatever the order
of shapes, whichever thread calls, and must never overwrite features a caller still holds."""

from __future__ import annotations

import threading

import pytest
import torch

from dflash.config.typed import typed_config
from tests.test_cli import dflash
from tests.test_fused_experts import tiny_moe_target_overrides


@pytest.mark.parametrize(
    "override, says",
    [
        ("target.cuda_graphs=-1", "target.cuda_graphs=-1: a count of batch shapes, 0 for none"),
        ("target.cuda_graphs=2", "target.cuda_graphs=2: CUDA graphs need the target on a GPU"),
    ],
)
def test_cuda_graphs_that_cannot_run_are_one_line_naming_the_key_and_exit_2(override, says, tmp_path):
    result = dflash("train", override, "debug=fast", "gpu=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_a_target_on_the_cpu_refuses_graphs_and_takes_none(make_cfg):
    from dflash.run.inputs import frozen_target

    target, _ = frozen_target(typed_config(make_cfg(tiny_moe_target_overrides("gpu=cpu"))), "cpu")
    with pytest.raises(ValueError, match="target.cuda_graphs=1: CUDA graphs need the target on a GPU"):
        target.use_feature_graphs(1)
    target.use_feature_graphs(0)  # none: the plain forward
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(target.features(ids), target.reference_features(ids))


@pytest.mark.gpu
def test_on_cuda_replayed_features_are_the_compiled_forwards_in_any_order_and_thread(make_cfg):
    """A Qwen3-Next-layout MoE target (fused experts, fla's kernels, one graph per layer kind):
    two shapes get graphs, a third runs plain; each call's features equal the compiled forward's
    exactly (the same kernels); features a caller holds survive later replays; two threads
    calling at once each get their own input's features."""
    from dflash.run.inputs import frozen_target
    from dflash.torch_runtime.compile import CompileCounter

    torch.manual_seed(0)
    cfg = typed_config(make_cfg(tiny_moe_target_overrides("gpu=single", "target.experts=fused")))
    target, _ = frozen_target(cfg, "cuda")
    target.compile_features(CompileCounter("target"), scope="layers")
    inputs = {
        shape: [torch.randint(0, 256, shape, device="cuda") for _ in range(3)]
        for shape in [(2, 64), (1, 96), (3, 32)]
    }
    want = {
        (shape, i): target.features(ids).clone()
        for shape, batch in inputs.items()
        for i, ids in enumerate(batch)
    }
    target.use_feature_graphs(2)
    held = []
    for shape, i in [((2, 64), 0), ((1, 96), 0), ((2, 64), 1), ((3, 32), 0), ((1, 96), 2), ((2, 64), 2)]:
        got = target.features(inputs[shape][i])
        assert torch.equal(got, want[shape, i]), (shape, i)
        held.append((got, want[shape, i]))
    assert target._graphs.shapes == [(2, 64), (1, 96)]
    assert all(torch.equal(got, expected) for got, expected in held)  # no replay overwrote them

    results, errors = {}, []

    def call(i: int) -> None:
        try:
            for _ in range(5):
                results[i] = target.features(inputs[(2, 64)][i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert all(torch.equal(results[i], want[(2, 64), i]) for i in range(3))
