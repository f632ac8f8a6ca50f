"""Cross-field checks that run after composition and before any model weights load.

Each failure is a ValueError naming the dotted config key(s) involved. The schema already
rejects unknown keys, wrong types and unknown enum values at compose time, and a rule on one
field sits beside it (`__post_init__` of its dataclass in dflash/config/*_schema.py, run when the
composed config becomes typed); these are the rules that involve several fields, the target's
architecture or the visible devices.
"""

from __future__ import annotations

import re
from typing import Any

from dflash.config.bounds import at_least
from dflash.config.components import check_buildable, target_of
from dflash.config.devices import ProcessSlot, resolve_device_split
from dflash.config.schema import (
    AttentionKind,
    DataKind,
    DeviceKind,
    LayerType,
    pipeline_name,
)
from dflash.data.conversations import expand_files
from dflash.data.files import is_saved_dataset
from dflash.drafters.layer_ids import default_target_layer_ids
from dflash.eval.results import tallied_metric_names
from dflash.step.variant import DFlashVariant
from dflash.step.variant_registry import variant_figure_names

# A per-benchmark figure's key past greedy decoding: eval/<benchmark>/<name>_t<temperature>.
TEMPERATURE_SUFFIX = r"(_t[0-9.e+-]+)?"
# The numeric keys of summary.json (the run summary, the evaluation report's metrics, the role
# figures): what `objective` may name, besides the registered variants' own figures (their
# train/ and val/ figures, and their drafters' round tallies' eval/<benchmark>/ fields).
# tests/test_train.py checks a real summary against them.
OBJECTIVE_PATTERNS = (
    r"steps|resumed_from_step|wall_s|first_step_s|replicas|node_gpus|(target|drafter)_compiled_graphs",
    r"perf/(samples|tokens)_per_s",
    r"train/(loss|acc)(_first_window)?|train/tau_(sim|block|decode)",
    r"val/(loss|acc|tau_sim|tau_block|tau_decode)|val_samples",
    r"eval/(tau|num_prompts|lossless_frac|divergence_max_logit_gap)",
    r"eval/accept_len_\d+_frac",
    rf"eval/[^/]+/(tau|speedup|round_cost|prefill_ms){TEMPERATURE_SUFFIX}",
    r"roles/(target|drafter)_(busy_frac|s_per_batch)|roles/data_wait_frac",
)


def is_summary_metric(key: str) -> bool:
    if key.startswith(("train/", "val/")) and key.split("/", 1)[1] in variant_figure_names():
        return True  # a registered variant's own figure (dflash/step/variant.py: figure_names)
    tallied = "|".join(re.escape(name) for name in sorted(tallied_metric_names()))
    if tallied and re.fullmatch(rf"eval/[^/]+/({tallied}){TEMPERATURE_SUFFIX}", key):
        return True  # a registered drafter's round-tally field (dflash/drafters/round_tally.py: reports)
    return any(re.fullmatch(pattern, key) for pattern in OBJECTIVE_PATTERNS)


def resolve_layer_ids(cfg: Any, num_target_layers: int) -> list[int]:
    """drafter.target_layer_ids, or the default of docs/ARCHITECTURE.md §1 for drafter.num_features."""
    if cfg.drafter.target_layer_ids is not None:
        return list(cfg.drafter.target_layer_ids)
    return default_target_layer_ids(num_target_layers, cfg.drafter.num_features)


def validate(
    cfg: Any,
    *,
    num_target_layers: int,
    target_vocab_size: int,
    visible_cuda_devices: int,
    slot: ProcessSlot | None = None,
) -> None:
    validate_drafter(cfg, num_target_layers=num_target_layers, target_vocab_size=target_vocab_size)
    _validate_data(cfg)
    _validate_variant(cfg)
    slot = slot or ProcessSlot()
    targets, drafters = resolve_device_split(cfg, visible_cuda_devices, slot)
    sync = pipeline_name(cfg.pipeline) == "sync"
    if sync and slot.world_size > 1:
        raise ValueError(
            f"pipeline=sync runs in one process, but torchrun started WORLD_SIZE={slot.world_size}; "
            "use pipeline=async under torchrun"
        )
    if sync and (len(targets) != 1 or len(drafters) != 1):
        raise ValueError(
            f"pipeline=sync runs one target and one drafter; got gpu.target={cfg.gpu.target}, "
            f"gpu.drafter={cfg.gpu.drafter} ({len(targets)} + {len(drafters)} devices)"
        )
    if cfg.target.cuda_graphs < 0:
        raise ValueError(f"target.cuda_graphs={cfg.target.cuda_graphs}: a count of batch shapes, 0 for none")
    if cfg.target.cuda_graphs and cfg.gpu.device is DeviceKind.cpu:
        raise ValueError(
            f"target.cuda_graphs={cfg.target.cuda_graphs}: CUDA graphs need the target on a GPU; "
            "use target.cuda_graphs=0 with gpu=cpu"
        )
    if cfg.drafter.attention is AttentionKind.flex and cfg.gpu.device is DeviceKind.cpu:
        raise ValueError(
            "drafter.attention=flex trains on CUDA only (torch's CPU flex_attention has no backward); "
            "use drafter.attention=auto or sdpa with gpu=cpu"
        )
    if not is_summary_metric(cfg.objective):
        raise ValueError(
            f"objective={cfg.objective!r} is not a summary metric; use one of train/loss, train/acc, "
            "train/tau_sim, val/tau_sim, val/tau_decode, eval/tau, eval/lossless_frac, eval/<benchmark>/tau, eval/<benchmark>/speedup, "
            "roles/drafter_busy_frac, perf/samples_per_s, ... (the numeric keys of summary.json)"
        )


def _validate_data(cfg: Any) -> None:
    data = cfg.data
    if data.kind is DataKind.conversations:
        files = list(data.files)  # "???" raises here, naming data.files
        if not files:
            raise ValueError("data=conversations needs data.files=[...] (.jsonl / .json / .parquet files)")
        for path in expand_files(files, "data.files"):  # globs and directories expand here
            if not (path.is_file() or is_saved_dataset(path)):
                raise ValueError(f"data.files: no such file {str(path)!r}")
        if data.min_supervised_tokens < 2:
            raise ValueError(
                f"data.min_supervised_tokens must be >= 2 (an anchor needs a supervised next token), "
                f"got {data.min_supervised_tokens}"
            )
    edges = list(data.bucket_edges)
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 1:
        raise ValueError(f"data.bucket_edges must be positive and strictly increasing, got {edges}")
    if edges[-1] < data.max_length:
        raise ValueError(
            f"data.bucket_edges ends at {edges[-1]} < data.max_length={data.max_length}: "
            "the longest samples would have no bucket"
        )
    one_sample = min(cfg.drafter.num_anchors, data.max_length) * cfg.drafter.block_size
    if data.block_tokens_per_batch is not None and data.block_tokens_per_batch < one_sample:
        raise ValueError(
            f"data.block_tokens_per_batch={data.block_tokens_per_batch} is below one sample's blocks at "
            f"data.max_length: min(drafter.num_anchors={cfg.drafter.num_anchors}, {data.max_length}) x "
            f"drafter.block_size={cfg.drafter.block_size} = {one_sample}"
        )
    if data.tokens_per_batch < data.max_length:
        raise ValueError(
            f"data.tokens_per_batch={data.tokens_per_batch} < data.max_length={data.max_length}: "
            "a longest sample would not fit in a batch"
        )
    if not 1 <= data.prompt_len_min <= data.prompt_len_max:
        raise ValueError("data.prompt_len_min must be in [1, data.prompt_len_max]")
    if not 2 <= data.gen_len_min <= data.gen_len_max:
        raise ValueError("data.gen_len_min must be in [2, data.gen_len_max] (an anchor needs a next token)")
    if data.num_samples < 1:
        raise ValueError(f"data.num_samples must be >= 1, got {data.num_samples}")


def _validate_layer_types(drafter) -> None:
    """drafter.layer_types and drafter.sliding_window: one type per layer, and a window that
    holds a whole block (a sliding layer sees its own block bidirectionally, as every reader does:
    a window shorter than the block would cut the block's own keys at inference)."""
    if drafter.layer_types is None:
        if drafter.sliding_window is not None:
            raise ValueError(
                f"drafter.sliding_window={drafter.sliding_window} is set but no layer slides; "
                "set drafter.layer_types (e.g. [sliding_attention, ..., full_attention]) or drop it"
            )
        return
    if len(drafter.layer_types) != drafter.num_layers:
        raise ValueError(
            f"drafter.layer_types has {len(drafter.layer_types)} entries for "
            f"drafter.num_layers={drafter.num_layers}: give one per draft layer"
        )
    if LayerType.sliding_attention not in drafter.layer_types:
        return
    window = drafter.sliding_window
    if window is None or window < drafter.block_size:
        raise ValueError(
            f"drafter.sliding_window must be >= drafter.block_size={drafter.block_size} for the "
            f"sliding_attention layers in drafter.layer_types, got {window}"
        )


def validate_drafter(cfg: Any, *, num_target_layers: int, target_vocab_size: int) -> None:
    """The drafter's keys against the target: layer ids, mask id, block and layer settings (what
    the benchmark scripts check too, before they build anything)."""
    drafter = cfg.drafter
    layer_ids = resolve_layer_ids(cfg, num_target_layers)
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"drafter.target_layer_ids {layer_ids}: {bad} out of range for a target with "
            f"{num_target_layers} layers (valid: 0..{num_target_layers - 1})"
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"drafter.target_layer_ids {layer_ids} repeats a layer")
    if not 0 <= drafter.mask_token_id < target_vocab_size:
        raise ValueError(
            f"drafter.mask_token_id={drafter.mask_token_id} is outside the target's embedding rows "
            f"(target vocab_size {target_vocab_size}); pick an unused id below it"
        )
    if drafter.block_size < 2:
        raise ValueError(
            f"drafter.block_size must be >= 2 (anchor + at least one draft), got {drafter.block_size}"
        )
    for key in ("num_layers", "num_anchors"):
        at_least(f"drafter.{key}", getattr(drafter, key), 1)
    _validate_layer_types(drafter)


def _validate_variant(cfg: Any) -> None:
    """The variant's rules that reach outside its node, as its class states them
    (dflash/step/variant.py: `run_refusal`; those on its own keys are in its options'
    `__post_init__`). `_target_` must build a drafter variant: another class that takes the
    node's keys would pass here and fail mid-run on the first hook it lacks."""
    variant_class = check_buildable(cfg.variant, "variant")
    if not (isinstance(variant_class, type) and issubclass(variant_class, DFlashVariant)):
        raise ValueError(
            f"variant._target_={target_of(cfg.variant, 'variant')!r} is not a drafter variant "
            "(a dflash.step.variant.DFlashVariant subclass, registered with register_variant)"
        )
    refusal = variant_class.run_refusal(variant=cfg.variant, noise=cfg.noise, loss=cfg.loss)
    if refusal is not None:
        raise ValueError(refusal)
