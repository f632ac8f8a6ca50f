"""`dflash served`: an exported drafter served by a real engine (llama.cpp) beside dflash's own
decoder, on the prompts `dflash eval` decodes with the same overrides: served tau, acceptance
per draft position and tokens/s next to dflash's, per benchmark, and per prompt whether the two
target outputs and the accepted drafts agree.

    bash scripts/build_llamacpp.sh          # once: llama.cpp 11434.0.0 into ~/.cache/dflash/llama.cpp/
    dflash served ckpt=outputs/run/checkpoints/last eval=humaneval_mtbench eval.num_prompts=80

The drafter and target are converted by llama.cpp's own converter (the drafter with
`--target-model-dir`) into <run dir>/served/, and `llama-server` serves them on 127.0.0.1 with
`--spec-draft-n-max` set to the drafter's block (B-1 drafts for DFlash and DFlash2, B for DSpark).
Greedy only (eval.temperatures is not read), float32 on both sides, one prompt at a time. The
engine runs on the CPU with `gpu.cpu_threads` threads; dflash's decoder runs where `gpu` says
(gpu=cpu, the default, with the same threads; gpu=single on a GPU, float32 matmuls without TF32,
and the engine's request for a prompt sent while the GPU decodes it).
The JSON goes to <run dir>/served.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from dflash.config.schema import Config, register_configs
from dflash.tools.hydra_app import hydra_command

register_configs()
log = logging.getLogger(__name__)


def table(results: list) -> str:
    rows = [
        f"{'benchmark':<14}{'prompts':>8}{'own tau':>9}{'(engine rules)':>15}{'served tau':>11}"
        f"{'own tok/s':>10}{'served tok/s':>13}{'same output':>12}{'drafts agree':>13}"
    ]
    for r in results:
        same = r.same_output
        rows.append(
            f"{r.benchmark:<14}{len(r.prompts):>8}{r.own_tau:>9.3f}{r.own.tau:>15.3f}{r.served.tau:>11.3f}"
            f"{r.own_tokens_per_s:>10.1f}{r.served_tokens_per_s:>13.1f}{len(same):>12}"
            f"{sum(p.drafts_agree for p in same):>13}"
        )
        rows.append(f"  accepted by position, own:    {r.position_shares('own')}")
        rows.append(f"  accepted by position, served: {r.position_shares('served')}")
    return "\n".join(rows)


def write_report(cfg: DictConfig, *, engine: str, drafter_dir: Path, target_key: str, results: list) -> dict:
    """served.json and the printed table with each benchmark's verdict."""
    from dflash.serving.measure import DRAFT_TOLERANCE, TAU_TOLERANCE

    payload = {
        "engine": engine,
        "drafter": str(drafter_dir),
        "target": target_key,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "tolerance": {"differing_drafts_share": DRAFT_TOLERANCE, "tau_relative": TAU_TOLERANCE},
        "benchmarks": [r.to_json() for r in results],
    }
    output = Path(cfg.paths.output_dir) / "served.json"
    output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\n=== dflash served: {drafter_dir} on {target_key}, {engine} ===")
    print(table(results))
    for r in results:
        verdict = "within tolerance" if r.within_tolerance else "OUTSIDE tolerance: a fault on one side"
        print(f"{r.benchmark}: {verdict}")
    print(f"report: {output}", flush=True)
    return payload


def run_served(cfg: DictConfig, *, target_overridden: bool, target_fields: tuple[str, ...]) -> dict:
    import torch

    from dflash.config.devices import resolve_device_split
    from dflash.config.keys import refuse_unknown_keys
    from dflash.config.typed import typed_config
    from dflash.distributed import visible_cuda_devices
    from dflash.drafters.drafter_registry import drafter_class_for
    from dflash.eval.evaluate import target_eos_ids
    from dflash.export.zlab import load_drafter
    from dflash.serving.llamacpp import find_build, spec_type_for
    from dflash.serving.measure import measure_benchmark
    from dflash.serving.server import LlamaServer
    from dflash.target.model import FrozenTarget
    from dflash.tools.eval import eval_inputs

    refuse_unknown_keys(cfg, Config)
    composed, cfg = cfg, typed_config(cfg)
    inputs = eval_inputs(
        composed, cfg, tool="dflash served", target_overridden=target_overridden, target_fields=target_fields
    )
    # Before the conversions: a device this machine lacks is named at once.
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])
    drafter_dir, drafter_config, target_cfg = inputs.drafter_dir, inputs.drafter_config, inputs.target_cfg
    spec_type = spec_type_for(drafter_class_for(drafter_config))  # one llama.cpp cannot load: said first
    build = find_build()
    target_key, prompt_sets = inputs.target_key, inputs.prompt_sets
    if not target_cfg.path:
        raise ValueError(
            "target.path: the engine serves a checkpoint directory; a random-init target has none"
        )
    work = Path(cfg.paths.output_dir) / "served"
    work.mkdir(parents=True, exist_ok=True)
    target_gguf = build.convert(Path(target_cfg.path), work / "target.gguf")
    drafter_gguf = build.convert(drafter_dir, work / "drafter.gguf", target_dir=Path(target_cfg.path))
    if device.type == "cpu":
        torch.set_num_threads(cfg.gpu.cpu_threads)
    # The engine's float32 is full float32: TF32 matmuls on a GPU would part the two target
    # outputs at every near-tie.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # Loaded in float32, not rounded through target.dtype=auto's bfloat16 on a GPU.
    target_cfg = dataclasses.replace(target_cfg, dtype="float32")
    target = FrozenTarget.from_config(target_cfg, drafter_config.dflash_config["target_layer_ids"], device)
    drafter = load_drafter(drafter_dir, device).float().eval()
    drafts = drafter.drafts_per_block
    longest = max(len(p) for s in prompt_sets for p in s.prompts)
    results = []
    with LlamaServer(
        build,
        target_gguf=target_gguf,
        drafter_gguf=drafter_gguf,
        spec_type=spec_type,
        draft_max=drafts,
        context=longest + cfg.eval.max_new_tokens + drafts + 2,
        threads=cfg.gpu.cpu_threads,
        log_path=work / "llama-server.log",
    ) as server:
        for prompt_set in prompt_sets:
            results.append(
                measure_benchmark(
                    prompt_set.name,
                    prompt_set.prompts,
                    target=target,
                    drafter=drafter,
                    serve=server.complete,
                    max_new_tokens=cfg.eval.max_new_tokens,
                    drafts_per_round=drafts,
                    stop_ids=target_eos_ids(target),
                    overlap=device.type == "cuda",
                )
            )
    return write_report(
        cfg,
        engine=f"llama.cpp {build.root.name}",
        drafter_dir=drafter_dir,
        target_key=target_key,
        results=results,
    )


def served_job(cfg: DictConfig) -> dict:
    """What `dflash served` runs on the composed config, with what the command line says of the target."""
    from dflash.tools.eval import target_overrides

    return run_served(cfg, **target_overrides())


main = hydra_command(
    served_job,
    tool="dflash served",
    summary="Serve an exported drafter with llama.cpp beside dflash's own decoder on the same prompts:\n"
    "served and own tau, acceptance per draft position, tokens/s and per-prompt agreement.",
    config_name="config",
    overrides=(
        "ckpt=outputs/RUN/checkpoints/last                 the drafter (its run's target by default)",
        "target=hf target.path=/models/MyModel             a drafter exported by other tools",
        "eval=humaneval_mtbench eval.num_prompts=80        benchmarks and how many prompts",
        "gpu.cpu_threads=8                                 threads for llama.cpp (and dflash's decoder on a CPU)",
        "gpu=single                                        dflash's decoder on the GPU (the engine stays on the CPU)",
    ),
)


if __name__ == "__main__":
    main()
