"""What a run reads besides the models: the training samples and the evaluation prompt sets,
from config. Shared by the run builder and the tools (dflash-prep, dflash-eval, the schedule
report), so each reads them exactly as training does.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from dflash.config.components import check_buildable
from dflash.config.schema import Config, DataKind, EvalConfig, TargetConfig
from dflash.data.chat import ChatRenderer, load_chat_renderer
from dflash.data.conversations import expand_files
from dflash.data.dataset import TokenDataset
from dflash.data.files import source_digest
from dflash.data.identity import data_identity
from dflash.data.prepare import PrepStats, load_or_prepare
from dflash.data.synthetic import load_or_generate
from dflash.errors import exit_for_user_error
from dflash.eval.prompt_sets import PromptSet, load_prompt_sets
from dflash.run.checks import resolve_layer_ids, validate_drafter
from dflash.target.gguf import local_target
from dflash.target.model import FrozenTarget, load_target_config, resolve_dtype

log = logging.getLogger(__name__)


def local_target_config(cfg: Config) -> TargetConfig:
    """`target` with a GGUF path (a file or `package:<name>`) replaced by its converted
    transformers directory under paths.cache_dir (converted the first time)."""
    return local_target(cfg.target, cfg.paths.cache_dir)


def frozen_target(cfg: Config, device: torch.device | str) -> tuple[FrozenTarget, list[int]]:
    """The run's frozen target on `device`, as dflash-train builds it (a GGUF path converted
    once under paths.cache_dir), and the layer ids its features come from. The benchmark and
    check scripts build their target with it, so they measure the target a run trains with."""
    target_cfg = local_target_config(cfg)
    config = load_target_config(target_cfg)
    device = torch.device(device)
    # What dflash-train checks first, and a target that cannot fit: one line (ValueError), not
    # an IndexError deep in a forward or the OOM killer.
    validate_drafter(cfg, num_target_layers=config.num_hidden_layers, target_vocab_size=config.vocab_size)
    refuse_what_cannot_fit(target_cfg, config, device)
    layer_ids = resolve_layer_ids(cfg, config.num_hidden_layers)
    return FrozenTarget.from_config(
        target_cfg, layer_ids, device, final_state=needs_final_state(cfg)
    ), layer_ids


def needs_final_state(cfg: Config) -> bool:
    """Whether the run's drafter variant reads the target's final hidden state (variant=dspark):
    its `_target_` class says (dflash/step/variant.py)."""
    return bool(getattr(check_buildable(cfg.variant, "variant"), "needs_final_state", False))


def script_target(cfg: Config, device: torch.device | str, script: str) -> tuple[FrozenTarget, list[int]]:
    """`frozen_target` for a benchmark or check script: a refusal is its one line and exit 2,
    as dflash-train's."""
    try:
        return frozen_target(cfg, device)
    except ValueError as exc:
        exit_for_user_error(script, str(exc))


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refuse_what_cannot_fit(target_cfg: TargetConfig, config, device: torch.device) -> None:
    """The target's weights (counted on the meta device, in the dtype it loads in) must fit in
    the device's free memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target.fp8 import is_fp8_checkpoint, weight_bytes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    # FP8 weights stay FP8 where they run: a random target.fp8 target anywhere, an FP8
    # checkpoint on CUDA (elsewhere transformers dequantizes it at load).
    fp8 = target_cfg.fp8 or (
        device.type == "cuda"
        and target_cfg.path is not None
        and is_fp8_checkpoint(AutoConfig.from_pretrained(target_cfg.path))
    )
    needed = weight_bytes(model, itemsize=resolve_dtype(target_cfg.dtype, device).itemsize, fp8=fp8)
    free = available_bytes(device)
    if needed > free:
        raise ValueError(
            f"target={target_cfg.name}: {params / 1e9:.2f}B parameters need {needed / 2**30:.1f} GiB on {device}, "
            f"which has {free / 2**30:.1f} GiB free; choose a smaller target (target.arch.num_hidden_layers=..., "
            "target=tiny) or another device"
        )


def load_training_data(
    cfg: Config, target: FrozenTarget | None = None
) -> tuple[TokenDataset, PrepStats | None]:
    """The samples `cfg.data` describes, from the cache when it holds them.

    synthetic: written by `target` the first time (a CPU copy when None: tools that only need
    the data); the drafter's mask id never appears in a generated prompt. conversations:
    rendered and tokenized from `data.files` (no model needed).
    """
    data_cfg, target_cfg = cfg.data, local_target_config(cfg)
    if data_cfg.kind is DataKind.synthetic:
        if target is None:
            target, _ = frozen_target(cfg, "cpu")
        dataset = load_or_generate(
            target, target_cfg, data_cfg, Path(cfg.paths.cache_dir), [cfg.drafter.mask_token_id]
        )
        return dataset, None
    renderer = load_chat_renderer(target_cfg, "data.kind=conversations")
    dataset, stats = load_or_prepare(renderer, data_cfg, Path(cfg.paths.cache_dir))
    # Text data: the mask id must be a token the tokenizer never produces (a reserved special).
    holding_mask = int((dataset.input_ids == cfg.drafter.mask_token_id).sum())
    if holding_mask:
        raise ValueError(
            f"drafter.mask_token_id={cfg.drafter.mask_token_id} occurs {holding_mask} times in the "
            f"training data (data.files={list(data_cfg.files)}); pick an id the tokenizer never produces"
        )
    return dataset, stats


def training_data_identity(cfg: Config, dataset: TokenDataset) -> dict:
    """What this run trains on (dflash/data/identity.py), recorded in every checkpoint."""
    files, template = None, None
    if cfg.data.kind is DataKind.conversations:
        paths = expand_files(list(cfg.data.files), "data.files")
        # A save_to_disk directory is one source: its files' names and digests, hashed in order.
        files = [{"path": str(path), "sha256": source_digest(path)} for path in paths]
        template = load_chat_renderer(local_target_config(cfg), "data.kind=conversations").fingerprint()
    return data_identity(dataset, kind=cfg.data.kind.value, files=files, template=template)


def eval_prompts_description(eval_cfg: EvalConfig) -> str:
    """What the evaluation decodes, in the words the run summary, summary.json (`eval/prompts`)
    and the model card use: the benchmarks' names (eval.benchmarks), else random-token prompts
    (`load_prompt_sets`), which are new to the drafter but unlike any conversation trained on."""
    if eval_cfg.benchmarks:
        return "prompts of " + ", ".join(sorted(eval_cfg.benchmarks))
    return "random-token prompts"


def eval_prompt_sets(
    cfg: Config,
    target_cfg: TargetConfig,
    vocab_size: int,
    mask_token_id: int,
    limit: int,
    context_len: int | None = None,
) -> list[PromptSet]:
    """The evaluation prompts: `eval.benchmarks` files (the target's chat template), else random
    token prompts (never holding the drafter's mask id). context_len: the target's positions
    (max_position_embeddings); the longest prompt + eval.max_new_tokens must fit in it."""
    eval_cfg = cfg.eval
    for key in ("num_prompts", "periodic_num_prompts", "max_new_tokens"):
        if getattr(eval_cfg, key) < 1:
            raise ValueError(f"eval.{key} must be >= 1, got {getattr(eval_cfg, key)}")
    temperatures = list(eval_cfg.temperatures)
    if not temperatures or any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise ValueError(
            f"eval.temperatures must be a non-empty list of finite values >= 0 (0: greedy), got {temperatures}"
        )

    def renderer() -> ChatRenderer:
        return load_chat_renderer(target_cfg, "eval.benchmarks")

    if not eval_cfg.benchmarks and cfg.data.kind is DataKind.conversations:
        log.warning(
            "eval.benchmarks is empty: tau is measured on %s, unlike the conversations in "
            "data.files; set 'eval.benchmarks={name: prompts.jsonl}'",
            eval_prompts_description(eval_cfg),
        )

    sets = load_prompt_sets(eval_cfg, renderer, vocab_size, [mask_token_id], limit)
    if context_len is not None:
        longest = max((len(p), s.name) for s in sets for p in s.prompts)
        if longest[0] + eval_cfg.max_new_tokens > context_len:
            raise ValueError(
                f"eval.max_new_tokens={eval_cfg.max_new_tokens} + the longest prompt ({longest[0]} tokens, "
                f"{longest[1]}) exceeds the target's {context_len} positions (max_position_embeddings); "
                f"lower eval.max_new_tokens to at most {context_len - longest[0]}"
            )
    return sets
