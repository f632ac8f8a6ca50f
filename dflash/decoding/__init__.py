"""Decoding at GPU speed: the target and the drafter over static KV caches, forward steps
replayed as CUDA graphs, and continuous batching for regeneration.

Every decoding path of the project (plain and speculative decoding in `dflash.spec_decode`,
`dflash-eval`, `scripts/bench_decode.py`, in-process `dflash-regen`) runs on these pieces when
the target is a full-attention decoder (`static_decoding_refusal`); hybrid targets keep the exact
dynamic-cache path.
"""
