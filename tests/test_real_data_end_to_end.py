"""The whole real-data path from files on disk, through the command-line tools a user runs:

tokenizer + tiny target saved to a directory -> conversations JSONL -> dflash-regen (the target
writes the replies) -> dflash-prep -> dflash-train data=conversations -> dflash-eval on held-out
prompts: tau above 1.2 and greedy output identical to plain greedy decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SLOW_MACHINE_TIMEOUT_S
from tests.tiny_assets import save_tiny_target_with_tokenizer, write_conversations

BIN = Path(sys.executable).parent


def run_tool(name: str, *overrides: str) -> str:
    done = subprocess.run(
        [str(BIN / name), *overrides], capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_regen_prep_train_eval_from_files(tmp_path):
    target = save_tiny_target_with_tokenizer(tmp_path / "target")
    write_conversations(tmp_path / "chat.jsonl", 600, "sharegpt", seed=11)
    write_conversations(tmp_path / "heldout.jsonl", 12, "openai", seed=99)
    cache = tmp_path / "cache"

    out = run_tool(
        "dflash-regen",
        f"target.path={target}",
        f"input=[{tmp_path / 'chat.jsonl'}]",
        f"output={tmp_path / 'regen.jsonl'}",
        "sampling.temperature=0",
        "sampling.max_new_tokens=64",
        "batch_size=64",
        f"paths.output_dir={tmp_path / 'regen_run'}",
    )
    assert "written              600 conversations" in out

    data = [
        "data=conversations",
        f"data.files=[{tmp_path / 'regen.jsonl'}]",
        "data.max_length=128",
        "data.min_supervised_tokens=4",
        f"target.path={target}",
        "drafter.mask_token_id=500",
        f"paths.cache_dir={cache}",
    ]
    out = run_tool("dflash-prep", *data, f"paths.output_dir={tmp_path / 'prep'}")
    assert "records read         600" in out and "(written)" in out

    run_tool("dflash-train", *data, "train.epochs=8", f"paths.output_dir={tmp_path / 'train'}")
    assert len(list((cache / "conversations").glob("*.safetensors"))) == 1  # training read prep's cache
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["train/acc"] > summary["train/acc_first_window"] + 0.2

    out = run_tool(  # no target given: the checkpoint's run config names it
        "dflash-eval",
        f"ckpt={tmp_path / 'train' / 'checkpoints' / 'last'}",
        f"eval.benchmarks={{heldout:{tmp_path / 'heldout.jsonl'}}}",
        "eval.num_prompts=12",
        "eval.timing=false",
        f"paths.output_dir={tmp_path / 'eval'}",
    )
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    print(out)
    assert "lossless: yes" in out
    assert report["metrics"]["eval/heldout/tau"] > 1.2
    assert report["metrics"]["eval/lossless_frac"] == 1.0
