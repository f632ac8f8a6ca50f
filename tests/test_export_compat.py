"""An exported drafter reads the same under the transformers the z-lab reference pins (4.57.1,
installed beside the main environment by `make install`) as under the project's own: every
config field a Qwen3 draft layer reads, and the rotary frequencies its rotary embedding builds.
transformers 5 writes the rotary base only as `rope_parameters`, which 4.57 does not read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.export.zlab import export_drafter, read_drafter_config
from tests.conftest import SLOW_MACHINE_TIMEOUT_S, TINY_ARCH

COMPAT_TRANSFORMERS = Path(sys.prefix) / "compat" / "transformers-4.57.1"
FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "is_causal",
    "block_size",
    "num_target_layers",
    "dflash_config",
]
# Run under transformers 4.57.1: what the z-lab reference's Qwen3 layers read from the export.
READER = """
import json, sys
import transformers
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
assert transformers.__version__ == "4.57.1", transformers.__version__
config = Qwen3Config.from_pretrained(sys.argv[1])
rotary = Qwen3RotaryEmbedding(config)
fields = {name: getattr(config, name, None) for name in json.loads(sys.argv[2])}
print(json.dumps({"fields": fields, "dtype": str(config.torch_dtype), "rope_theta": config.rope_theta,
                  "inv_freq": rotary.inv_freq.tolist(), "attention_scaling": rotary.attention_scaling}))
"""


def read_under_4_57(directory: Path) -> dict:
    assert COMPAT_TRANSFORMERS.is_dir(), f"{COMPAT_TRANSFORMERS} is missing: `make install` puts it there"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(COMPAT_TRANSFORMERS)
    result = subprocess.run(
        [sys.executable, "-c", READER, str(directory), json.dumps(FIELDS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def export_for(target_config, tmp_path: Path, **drafter_fields) -> Path:
    fields = {"name": "b16", "num_layers": 1, "block_size": 16, "mask_token_id": 16, "num_features": 2}
    cfg = DrafterConfig(**{**fields, **drafter_fields})
    drafter = DFlashDrafter(drafter_config(cfg, target_config, [1, 3]))
    export_drafter(drafter, tmp_path / "export")
    return tmp_path / "export"


def assert_read_alike(directory: Path) -> dict:
    ours = read_drafter_config(directory)
    theirs = read_under_4_57(directory)
    assert theirs["fields"] == {name: json.loads(json.dumps(getattr(ours, name, None))) for name in FIELDS}
    assert theirs["rope_theta"] == ours.rope_parameters["rope_theta"]
    rotary = Qwen3RotaryEmbedding(ours)
    torch.testing.assert_close(torch.tensor(theirs["inv_freq"]), rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert theirs["attention_scaling"] == pytest.approx(rotary.attention_scaling)
    assert theirs["dtype"] == "torch.float32"
    return theirs


@pytest.mark.slow
def test_a_smollm2_drafter_export_reads_alike_under_transformers_4_57(tmp_path, data_cache):
    """The real model's rotary base is 100000: under 4.57 it must not fall back to 10000."""
    from dflash.target.gguf import local_target
    from tests.test_gguf import SMOLLM2, needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    target = AutoConfig.from_pretrained(local_target(SMOLLM2, data_cache).path)
    theirs = assert_read_alike(export_for(target, tmp_path))
    assert theirs["rope_theta"] == 100000.0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1000000.0},  # Qwen3
        {  # Llama 3.1's scaled rotary
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["qwen3_theta_1e6", "llama3_scaling"],
)
def test_a_qwen3_shaped_export_reads_alike_under_transformers_4_57(rope, tmp_path):
    target = AutoConfig.for_model(
        "qwen3", **{**TINY_ARCH, "max_position_embeddings": 131072}, rope_parameters=rope
    )
    theirs = assert_read_alike(export_for(target, tmp_path))
    assert theirs["rope_theta"] == rope["rope_theta"]


def test_a_sliding_window_export_reads_alike_under_transformers_4_57(tmp_path):
    """4 sliding + 1 full layer (the long-context recipe): the window survives 4.57's reading
    (it drops sliding_window without use_sliding_window) and the layers stay bidirectional."""
    target = AutoConfig.for_model("qwen3", **TINY_ARCH)
    layer_types = ["sliding_attention"] * 4 + ["full_attention"]
    directory = export_for(target, tmp_path, num_layers=5, layer_types=layer_types, sliding_window=2048)
    theirs = assert_read_alike(directory)
    assert theirs["fields"]["layer_types"] == layer_types
    assert theirs["fields"]["sliding_window"] == 2048 and theirs["fields"]["is_causal"] is False
