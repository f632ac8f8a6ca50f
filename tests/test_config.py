"""The config contract: every option composes and builds, the default keys are pinned, and bad
input fails with a message that names the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from dflash.config.devices import resolve_device_split
from dflash.run.launch import build_run
from dflash.tools.compose import CONF_DIR
from tests.conftest import (
    SLOW_MACHINE_TIMEOUT_S,
    TINY_ARCH,
    compose_config,
    conversation_overrides,
    run_module,
    tiny_hybrid_arch,
    yaml_leaves,
)

SNAPSHOT = Path(__file__).parent / "snapshots" / "default_config_keys.txt"
NOT_OPTION_GROUPS = {"hydra", "experiment"}
CUDA_OPTIONS = {("gpu", "single"), ("gpu", "split")}


def group_options() -> list[tuple[str, str]]:
    return sorted(
        (group.name, option.stem)
        for group in CONF_DIR.iterdir()
        if group.is_dir() and group.name not in NOT_OPTION_GROUPS
        for option in group.glob("*.yaml")
    )


def option_overrides(group: str, option: str, request) -> list[str]:
    """What an option needs beyond itself to build against the tiny target on this machine."""
    extra = {
        ("target", "qwen3_8b"): lambda: [f"target.path={request.getfixturevalue('tiny_qwen3_dir')}"],
        ("target", "hf"): lambda: [f"target.path={request.getfixturevalue('tiny_llama_dir')}"],
        ("target", "qwen3_next_80b"): lambda: [
            f"target.path={request.getfixturevalue('tiny_qwen3_next_dir')}"
        ],
        # The paper drafter's 5 features on the tiny 6-layer target: the default ids fit it.
        ("drafter", "b16"): lambda: ["drafter.mask_token_id=511"],
        ("drafter", "b16_sliding"): lambda: ["drafter.mask_token_id=511"],
        # Qwen3-8B's shape would not fit this machine: the option's own keys, at the tiny sizes.
        ("target", "qwen3_8b_random"): lambda: [
            f"target.arch.{key}={value}" for key, value in TINY_ARCH.items()
        ],
        ("target", "qwen3_5"): lambda: [f"target.path={request.getfixturevalue('tiny_qwen3_5_dir')}"],
        ("target", "qwen3_5_moe"): lambda: [f"target.path={request.getfixturevalue('tiny_qwen3_5_moe_dir')}"],
        # The published hybrid shapes' own keys, at the tiny sizes.
        ("target", "qwen3_5_35b_a3b_random"): lambda: tiny_hybrid_arch() + ["drafter.intermediate_size=128"],
        ("target", "qwen3_next_80b_random"): lambda: tiny_hybrid_arch(),
        ("target", "qwen3_next_80b_fp8_random"): lambda: tiny_hybrid_arch(),
        ("target", "qwen3_8b_fp8_random"): lambda: [
            f"target.arch.{key}={value}" for key, value in TINY_ARCH.items()
        ],
        ("target", "qwen3_5_9b_random"): lambda: tiny_hybrid_arch(moe=False),
        # A real model (converted once per session into the shared cache): its own mask id.
        ("target", "smollm2_135m"): lambda: ["drafter.mask_token_id=16", "data.num_samples=8"],
        ("eval", "humaneval_mtbench"): lambda: [
            f"target.tokenizer={request.getfixturevalue('tiny_chat_dir')}"
        ],
        ("data", "random_3072"): lambda: [
            "data.num_samples=8",
            "data.bucket_edges=[3072]",
            "data.tokens_per_batch=8192",
        ],
        ("data", "conversations"): lambda: conversation_overrides(
            request.getfixturevalue("tiny_chat_dir"), [request.getfixturevalue("tiny_conversations")]
        )[1:],
    }
    return [f"{group}={option}"] + extra.get((group, option), list)()


def error_text(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


@pytest.mark.parametrize("group,option", group_options(), ids=lambda v: str(v))
def test_every_option_composes_and_builds(group, option, make_cfg, request, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_cfg(option_overrides(group, option, request))
    assert OmegaConf.select(cfg, group) is not None
    if (group, option) in CUDA_OPTIONS:
        with pytest.raises(ValueError, match="gpu.device=cuda but no CUDA device is visible"):
            build_run(cfg)
        return
    run = build_run(cfg)
    try:
        assert run.total_steps > 0
        if cfg.data.kind.value == "synthetic":
            assert len(run.trainer.dataset) == cfg.data.num_samples
        else:
            assert len(run.trainer.dataset) > 0
    finally:
        run.trainer.monitor.close(True)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment, tmp_path):
    """Every key the experiment's file sets reaches the run's config with the file's value, and
    the result passes the checks a run makes before any weights load (given a target of 36
    layers and a vocabulary that holds every experiment's mask id, as the real targets do)."""
    import yaml

    from dflash.config.typed import typed_config
    from dflash.run.checks import validate

    spec = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text())
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("")
    output = [f"paths.output_dir={tmp_path / 'run'}"]
    # What an experiment may leave to the command line (its usage line names them), nothing else.
    composed = compose_config([f"experiment={experiment}", *output])
    missing = OmegaConf.missing_keys(composed)
    assert missing <= {"drafter.mask_token_id"}, missing
    from_user = [f"{key}=151669" for key in missing]
    if composed.data.kind == "conversations":
        from_user.append(f"data.files=[{conversations}]")
    cfg = compose_config([f"experiment={experiment}", *output, *from_user])

    set_by_file = dict(yaml_leaves({k: v for k, v in spec.items() if k not in ("defaults", "hydra")}))
    assert set_by_file or "hydra" in spec  # a search experiment sets only its sweeper
    for key, value in set_by_file.items():
        assert OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, key)}))["v"] == value, key
    validate(typed_config(cfg), num_target_layers=36, target_vocab_size=262144, visible_cuda_devices=8)


def flat_keys(cfg) -> list[str]:
    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1]

    return sorted(walk(OmegaConf.to_container(cfg, resolve=False), ""))


def test_default_config_keys_snapshot():
    keys = flat_keys(compose_config())
    expected = SNAPSHOT.read_text().split()
    assert keys == expected, (
        "default config keys changed; if intended, regenerate tests/snapshots/default_config_keys.txt "
        "(python -c 'from tests.test_config import *; print(*flat_keys(compose_config()), sep=chr(10))')"
    )


def test_default_is_the_tiny_cpu_run():
    from dflash.tools.compose import compose_config as compose_with_hydra

    cfg = compose_with_hydra([], return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    expected = {
        "target": "tiny",
        "drafter": "tiny",
        "data": "tiny_synthetic",
        "gpu": "cpu",
        "pipeline": "sync",
        "scheduler": "interleave",
        "logger": "jsonl",
        "noise": "none",
        "experiment": None,
        "debug": "none",
    }
    assert {group: choices[group] for group in expected} == expected
    assert cfg.gpu.device == "cpu" and cfg.target.path is None and cfg.drafter.block_size == 4


@pytest.mark.parametrize(
    "override,key",
    [
        ("optimizer.lrr=1", "optimizer.lrr"),  # unknown key
        ("optimizer.lr=fast", "optimizer.lr"),  # wrong type
        ("optimizer.betas=[0.9,high]", "optimizer.betas"),
        ("noise.std=0.1", "noise.std"),  # a key of another option: noise=none has no std
        ("gpu.device=tpu", "gpu.device"),  # unknown enum value
        ("scheduler=fifo", "scheduler"),  # unknown group option
    ],
)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([override])
    assert key in error_text(info.value)


def test_typo_inside_an_experiment_yaml_names_the_key(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text(
        "# @package _global_\noptimizer:\n  weight_decy: 0.1\n"
    )
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "experiment=typo"])
    assert "weight_decy" in error_text(info.value) and "optimizer" in error_text(info.value)


def test_gpu_split_from_config():
    cfg = compose_config(["gpu=split", "gpu.target=5"])
    targets, drafters = resolve_device_split(cfg, visible_cuda_devices=8)
    assert targets == [f"cuda:{i}" for i in range(5)] and drafters == ["cuda:5", "cuda:6", "cuda:7"]
    single = compose_config(["gpu=single"])
    assert resolve_device_split(single, visible_cuda_devices=1) == (["cuda:0"], ["cuda:0"])
    with pytest.raises(ValueError, match=r"gpu.target=5 \+ gpu.drafter=4"):
        resolve_device_split(compose_config(["gpu=split", "gpu.target=5", "gpu.drafter=4"]), 8)
    with pytest.raises(ValueError, match="gpu.target=8"):
        resolve_device_split(compose_config(["gpu=split", "gpu.target=8"]), 8)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["drafter.target_layer_ids=[1,9]"], "drafter.target_layer_ids"),
        (["drafter.mask_token_id=512"], "drafter.mask_token_id"),
        (["drafter.block_size=1"], "drafter.block_size"),
        (["drafter.num_layers=0"], "drafter.num_layers must be >= 1, got 0"),
        (
            ["drafter.layer_types=[sliding_attention]"],
            "drafter.layer_types has 1 entries for drafter.num_layers=2",
        ),
        (
            ["drafter.layer_types=[sliding_attention,full_attention]"],
            "drafter.sliding_window must be >= drafter.block_size=4",
        ),
        (
            ["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=3"],
            "drafter.sliding_window must be",
        ),
        (["drafter.sliding_window=64"], "drafter.sliding_window=64 is set but no layer slides"),
        (["loss.gamma=0"], "loss.gamma"),
        (["loss.logits_chunk=-1"], "loss.logits_chunk"),
        (["drafter.attention=flex"], "drafter.attention=flex trains on CUDA only"),
        (["noise=mask_ramp", "noise.warmup_steps=0"], "noise.warmup_steps"),
        (["noise=feature", "noise.std=0"], "noise.std"),
        (["optimizer.betas=[0.9]"], "optimizer.betas"),
        (["optimizer.fused=false"], "optimizer.fused=false"),
        # A component whose class cannot be imported, or does not take its node's arguments.
        (
            ["scheduler._target_=no_such_module.Planner"],
            "scheduler._target_='no_such_module.Planner' cannot be imported",
        ),
        (["noise._target_=math.sqrt"], "noise: math.sqrt does not take the arguments"),
        (["+logger.sinks.mine._target_=json.dumps"], "logger.sinks.mine: json.dumps does not take"),
        (["data.bucket_edges=[48,40,128]"], "data.bucket_edges"),
        (["data.max_length=256"], "data.max_length"),
        (["gpu.target=2"], "gpu.target=2"),
        # Hydra's own hint for a typo is the `+` form; a key no code reads must not be ignored.
        (["+loss.gamm=5"], "unknown config key 'loss.gamm'.*did you mean loss.gamma?"),
        # A key of another option of the group: noise=mask_ramp has `start`, not `std`.
        (["noise=mask_ramp", "+noise.std=0.1"], "unknown config key 'noise.std'.*did you mean noise.start?"),
        (["+foo.bar=1"], "unknown config key 'foo'"),
        (["debug.max_steps=0"], "debug.max_steps must be >= 1"),
        (["eval.temperatures=[]"], "eval.temperatures must be a non-empty list"),
        (["eval.temperatures=[0.0,-1.0]"], "eval.temperatures must be .* got [0.0, -1.0]"),
        (
            ["eval.max_new_tokens=1000000000"],
            "eval.max_new_tokens=1000000000 .* exceeds the target's 4096 positions .* at most 4080",
        ),
        (["objective=foo"], "objective='foo' is not a summary metric"),
        # A loss with no term trains nothing and would report success.
        (
            [
                "variant=dspark",
                "variant.ce_weight=0",
                "variant.tv_weight=0",
                "variant.confidence_weight=0",
                "variant.confidence_head=false",
            ],
            "variant=dspark with variant.ce_weight, variant.tv_weight and variant.confidence_weight all 0 "
            "has no loss term",
        ),
        (["variant=dspark", "variant.tv_weight=-0.5"], "variant.tv_weight=-0.5: must be >= 0"),
        # nan and inf as the command line spells them (every float field: test_every_float_setting_...).
        (["variant=dspark", "variant.ce_weight=nan"], "variant.ce_weight=nan: must be a finite number"),
        (["variant=dflash2", "variant.selector_alpha=nan"], "variant.selector_alpha=nan: must be a finite"),
        (["variant=dflash2", "variant.selector_alpha=inf"], "variant.selector_alpha=inf: must be a finite"),
        (["optimizer.lr=-inf"], "optimizer.lr=-inf: must be a finite number"),
        (["eval.temperatures=[0.0,nan]"], "eval.temperatures[1]=nan: must be a finite number"),
        # More features than the target has layers: the default ids cannot be distinct.
        (
            ["drafter=b16", "drafter.mask_token_id=511", "target.arch.num_hidden_layers=4"],
            "the target has 4 layers and the drafter asks for 5 features .drafter.num_features=5., one "
            "distinct layer each: set drafter.num_features <= 4, or drafter.target_layer_ids",
        ),
        (
            ["target.path=/models/Qwen3-8B", "target.fp8=true"],
            "target.fp8=true quantizes a random-weight target",
        ),
    ],
)
def test_cross_field_errors_name_the_key_before_any_model_loads(overrides, message, make_cfg, monkeypatch):
    from dflash.target.model import FrozenTarget

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        build_run(make_cfg(overrides))


@pytest.mark.parametrize("suffix", ["", "_t0.7"])
def test_a_plugin_variants_eval_figure_may_be_the_objective(suffix, make_cfg):
    """Each field a registered drafter's round tally reports is a per-benchmark eval figure
    `objective=` may name, greedy or at a temperature, as the built-in variants' are: a variant
    defined outside the package among them. A name no tally reports, or a per-position list
    (no number to optimise), is refused before anything loads."""
    from dflash.config.typed import typed_config
    from dflash.run.checks import validate
    from tests.test_variant_contract import MarginTally  # registers its variant, defined outside dflash/

    def checked(objective: str) -> None:
        cfg = typed_config(make_cfg([f"objective={objective}"]))
        validate(cfg, num_target_layers=36, target_vocab_size=262144, visible_cuda_devices=1)

    for name in (*MarginTally.reports, "confidence_tau", "selector_change_unary_frac"):
        checked(f"eval/gsm8k/{name}{suffix}")
    for refused in ("margin", "confidence_by_position"):
        with pytest.raises(ValueError, match="is not a summary metric"):
            checked(f"eval/gsm8k/{refused}{suffix}")


def test_a_variant_target_that_is_no_drafter_variant_is_refused_naming_the_key(make_cfg):
    """`variant._target_` must build a drafter variant (dflash/step/variant.py): any other class
    that takes the node's keys would pass every check and fail mid-run on a missing hook."""
    from dflash.config.typed import typed_config
    from dflash.run.checks import validate

    cfg = typed_config(make_cfg(["variant._target_=argparse.Namespace"]))
    with pytest.raises(ValueError, match=r"variant._target_='argparse.Namespace' is not a drafter variant"):
        validate(cfg, num_target_layers=36, target_vocab_size=262144, visible_cuda_devices=1)


def test_real_target_without_path_names_the_key(tmp_path):
    cfg = compose_config(["target=qwen3_8b", f"paths.output_dir={tmp_path}"])
    with pytest.raises(Exception, match="target.path"):
        build_run(cfg)


def test_wrong_architecture_at_path_is_refused(tiny_qwen3_dir, make_cfg):
    with pytest.raises(ValueError, match="expects target.model_type='qwen3_next'"):
        build_run(make_cfg(["target=qwen3_next_80b", f"target.path={tiny_qwen3_dir}"]))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("dflash.train", *args)


def test_cli_cfg_job_info_and_shell_completion():
    job = run_cli("--cfg", "job", "optimizer.lr=1e-3")
    assert job.returncode == 0, job.stderr
    assert "lr: 0.001" in job.stdout and "drafter:" in job.stdout
    tree = run_cli("--info", "defaults-tree")
    assert tree.returncode == 0, tree.stderr
    assert "drafter: tiny" in tree.stdout and "scheduler: interleave" in tree.stdout
    completion = run_cli("-sc", "install=bash")
    assert completion.returncode == 0 and "complete" in completion.stdout


def test_entry_module_does_not_import_torch():
    code = "import sys, dflash.train; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr


def test_benchmark_files_are_set_without_plus_and_free_form_dicts_take_any_key():
    from dflash.config.keys import refuse_unknown_keys
    from dflash.config.schema import Config

    cfg = compose_config(
        ["eval.benchmarks={gsm8k: g.jsonl, mbpp: m.jsonl}", "+target.chat_template_kwargs.x=1"]
    )
    assert dict(cfg.eval.benchmarks) == {"gsm8k": "g.jsonl", "mbpp": "m.jsonl"}
    refuse_unknown_keys(cfg, Config)  # benchmark names and template kwargs are the user's to choose


def test_regen_refuses_an_unknown_key(tmp_path):
    from hydra import compose, initialize_config_dir

    from dflash.config.schema import register_configs
    from dflash.tools.compose import CONF_DIR
    from dflash.tools.regen import regen

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="regen", overrides=["input=[a.jsonl]", "output=o.jsonl", "+sampling.temprature=0"]
        )
    with pytest.raises(ValueError, match="did you mean sampling.temperature"):
        regen(cfg)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda s: s.LossConfig(gamma=0.0), "loss.gamma must be > 0"),
        (lambda s: s.AdamWConfig(betas=[0.9, 1.0]), r"optimizer.betas must be two numbers in \[0, 1\)"),
        (lambda s: s.AdamWConfig(weight_decay=-0.1), "optimizer.weight_decay must be >= 0, got -0.1"),
        (lambda s: s.AdamWConfig(eps=-1e-8), "optimizer.eps must be >= 0"),
        (lambda s: s.AdamWConfig(weight_decay=float("nan")), "optimizer.weight_decay must be >= 0, got nan"),
        # The shared bound check (dflash/config/bounds.py) refuses nan, which compares false both ways.
        (lambda s: s.TrainConfig(epochs=float("nan")), "train.epochs must be >= 1, got nan"),
        # Built directly (no typed conversion before it), nan still fails the field's own rule.
        (
            lambda s: s.COMPONENT_OPTIONS["variant"]["dspark"](ce_weight=float("nan")),
            "variant.ce_weight=nan: must be >= 0",
        ),
        (
            lambda s: s.COMPONENT_OPTIONS["variant"]["dspark"](
                ce_weight=0, tv_weight=0, confidence_weight=0, confidence_head=False
            ),
            "variant=dspark with .* all 0 has no loss term",
        ),
        (
            lambda s: s.COMPONENT_OPTIONS["variant"]["dflash2"](selector_alpha=float("nan")),
            "variant.selector_alpha=nan: must be >= 0",
        ),
        (lambda s: s.MaskRampNoiseConfig(warmup_steps=0), "noise=mask_ramp needs noise.warmup_steps >= 1"),
        (lambda s: s.TrainConfig(epochs=0), "train.epochs must be >= 1"),
        (lambda s: s.GpuConfig(cpu_threads=0), "gpu.cpu_threads must be >= 1, got 0"),
        (lambda s: s.LoggerConfig(every_steps=0), "logger.every_steps must be >= 1, got 0"),
    ],
)
def test_a_single_field_rule_sits_beside_its_field(build, message):
    """A rule on one field is its dataclass's own: it holds wherever the config is built (a tool,
    a test, the typed conversion of a run's config), not only on the launcher's path."""
    from dflash.config import schema

    with pytest.raises(ValueError, match=message):
        build(schema)


def float_fields(schema: type, prefix: str) -> list[tuple[str, bool]]:
    """(dotted path, is a list) of every float field of a schema dataclass tree."""
    import dataclasses
    import typing

    found = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        kind, path = hints[field.name], f"{prefix}{field.name}"
        if dataclasses.is_dataclass(kind):
            found += float_fields(kind, f"{path}.")
        elif kind in (float, Optional[float], list[float]):
            found.append((path, kind == list[float]))
    return found


def option_float_settings() -> list[tuple[list[str], str, bool]]:
    """(overrides choosing the option, float path, is a list) for every group option's schema
    and the fixed groups' fields: every float a run config can hold."""
    from dflash.config.schema import COMPONENT_OPTIONS, Config

    fixed = [(path, is_list) for path, is_list in float_fields(Config, "") if path.split(".")[0] not in COMPONENT_OPTIONS]  # fmt: skip
    cases = [([], path, is_list) for path, is_list in fixed]
    for group, options in COMPONENT_OPTIONS.items():
        for option, schema in options.items():
            fields = float_fields(schema, f"{group}.")
            cases += [([f"{group}={option}"], path, is_list) for path, is_list in fields]
    return cases


def test_every_float_setting_refuses_nan_and_inf(tmp_path):
    """Hydra reads `nan` and `inf` as floats; no setting means either. Every float field of every
    option (the variants' weights, optimizer, LR schedule, loss, noise, pipeline, monitor, eval)
    is refused at the typed conversion, naming its key, before any field's own rule runs."""
    import copy

    from dflash.config.typed import typed_config

    cases = option_float_settings()
    paths = {path for _, path, _ in cases}
    assert {"variant.ce_weight", "variant.selector_alpha", "optimizer.lr", "eval.temperatures"} <= paths
    composed = {}
    for choice, path, is_list in cases:
        key = tuple(choice)
        if key not in composed:
            composed[key] = compose_config(choice, tmp_path / "run", tmp_path / "cache")
        typed_config(copy.deepcopy(composed[key]))  # the option's defaults are finite
        for bad in (float("nan"), float("inf"), float("-inf")):
            cfg = copy.deepcopy(composed[key])
            OmegaConf.update(cfg, path, [bad] if is_list else bad, merge=False)
            shown = f"{path}[0]" if is_list else path
            with pytest.raises(ValueError, match=re.escape(f"{shown}={bad}: must be a finite number")):
                typed_config(cfg)


def test_regen_refuses_a_non_finite_float(tmp_path):
    from hydra import compose, initialize_config_dir

    from dflash.config.schema import register_configs
    from dflash.tools.regen import regen

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["input=[a.jsonl]", "output=o.jsonl", "sampling.top_p=nan"]
        cfg = compose(config_name="regen", overrides=overrides)
    with pytest.raises(ValueError, match="sampling.top_p=nan: must be a finite number"):
        regen(cfg)


def formula_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """docs/ARCHITECTURE.md §1's formula as released drafters were trained with it."""
    if num_features == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (num_features - 1)) for i in range(num_features)]


def test_default_layer_ids_are_the_formulas_wherever_it_gives_distinct_ids():
    from dflash.drafters.layer_ids import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, the released drafters
    assert default_target_layer_ids(6, 2) == [1, 3]  # the tiny target, drafter=tiny
    kept = 0
    for layers in range(1, 130):
        for features in range(1, layers + 1):
            formula = formula_layer_ids(layers, features)
            if len(set(formula)) == features and all(0 <= i < layers for i in formula):
                assert default_target_layer_ids(layers, features) == formula, (layers, features)
                kept += 1
    assert kept > 7000


def test_default_layer_ids_on_shallow_targets_are_distinct_and_inside_the_target():
    from dflash.drafters.layer_ids import default_target_layer_ids

    assert default_target_layer_ids(6, 5) == [1, 2, 3, 4, 5]  # the formula: [1, 2, 2, 2, 3]
    assert default_target_layer_ids(4, 2) == [1, 3]  # the formula: [1, 1]
    assert default_target_layer_ids(4, 4) == [0, 1, 2, 3]
    for layers in range(1, 130):
        for features in range(1, layers + 1):
            ids = default_target_layer_ids(layers, features)
            assert len(set(ids)) == features and all(0 <= i < layers for i in ids), (layers, features, ids)
    with pytest.raises(ValueError) as refused:
        default_target_layer_ids(4, 5)
    assert str(refused.value) == (
        "the target has 4 layers and the drafter asks for 5 features (drafter.num_features=5), one distinct "
        "layer each: set drafter.num_features <= 4, or drafter.target_layer_ids to distinct ids in 0..3"
    )


def test_the_quickstart_train_command_on_the_demo_target_passes_the_checks(
    tmp_path, tiny_chat_dir, tiny_conversations, data_cache
):
    """docs/quickstart.md step 3 (target=hf, conversations, drafter=b16) on `dflash demo`'s
    6-layer target: the paper drafter's 5 features get distinct layers without a key set."""
    from dflash.run.preflight import check_before_loading

    overrides = ["target=hf", "drafter=b16", "drafter.mask_token_id=511"]
    overrides += conversation_overrides(tiny_chat_dir, [tiny_conversations])
    checked = check_before_loading(compose_config(overrides, tmp_path / "run", data_cache))
    assert checked.target_config.num_hidden_layers == 6 and checked.layer_ids == [1, 2, 3, 4, 5]


def test_a_four_layer_target_passes_the_checks_with_the_default_drafter(tmp_path, data_cache):
    from dflash.run.preflight import check_before_loading

    cfg = compose_config(["target.arch.num_hidden_layers=4"], tmp_path / "run", data_cache)
    assert check_before_loading(cfg).layer_ids == [1, 3]


@pytest.mark.parametrize(
    ("hidden", "top_k", "group"),
    [(64, 7, 16), (100, 9, 10), (271, 15, 1), (272, 16, 16), (576, 16, 16), (4096, 16, 16)],
)
def test_dflash2_defaults_follow_the_hidden_size_and_stay_servable(hidden, top_k, group):
    """variant.selector_top_k and conv_group_size null: the released 16 where it fits, else the
    nearest value every reader takes (llama.cpp: hidden >= K (K + 1); a group divides hidden)."""
    from transformers import Qwen3Config

    from dflash.config.shape_defaults import default_conv_group_size, default_selector_top_k
    from dflash.export.dflash2_rules import reader_limits
    from dflash.step.variant import DFlash2Variant

    def backbone(hidden_size: int) -> Qwen3Config:
        config = Qwen3Config(hidden_size=hidden_size, vocab_size=512)
        config.dflash_config = {"mask_token_id": 511, "target_layer_ids": [1]}
        return config

    assert (default_selector_top_k(hidden, 151936), default_conv_group_size(hidden)) == (top_k, group)
    config = DFlash2Variant().drafter_config(backbone(hidden))
    fields = config.dflash_config
    assert (fields["selector_top_k"], fields["conv_group_size"]) == (top_k, group)
    assert reader_limits(config.to_dict()) == []  # the export check's rule agrees
    if top_k < 16:  # the largest that fits: one more is what llama.cpp refuses
        assert reader_limits({"hidden_size": hidden, "dflash_config": {"selector_top_k": top_k + 1}})
    set_by_user = DFlash2Variant(selector_top_k=16, conv_group_size=4).drafter_config(backbone(hidden * 4))
    fields = set_by_user.dflash_config
    assert (fields["selector_top_k"], fields["conv_group_size"]) == (16, 4)
    assert default_selector_top_k(hidden, 3) == 3  # never above the vocabulary
