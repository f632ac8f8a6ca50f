"""In-process regeneration speed: continuous batching on static caches (CUDA graphs on GPU)
against transformers' generate() batches (the path hybrid targets keep), side by side.

    python scripts/bench_regen.py --continuous 712 --generate 128 \
        target=smollm2_135m input=[conversations.json] sampling.temperature=0 \
        sampling.max_new_tokens=384 batch_size=128 [dflash-regen overrides ...]

Runs `dflash-regen`'s own code (dflash.regen.regenerate) on the first `--continuous`
conversations, then on the first `--generate` with the generate() batches (0: skip), each into
a fresh file under --workdir, and prints conversations, replies, reply tokens, seconds and
generated tokens/s per path (start-up, graph captures and prefills included), plus how many
replies of the conversations both paths wrote are identical.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def compose_regen(overrides: list[str]):
    from omegaconf import OmegaConf

    from dflash.tools.compose import compose_config

    return OmegaConf.to_object(compose_config(overrides, config_name="regen"))


def replies(path: Path) -> dict[str, list[str]]:
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["source"]] = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--continuous", type=int, default=712, help="conversations (continuous batching)")
    parser.add_argument("--generate", type=int, default=128, help="conversations (generate batches; 0: skip)")
    parser.add_argument("--workdir", default="/tmp/bench_regen")
    args, overrides = parser.parse_known_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    typed = compose_regen(
        [*overrides, f"output={workdir / 'unused.jsonl'}", f"paths.output_dir={workdir}"]
        + ([] if any(o.startswith("paths.cache_dir=") for o in overrides) else [f"paths.cache_dir={workdir}"])
    )

    from dflash.regen.regenerate import regenerate
    from dflash.tools.regen import build_backend

    backend = build_backend(typed)
    rows = []
    for label, count in (("continuous batching", args.continuous), ("generate() batches", args.generate)):
        if count <= 0:
            continue
        if label.startswith("generate"):
            backend.batcher = None
        output = workdir / f"{label.split()[0].rstrip('()')}.jsonl"
        started = time.perf_counter()
        stats = regenerate(backend, list(typed.input), output, typed.batch_size, limit=count)
        seconds = time.perf_counter() - started
        rows.append((label, stats, seconds, output))
    print(
        f"\n{backend.describe()}, batch_size={typed.batch_size}, max_new_tokens={typed.sampling.max_new_tokens}"
    )
    print(f"{'path':<22}{'conv':>7}{'replies':>9}{'tokens':>10}{'seconds':>9}{'tokens/s':>10}")
    for label, stats, seconds, _ in rows:
        rate = stats.generated_tokens / seconds
        print(
            f"{label:<22}{stats.written:>7}{stats.replies:>9}{stats.generated_tokens:>10}{seconds:>9.1f}{rate:>10.0f}"
        )
    if len(rows) == 2:
        (_, fast, fast_s, fast_out), (_, slow, slow_s, slow_out) = rows
        ratio = (fast.generated_tokens / fast_s) / (slow.generated_tokens / slow_s)
        print(f"continuous / generate tokens/s: {ratio:.1f}x")
        a, b = replies(fast_out), replies(slow_out)
        common = [s for s in b if s in a]
        same = sum(a[s] == b[s] for s in common)
        print(f"conversations written by both: {len(common)}, all replies identical in {same}")


if __name__ == "__main__":
    main()
