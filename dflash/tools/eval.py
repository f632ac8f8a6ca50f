"""`dflash eval`: a target and an exported drafter -> tau, acceptance histogram, losslessness and
speedup per benchmark; a console table and a JSON report.

    dflash eval ckpt=outputs/.../checkpoints/last gpu=single \\
        'eval.benchmarks={gsm8k: prompts/gsm8k.jsonl, humaneval: prompts/humaneval.jsonl}' \\
        'eval.temperatures=[0,1]'

`ckpt` is any directory with config.json + model.safetensors in the z-lab layout. A dflash
checkpoint also holds its run's config.yaml: the target is then the one the drafter was trained
against, unless `target...` is overridden on the command line (a z-lab export from other tools
needs `target=... target.path=...`). The drafter runs in the target's dtype (bf16 on GPU), as an
inference engine would run it. The JSON goes to `eval.output` (default <run dir>/eval.json).

A progress bar per benchmark goes to stderr. SIGTERM or SIGINT (a time limit) ends the evaluation
after the prompt being decoded: the report covers the prompts finished, says `interrupted`, and
the process exits with 128 + signal, so a long run cut short still tells what it measured. Each
prompt's outcome also goes, as it finishes, to a journal beside the report (eval.prompts.jsonl):
the same command with `eval.resume=true` (and the same report path) decodes only the prompts the
journal lacks and reports over all of them (dflash/eval/journal.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from dflash.config.schema import Config, EvalConfig, TargetConfig, VerifyRule, register_configs
from dflash.tools.hydra_app import hydra_command

if TYPE_CHECKING:  # torch and the evaluation load once the arguments parse
    import torch

    from dflash.drafters.backbone import DFlashDrafter
    from dflash.eval.evaluate import Decoders
    from dflash.eval.journal import EvalJournal
    from dflash.eval.results import EvalReport
    from dflash.target.model import FrozenTarget

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
        raise ValueError(f"ckpt={drafter_dir} does not fit the target ({target_key}): {'; '.join(problems)}")


def check_same_target(drafter_dir: Path, target_cfg: TargetConfig, target_key: str) -> None:
    """A checkpoint that records its target by content (target.json) is evaluated against that
    target only: a same-shape target with other weights decodes, and accepts about nothing."""
    from dflash.target.target_identity import pairing_differences

    differences = pairing_differences(drafter_dir, target_cfg)
    if differences:
        raise ValueError(
            f"ckpt={drafter_dir} was trained on another target than {target_key} ({', '.join(differences)}); "
            "evaluate it against its own target, or set eval.check_target=false to measure it here anyway"
        )


def target_for(
    cfg: DictConfig,
    *,
    typed: Config,
    ckpt: Path,
    target_overridden: bool,
    target_fields: tuple[str, ...] = (),
) -> tuple[TargetConfig, str]:
    """The target to evaluate against, and where that choice came from.

    target_overridden (`target=NAME` on the command line): the command line's target. Otherwise
    the checkpoint's run config names it, amended by `target_fields`, the keys (under `target.`)
    the command line overrides (e.g. dtype, for target.dtype=float32: an exact lossless check)."""
    from dflash.target.gguf import local_target
    from dflash.trainer.checkpoint import RUN_CONFIG_FILE

    run_config = ckpt / RUN_CONFIG_FILE
    if target_overridden or not run_config.is_file():
        return local_target(typed.target, typed.paths.cache_dir), "command line"
    try:
        trained_with = OmegaConf.load(run_config).target
        merged = OmegaConf.merge(OmegaConf.structured(TargetConfig), trained_with)
    except Exception as exc:  # a hand-edited or foreign config.yaml
        raise ValueError(f"ckpt={ckpt}: {RUN_CONFIG_FILE} has no usable target section ({exc})") from exc
    source = str(run_config)
    for key in target_fields:  # each takes the command line's composed value
        OmegaConf.update(merged, key, OmegaConf.select(cfg, f"target.{key}"), merge=False)
    if target_fields:
        source += " + command line " + ", ".join(f"target.{key}" for key in target_fields)
    return local_target(OmegaConf.to_object(merged), typed.paths.cache_dir), source


@dataclass(frozen=True)
class EvalInputs:
    drafter_dir: Path
    drafter_config: Any
    target_cfg: TargetConfig
    target_key: str
    target_source: str  # where the target was chosen: the command line or the run's config.yaml
    prompt_sets: list


def eval_inputs(
    composed: DictConfig, cfg: Config, *, tool: str, target_overridden: bool, target_fields: tuple[str, ...]
) -> EvalInputs:
    """The drafter (`ckpt`), the target it is paired with (checked) and the prompt sets to
    decode: what `dflash eval` and `dflash served` read from the same overrides."""
    from dflash.export.zlab import read_drafter_config
    from dflash.run.inputs import eval_prompt_sets
    from dflash.target.model import load_target_config

    if not cfg.ckpt:
        raise ValueError(f"{tool} needs ckpt=DIR, a drafter directory (config.json + model.safetensors)")
    drafter_dir = Path(cfg.ckpt)
    drafter_config = read_drafter_config(drafter_dir)
    target_cfg, target_source = target_for(
        composed,
        typed=cfg,
        ckpt=drafter_dir,
        target_overridden=target_overridden,
        target_fields=target_fields,
    )
    target_config = load_target_config(target_cfg)
    target_key = f"target={target_cfg.name}" + (f", target.path={target_cfg.path}" if target_cfg.path else "")
    log.info("%s: %s (from %s)", tool, target_key, target_source)
    check_pairing(drafter_config, target_config, drafter_dir, target_key)
    if cfg.eval.check_target:
        check_same_target(drafter_dir, target_cfg, target_key)
    mask_id = drafter_config.dflash_config["mask_token_id"]
    prompt_sets = eval_prompt_sets(
        cfg,
        target_cfg,
        target_config.vocab_size,
        mask_id,
        cfg.eval.num_prompts,
        getattr(target_config, "max_position_embeddings", None),
    )
    return EvalInputs(drafter_dir, drafter_config, target_cfg, target_key, target_source, prompt_sets)


class PromptProgress:
    """One tqdm bar per benchmark and temperature on stderr (`evaluate`'s on_prompt): a long
    evaluation shows that it moves and how far it got."""

    def __init__(self) -> None:
        self.bar = None
        self.key: tuple[str, float] | None = None

    def __call__(self, benchmark: str, temperature: float, done: int, total: int) -> None:
        from tqdm import tqdm

        if (benchmark, temperature) != self.key:
            self.close()
            self.key = (benchmark, temperature)
            self.bar = tqdm(total=total, desc=f"dflash eval {benchmark} t={temperature:g}", unit="prompt", mininterval=2.0)  # fmt: skip
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def journal_settings(
    eval_cfg: Any, *, drafter_dir: Path, target_cfg: TargetConfig, device: Any
) -> dict[str, Any]:
    """What a prompt's outcome depends on, recorded in the journal: a resume under other settings
    is refused. The target by content (dflash.target.target_identity, as resume and pairing compare it),
    the drafter by its files' digests. The prompt count and the benchmarks are not among them: a
    resume may add prompts (the first 47 of a benchmark decoded, then all 80) or benchmarks."""
    from dflash.digest import file_digest
    from dflash.target.target_identity import target_identity

    return {
        "drafter": {name: file_digest(drafter_dir / name) for name in ("config.json", "model.safetensors")},
        "target": target_identity(target_cfg),
        "dtype": target_cfg.dtype,
        "device": device.type,
        "max_new_tokens": eval_cfg.max_new_tokens,
        "seed": eval_cfg.seed,
        "sampled_drafts": eval_cfg.sampled_drafts,
        "verify": VerifyRule(eval_cfg.verify).value,
        "compile_decoding": eval_cfg.compile_decoding,
    }


def _refuse_with_timing(eval_cfg: EvalConfig, journal: EvalJournal) -> None:
    """Options that measure no time of one decoder refused beside eval.timing; a resumed journal logged."""
    if eval_cfg.timing and eval_cfg.decode_streams > 1:
        raise ValueError(
            f"eval.decode_streams={eval_cfg.decode_streams} decodes prompts side by side, so no time "
            "would be one decoder's; set eval.timing=false (or eval.decode_streams=1 to time)"
        )
    if journal.resumed:
        if eval_cfg.timing:
            raise ValueError("eval.resume: a resumed evaluation measures no time; set eval.timing=false")
        log.info("dflash eval: %d prompt outcomes taken from %s", journal.resumed, journal.path)


def _report_meta(
    cfg: Config,
    inputs: EvalInputs,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    decoded_here: int,
    journal: EvalJournal,
    seconds: float,
) -> dict[str, Any]:
    """What the report measured and on what: the drafter, target, device and decoding settings,
    and this process's share of the decoding."""
    import torch

    return {
        "drafter": str(inputs.drafter_dir),
        "target": inputs.target_key,
        "target_from": inputs.target_source,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        # what a temperature > 0 result measures: sampled or argmax drafts, and the verification rule
        "sampled_drafts": cfg.eval.sampled_drafts,
        "verify": VerifyRule(cfg.eval.verify).value,
        "kv_cache": "target KV cache + drafter context cache",
        "timing": "CUDA events" if device.type == "cuda" else "wall clock (CPU)",
        # This process's decoding (not the prompts taken from the journal): its wall time, warm-up
        # and reference batches included; what an evaluation costs, not a speed of either decoder.
        "decoded_here": decoded_here,
        "taken_from_journal": journal.taken,
        "wall_s": round(seconds, 2),
    }


def _write_report(
    report: EvalReport, output: Path, *, drafter_dir: Path, target_key: str, journal: EvalJournal
) -> dict[str, Any]:
    """The report written to `output` as JSON (returned) and printed as a table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    payload = report.to_json()
    output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\n=== dflash eval: {drafter_dir} on {target_key} ({report.meta['device_name']}) ===")
    print(report.table())
    print(
        f"evaluation: {report.meta['decoded_here']} prompt decodings in {report.meta['wall_s']:.1f} s"
        + (f", {journal.taken} taken from {journal.path}" if journal.taken else "")
    )
    line = report.lossless_line()
    if line is not None:
        print(f"lossless: {line}")
    print(f"report: {output} (each prompt's outcome: {journal.path})", flush=True)
    return payload


def _load_decoders(
    cfg: Config, inputs: EvalInputs, device: torch.device
) -> tuple[FrozenTarget, DFlashDrafter, Decoders]:
    """The target, the drafter in the target's dtype, and decoders sized for the prompt sets."""
    from dflash.eval.evaluate import Decoders
    from dflash.export.zlab import load_drafter
    from dflash.target.model import FrozenTarget

    target = FrozenTarget.from_config(
        inputs.target_cfg, inputs.drafter_config.dflash_config["target_layer_ids"], device
    )
    drafter = load_drafter(inputs.drafter_dir, device).to(target.lm_head.weight.dtype).eval()
    decoders = Decoders.for_prompts(
        target,
        drafter,
        inputs.prompt_sets,
        cfg.eval,
        reference_slots=cfg.eval.reference_slots,
        decode_streams=cfg.eval.decode_streams,
    )
    return target, drafter, decoders


def run_eval(
    cfg: DictConfig, target_overridden: bool = False, target_fields: tuple[str, ...] = ()
) -> dict[str, Any]:
    import torch

    from dflash.config.devices import resolve_device_split
    from dflash.config.keys import refuse_unknown_keys
    from dflash.config.typed import typed_config
    from dflash.distributed import visible_cuda_devices
    from dflash.eval.evaluate import evaluate, planned_decodings
    from dflash.eval.journal import EvalJournal, journal_path
    from dflash.trainer.signals import StopRequested, stop_on_signals

    refuse_unknown_keys(cfg, Config)
    composed, cfg = cfg, typed_config(cfg)
    inputs = eval_inputs(
        composed, cfg, tool="dflash eval", target_overridden=target_overridden, target_fields=target_fields
    )
    drafter_dir, target_cfg = inputs.drafter_dir, inputs.target_cfg
    target_key, prompt_sets = inputs.target_key, inputs.prompt_sets
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])
    output = Path(cfg.eval.output) if cfg.eval.output else Path(cfg.paths.output_dir) / "eval.json"
    journal = EvalJournal(
        journal_path(output),
        journal_settings(cfg.eval, drafter_dir=drafter_dir, target_cfg=target_cfg, device=device),
        resume=cfg.eval.resume,
    )
    try:
        _refuse_with_timing(cfg.eval, journal)
        if device.type == "cpu":
            torch.set_num_threads(cfg.gpu.cpu_threads)
        target, drafter, decoders = _load_decoders(cfg, inputs, device)
        progress = PromptProgress()
        started = time.perf_counter()
        with stop_on_signals() as stop:
            try:
                report = evaluate(
                    target,
                    drafter,
                    prompt_sets,
                    cfg.eval,
                    timing=cfg.eval.timing,
                    should_stop=stop.is_set,
                    decoders=decoders,
                    on_prompt=progress,
                    journal=journal,
                )
            finally:
                progress.close()
        seconds = time.perf_counter() - started
    finally:
        journal.close()
    report.meta = _report_meta(
        cfg,
        inputs,
        device=device,
        dtype=target.lm_head.weight.dtype,
        block_size=drafter.block_size,
        decoded_here=report.decodings() - journal.taken,
        journal=journal,
        seconds=seconds,
    )
    payload = _write_report(report, output, drafter_dir=drafter_dir, target_key=target_key, journal=journal)
    if report.interrupted:
        log.warning(
            "dflash eval: stopped by a signal after %d of %d prompt decodings; %s holds what was evaluated",
            report.decodings(),
            planned_decodings(prompt_sets, cfg.eval),
            output,
        )
        raise StopRequested(stop.signum)
    return payload


def eval_job(cfg: DictConfig) -> dict:
    """What `dflash eval` runs on the composed config, with what the command line says of the target."""
    return run_eval(cfg, **target_overrides())


def target_overrides() -> dict[str, Any]:
    """What the command line says of the target (`target_for`'s target_overridden and
    target_fields), read from Hydra's record of the overrides."""
    from hydra.core.hydra_config import HydraConfig

    keys = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]
    return {
        "target_overridden": "target" in keys,
        "target_fields": tuple(k.removeprefix("target.") for k in keys if k.startswith("target.")),
    }


main = hydra_command(
    eval_job,
    tool="dflash eval",
    summary="Decode prompts with a target and an exported drafter: tau, acceptance histogram, "
    "losslessness and\nspeedup per benchmark, as a table and a JSON report.",
    config_name="config",
    overrides=(
        "ckpt=outputs/RUN/checkpoints/last                 the drafter (its run's target by default)",
        "target=hf target.path=/models/MyModel gpu=single  a drafter exported by other tools",
        "eval=humaneval_mtbench eval.num_prompts=64        benchmarks and how many prompts",
        "'eval.temperatures=[0,1]'                          greedy and sampled decoding",
    ),
)


if __name__ == "__main__":
    main()
