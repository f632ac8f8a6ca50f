"""Several prompts speculatively decoded at once: one StaticDecoder per prompt, side by side.

A batch-1 DFlash round of a small target is a chain of small kernels (launch-bound on a GPU), so
one decoder leaves the GPU mostly idle. Here each of N decoders has its own caches, CUDA graphs
and CUDA stream, and decodes one prompt in a thread of its own; kernels of different streams run
on the GPU together, and a thread waiting on its round's one transfer lets the others launch.
Every decoder runs the kernels one decoder runs alone, on the same shapes, so each prompt's
tokens and acceptance lengths are those of decoding it alone (tested against the one-at-a-time
path). The decoders share the target's weights; each adds its own KV cache and drafter copy.

Graphs are captured up front in the calling thread (`capture_every_shape`), so no thread
captures; a decoder that needed a new shape would capture it in thread-local mode
(dflash.decoding.graphs). Each decoder captures on a stream of its own: graphs captured on one
stream share its cuBLAS scratch memory, which two of them replayed at once would both write.
If a thread fails, the others finish the prompt they hold, then the failure (the first in
prompt order) is raised in the caller with its own traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import DecodeResult
from dflash.decoding.settings import DecodeSettings
from dflash.drafters.backbone import DFlashDrafter


class SideBySideDecoders:
    """`decoders[i]` decodes the i-th prompt of a `speculative` call, on `streams[i]` (None on CPU).
    `sampled_drafts`: StaticDecoder.speculative's, for every call."""

    def __init__(self, decoders: Sequence[StaticDecoder], *, sampled_drafts: bool = False):
        if not decoders:
            raise ValueError("SideBySideDecoders needs at least one decoder")
        self.decoders = list(decoders)
        self.sampled_drafts = sampled_drafts
        device = self.decoders[0].target.device
        # A graphed decoder replays on the stream its graphs were captured on, which no other
        # decoder's graphs share (their cuBLAS scratch with it: dflash.decoding.graphs).
        self.streams = [
            decoder.stream or (torch.cuda.Stream(device=device) if device.type == "cuda" else None)
            for decoder in self.decoders
        ]

    @property
    def width(self) -> int:
        """Prompts decoded at once."""
        return len(self.decoders)

    def load_drafter_weights(self, drafter: DFlashDrafter) -> None:
        for decoder in self.decoders:
            decoder.load_drafter_weights(drafter)

    def speculative(
        self, prompts: Sequence[list[int]], settings: Sequence[DecodeSettings]
    ) -> list[DecodeResult]:
        """`StaticDecoder.speculative` of each prompt with its settings (a seed of its own, say),
        at most `width` of them, in the order given."""
        if len(prompts) != len(settings) or len(prompts) > self.width:
            raise ValueError(f"{len(prompts)} prompts and {len(settings)} settings for {self.width} decoders")

        caller = torch.cuda.current_stream(self.streams[0].device) if self.streams[0] is not None else None

        def decode(index: int) -> DecodeResult:
            stream = self.streams[index]
            if stream is not None:  # after the caller's queued work (e.g. new drafter weights)
                stream.wait_stream(caller)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return self.decoders[index].speculative(
                    prompts[index], settings[index], sampled_drafts=self.sampled_drafts
                )

        if len(prompts) == 1:
            results = [decode(0)]
        else:
            with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="dflash-decode") as pool:
                futures = [pool.submit(decode, index) for index in range(len(prompts))]
                results = [future.result() for future in futures]
        if caller is not None:  # the caller's later work (the same decoders, alone) after theirs
            for stream in self.streams[: len(prompts)]:
                caller.wait_stream(stream)
        return results
