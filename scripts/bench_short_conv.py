#!/usr/bin/env python
"""A Gated DeltaNet layer's short causal convolution, transformers' PyTorch reference against
flash-linear-attention's Triton kernel (target.fla_short_conv), at one layer's shape.

    python scripts/bench_short_conv.py [--batch 4] [--seq-len 3072] [--channels 8192] [--kernel 4]

Defaults: Qwen3-Next-80B-A3B's DeltaNet layer (q, k: 16 heads x 128, v: 32 heads x 128 = 8192
channels), 4 samples of 3072 tokens, bf16, SiLU. Both sides through the binding the target uses
(`FlaShortConv` and the function it replaces), [batch, channels, time] in and out; per call the
median of --repeat isolated calls and the mean of --repeat calls back to back (CUDA events)
after --warmup, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.target.short_conv import FUNCTION, FlaShortConv  # noqa: E402
from dflash.tools.timing import back_to_back_ms, median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_short_conv.py times CUDA kernels: no CUDA device is visible")
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    current = getattr(modeling, FUNCTION)
    reference = current.reference if isinstance(current, FlaShortConv) else current
    fla = FlaShortConv(reference)
    device = torch.device("cuda")
    # The layer's layout: [batch, time, channels] transposed to [batch, channels, time].
    x = torch.randn(args.batch, args.seq_len, args.channels, device=device, dtype=torch.bfloat16).transpose(
        1, 2
    )
    weight = torch.randn(args.channels, args.kernel, device=device, dtype=torch.bfloat16) / 2
    rows = ["| convolution | ms per call (isolated) | ms per call (back to back) |", "|---|---|---|"]
    outputs = {}
    for name, function in (("transformers' PyTorch reference", reference), ("flash-linear-attention", fla)):
        call = functools.partial(function, x, weight, None, activation="silu")
        outputs[name] = call()
        isolated = median_ms(call, warmup=args.warmup, repeat=args.repeat, device=device)
        streamed = back_to_back_ms(call, repeat=args.repeat, device=device)
        rows.append(f"| {name} | {isolated:.3f} | {streamed:.3f} |")
    first, second = outputs.values()
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; [{args.batch}, {args.seq_len}, "
        f"{args.channels}] bf16, kernel {args.kernel}, SiLU; median of {args.repeat} after {args.warmup}\n"
    )
    print("\n".join(rows))
    print(f"\nlargest difference {(first.float() - second.float()).abs().max().item():.5f}")


if __name__ == "__main__":
    main()
