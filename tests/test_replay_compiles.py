"""scripts/replay_compiles.py: which batches of a plan make torch.compile build graphs mid-run.

A graph compiled mid-run stops every pipeline thread until it is built; the replay must see a
new graph where torch builds one (a batch of one sample: dynamic shapes still specialise size 1)
and none where the graphs already cover the shape. Counted with an eager backend: the graph
count is dynamo's, whatever compiles the graphs.
"""

from __future__ import annotations

import torch

from dflash.data.scheduler import PlannedBatch
from dflash.run.inputs import load_training_data
from dflash.run.launch import plan_batches
from dflash.tools.compose import compose_typed
from tests.scripts_as_modules import load_script


def test_a_lone_sample_batch_compiles_new_graphs_and_known_shapes_do_not(tmp_path, data_cache):
    script = load_script("replay_compiles")
    cfg = compose_typed(
        [
            "gpu=cpu",
            "data.num_samples=48",
            "target.compile=true",
            "drafter.compile=true",
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={data_cache}",
        ]
    )
    dataset, _ = load_training_data(cfg)
    planner, _ = plan_batches(cfg, dataset)
    shapes = [(0, 1, 2), (3, 4), (5,), (6, 7, 8)]  # the third: a remainder batch of one sample
    batches = [PlannedBatch(epoch=0, index=i, bucket=0, sample_ids=ids) for i, ids in enumerate(shapes)]
    rows = list(
        script.replay(
            cfg,
            dataset=dataset,
            planner=planner,
            batches=batches,
            device=torch.device("cpu"),
            backend=lambda graph_module, example_inputs: graph_module.forward,
        )
    )
    assert [row.samples for row in rows] == [3, 2, 1, 3]
    assert rows[0].new_graphs["drafter"] >= 1  # the drafter compiles at its first step
    assert rows[1].new_graphs == {"target": 0, "drafter": 0}  # symbolic shapes cover 2 samples
    assert rows[2].new_graphs["target"] >= 1 and rows[2].new_graphs["drafter"] >= 1
    assert rows[3].new_graphs == {"target": 0, "drafter": 0}
