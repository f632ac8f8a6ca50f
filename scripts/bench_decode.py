"""Where the time of one speculative-decoding round goes, next to one plain decoding step.

    python scripts/bench_decode.py [--context 256] [--reps 50] [dflash-train overrides ...]

Builds the target and a drafter from the composed config (random weights: timing does not
depend on them), prefills `--context` tokens, then times with CUDA events on GPU (wall clock on
CPU), median over `--reps` after warm-up:

  plain step        one cached target forward of 1 token (+ the host read of its argmax)
  verify            one cached target forward of the block (B tokens) + cache crop back
  draft             one drafter forward for a block over the cached context (+ host read)
  context append    the drafter's context keys/values for one newly committed token
  round             draft + verify + append + acceptance, as speculative_generate runs it

A round costs `round / plain step` plain steps, so DFlash is faster once tau exceeds that ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timer(device: torch.device):
    def measure(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=50)
    args, overrides = parser.parse_known_args()

    from dflash.build import build_drafter, node, visible_cuda_devices
    from dflash.config.devices import resolve_device_split
    from dflash.config.validate import resolve_layer_ids
    from dflash.models.target import FrozenTarget, load_target_config
    from dflash.spec_decode import DrafterContext, TargetSession, TokenChooser, accepted_prefix
    from dflash.tools.compose import compose_config

    cfg = compose_config(
        [*overrides, "paths.output_dir=/tmp/bench_decode", "paths.cache_dir=/tmp/bench_decode"]
    )
    target_config = load_target_config(node(cfg, "target"))
    layer_ids = resolve_layer_ids(cfg, target_config.num_hidden_layers)
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])
    target = FrozenTarget.from_config(node(cfg, "target"), layer_ids, device)
    drafter = build_drafter(node(cfg, "drafter"), target_config, layer_ids, str(device))
    drafter = drafter.to(target.lm_head.weight.dtype).eval()
    block = drafter.block_size
    measure = timer(device)
    prompt = torch.randint(0, cfg.drafter.mask_token_id, (args.context,)).tolist()

    session = TargetSession(target)
    context = DrafterContext(drafter)
    _, features = session.run(prompt)
    context.extend(features)
    choose = TokenChooser(0.0, device)
    committed = len(session.ids)

    def plain_step():
        logits, _ = session.run([1])
        choose(logits)
        session.commit(committed)

    def verify():
        logits, _ = session.run([1] * block)
        choose(logits)
        session.commit(committed)

    def draft():
        context.draft(target, 1)

    one_feature = features[:, -1:]

    def append():
        kv, length = context.kv, context.length
        context.extend(one_feature)
        context.kv, context.length = kv, length

    def round_():
        kv, length = context.kv, context.length
        guess = context.draft(target, 1)
        logits, new_features = session.run([1, *guess])
        accepted = accepted_prefix(guess, choose(logits))
        session.commit(committed + accepted + 1)
        context.extend(new_features[:, : accepted + 1])
        session.commit(committed)
        context.kv, context.length = kv, length

    with torch.no_grad():
        rows = [
            ("plain step", measure(plain_step, args.reps)),
            (f"verify (B={block})", measure(verify, args.reps)),
            ("draft", measure(draft, args.reps)),
            ("context append", measure(append, args.reps)),
            ("round", measure(round_, args.reps)),
        ]
    plain = rows[0][1]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"\n{name}, {target_config.num_hidden_layers}-layer target, {drafter.config.num_hidden_layers}-layer "
        f"drafter, block {block}, context {args.context}, {str(target.lm_head.weight.dtype)[6:]}"
    )
    print(f"{'part':<16}{'ms':>9}{'x plain step':>14}")
    for part, ms in rows:
        print(f"{part:<16}{ms:>9.3f}{ms / plain:>14.2f}")
    print(f"DFlash is faster than plain decoding once tau > {rows[-1][1] / plain:.2f}")


if __name__ == "__main__":
    main()
