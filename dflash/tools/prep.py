"""`dflash prep`: build (or find) the tokenized training data a `dflash train` with the same
overrides will use, and print what went in and what was skipped.

    dflash prep data=conversations data.files=[chat.jsonl] target=qwen3_8b target.path=/models/Qwen3-8B

Takes the training config (same data, target and paths groups), so the cache it writes is the
one training reads: the training run then starts without tokenizing anything.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dflash.config.schema import register_configs
from dflash.tools.hydra_app import hydra_command

register_configs()


def prep(cfg: DictConfig) -> dict:
    from dflash.config.typed import typed_config
    from dflash.run.inputs import load_training_data

    config = typed_config(cfg)
    dataset, stats = load_training_data(config)
    print(f"\n=== dflash prep: data={config.data.name} ({config.data.kind.value}) ===")
    if stats is not None:
        print("\n".join(stats.lines()))
    print(f"samples              {len(dataset)}, longest {int(dataset.lengths.max())} tokens", flush=True)
    return {"samples": len(dataset), "stats": stats}


main = hydra_command(
    prep,
    tool="dflash prep",
    summary="Tokenize the training data a `dflash train` with the same overrides will read, "
    "and say what went in\nand what was skipped.",
    config_name="config",
    overrides=(
        "data=conversations data.files=[chat.jsonl]   conversation files (JSON, JSONL, Parquet, .zst)",
        "target=hf target.path=/models/MyModel        the target whose tokenizer and template apply",
        "data.max_length=4096                         longer samples are cut",
    ),
)


if __name__ == "__main__":
    main()
