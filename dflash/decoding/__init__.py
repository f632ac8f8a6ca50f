"""Decoding at GPU speed: the target and the drafter over static KV caches, forward steps
replayed as CUDA graphs, and continuous batching for regeneration.

Every decoding path of the project (plain and speculative decoding in `dflash.decoding.reference`,
`dflash-eval`, `scripts/bench_decode.py`, in-process `dflash-regen`) runs on these pieces for
every supported family, hybrid Gated DeltaNet targets included (`static_decoding_refusal`); only
a sliding-window target keeps the exact dynamic-cache path.
"""
