"""`dflash-eval`: a target and an exported drafter -> tau, acceptance histogram, losslessness and
speedup per benchmark; a console table and a JSON report.

    dflash-eval target=qwen3_8b target.path=/models/Qwen3-8B gpu=single \\
        eval.drafter=outputs/.../checkpoints/last \\
        '+eval.benchmarks={gsm8k: prompts/gsm8k.jsonl, humaneval: prompts/humaneval.jsonl}' \\
        'eval.temperatures=[0,1]'

The drafter is any directory with config.json + model.safetensors in the z-lab layout (a dflash
checkpoint, or one written by other tools). It runs in the target's dtype (bf16 on GPU), as an
inference engine would run it. The JSON goes to `eval.output` (default <run dir>/eval.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash.config.schema import register_configs
from dflash.train import CONF_DIR

register_configs()
log = logging.getLogger(__name__)


def check_pairing(drafter_config: Any, target_config: Any, drafter_dir: Path, target_key: str) -> None:
    """Refuse a drafter trained for another target before any decoding."""
    problems = []
    if drafter_config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {drafter_config.hidden_size} vs {target_config.hidden_size}")
    num_target_layers = getattr(drafter_config, "num_target_layers", None)
    if num_target_layers is not None and num_target_layers != target_config.num_hidden_layers:
        problems.append(f"num_target_layers {num_target_layers} vs {target_config.num_hidden_layers}")
    layer_ids = drafter_config.dflash_config["target_layer_ids"]
    if max(layer_ids) >= target_config.num_hidden_layers:
        problems.append(f"target_layer_ids {layer_ids} beyond {target_config.num_hidden_layers} layers")
    if drafter_config.dflash_config["mask_token_id"] >= target_config.vocab_size:
        problems.append(f"mask_token_id {drafter_config.dflash_config['mask_token_id']} >= target vocab")
    if problems:
        raise ValueError(
            f"eval.drafter={drafter_dir} does not fit the target ({target_key}): {'; '.join(problems)}"
        )


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    import torch

    from dflash.build import eval_prompt_sets, node, visible_cuda_devices
    from dflash.checkpoint import load_drafter, read_drafter_config
    from dflash.config.validate import resolve_device_split
    from dflash.evaluate import evaluate
    from dflash.models.target import FrozenTarget, load_target_config

    if not cfg.eval.drafter:
        raise ValueError("eval.drafter must name a drafter directory (config.json + model.safetensors)")
    drafter_dir = Path(cfg.eval.drafter)
    target_cfg = node(cfg, "target")
    target_config = load_target_config(target_cfg)
    drafter_config = read_drafter_config(drafter_dir)
    target_key = f"target={target_cfg.name}" + (f", target.path={target_cfg.path}" if target_cfg.path else "")
    check_pairing(drafter_config, target_config, drafter_dir, target_key)
    prompt_sets = eval_prompt_sets(cfg, target_config.vocab_size, cfg.eval.num_prompts)
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])
    target = FrozenTarget.from_config(target_cfg, drafter_config.dflash_config["target_layer_ids"], device)
    drafter = load_drafter(drafter_dir, device).to(target.lm_head.weight.dtype).eval()
    eval_cfg = node(cfg, "eval")
    report = evaluate(target, drafter, prompt_sets, eval_cfg, timing=cfg.eval.timing)
    report.meta = {
        "drafter": str(drafter_dir),
        "target": target_key,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(target.lm_head.weight.dtype).removeprefix("torch."),
        "block_size": drafter.block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "kv_cache": "target KV cache + drafter context cache",
        "timing": "CUDA events" if device.type == "cuda" else "wall clock (CPU)",
    }
    output = Path(cfg.eval.output) if cfg.eval.output else Path(cfg.paths.output_dir) / "eval.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    payload = report.to_json()
    output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\n=== dflash-eval: {drafter_dir} on {target_key} ({report.meta['device_name']}) ===")
    print(report.table())
    line = report.lossless_line()
    if line is not None:
        print(f"lossless: {line}")
    print(f"report: {output}", flush=True)
    return payload


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run_eval(cfg)


if __name__ == "__main__":
    main()
