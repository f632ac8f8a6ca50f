"""`dflash regen`: the target writes the replies of a conversation set (conf/regen.yaml).

Resumable: rerun the same command after an interruption and it continues where it stopped.
"""

from __future__ import annotations

import json
import os
import signal

from omegaconf import DictConfig, OmegaConf

from dflash.config.schema import RegenBackend, RegenConfig, register_configs
from dflash.data.conversations import record_layout
from dflash.tools.hydra_app import hydra_command
from dflash.trainer.signals import StopRequested, on_signals

register_configs()


def build_backend(cfg: RegenConfig):
    from dflash.regen.backends import HttpBackend, TransformersBackend

    if RegenBackend(cfg.backend) is RegenBackend.http:
        if not cfg.url:
            raise ValueError("backend=http needs url=http://HOST:PORT/v1 (an OpenAI-compatible server)")
        return HttpBackend(
            url=cfg.url,
            model=cfg.model,
            api_key=cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            sampling=cfg.sampling,
            concurrency=cfg.batch_size,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            chat_template_kwargs=dict(cfg.target.chat_template_kwargs),
        )
    import torch

    from dflash.data.chat import load_chat_renderer
    from dflash.target.gguf import local_target
    from dflash.target.model import FrozenTarget, load_target_config

    target_cfg = local_target(cfg.target, cfg.paths.cache_dir)  # cfg: the typed RegenConfig
    renderer = load_chat_renderer(target_cfg, "dflash regen")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_layers = load_target_config(target_cfg).num_hidden_layers
    target = FrozenTarget.from_config(target_cfg, [num_layers - 1], device)
    return TransformersBackend(
        target,
        renderer,
        cfg.sampling,
        slots=cfg.batch_size,
        max_len=cfg.max_len,
        graphs=cfg.cuda_graphs,
        compile=cfg.compile,
    )


class RegenStopped(StopRequested):
    def __str__(self) -> str:
        return (
            f"stopped by {signal.Signals(self.signum).name}; the conversations written so far stay, "
            "and rerunning the same command continues"
        )


def stop_by_raising():
    """SIGTERM / SIGINT end regen at once with RegenStopped (the run record then says
    INTERRUPTED, the exit code is 128 + signal); the output keeps every line already written."""

    def stop(signum, frame):
        raise RegenStopped(signum)

    return on_signals(stop)


def write_summary(stats) -> None:
    """summary.json in the job dir: the run record (run.json) takes the counts from it."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        path = os.path.join(HydraConfig.get().runtime.output_dir, "summary.json")
        with open(path, "w") as handle:
            json.dump(stats.summary(), handle, indent=2)


def regen(cfg: DictConfig):
    from pathlib import Path

    from dflash.config.keys import refuse_unknown_keys
    from dflash.config.typed import refuse_non_finite
    from dflash.regen.regenerate import RegenStats, refuse_output_among_inputs, regenerate

    refuse_unknown_keys(cfg, RegenConfig)
    refuse_non_finite(cfg)
    typed: RegenConfig = OmegaConf.to_object(cfg)
    if typed.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {typed.batch_size}")
    if typed.max_len <= typed.sampling.max_new_tokens:
        raise ValueError(
            f"max_len={typed.max_len} must exceed sampling.max_new_tokens={typed.sampling.max_new_tokens} "
            "(it holds the prompt and the reply)"
        )
    if not 0.0 <= typed.max_failed_frac <= 1.0:
        raise ValueError(f"max_failed_frac must be in [0, 1], got {typed.max_failed_frac}")
    refuse_output_among_inputs(list(typed.input), Path(typed.output))  # before the target loads
    stats = RegenStats()
    try:
        with stop_by_raising():
            backend = build_backend(typed)
            regenerate(
                backend,
                list(typed.input),
                Path(typed.output),
                typed.batch_size,
                typed.limit,
                stats=stats,
                layout=record_layout(typed.layout),
            )
    finally:  # the counts reach the run record however regen ends
        write_summary(stats)
    print(f"\n=== dflash regen -> {typed.output} (backend={backend.name}; {backend.describe()}) ===")
    print("\n".join(stats.lines()), flush=True)
    if stats.attempted() and stats.failed > typed.max_failed_frac * stats.attempted():
        raise ValueError(
            f"{stats.failed} of {stats.attempted()} conversations failed (more than max_failed_frac="
            f"{typed.max_failed_frac}); the {stats.written} that succeeded are in {typed.output}, and "
            "rerunning the same command retries the others"
        )
    return stats


main = hydra_command(
    regen,
    tool="dflash regen",
    summary="The target writes the assistant replies of a conversation set, turn by turn "
    "(training data in the\ntarget's own words). Resumable: rerun the same command after an interruption.",
    config_name="regen",
    overrides=(
        "target=hf target.path=/models/MyModel input=[chat.jsonl] output=regen.jsonl",
        "backend=http url=http://localhost:8000/v1 model=NAME     a running vLLM / SGLang server",
        "batch_size=64 sampling.max_new_tokens=1024 limit=1000   replies at once, their length, how many",
    ),
)


if __name__ == "__main__":
    main()
