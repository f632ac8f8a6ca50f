"""The training step's paths by name, as config overrides: the reference and each fast part on top.

`reference` is what every fast part is tested against (SDPA with the dense mask, full logits
through autograd, eager layers); each next variant adds one part: `fused` the chunked LM-head
loss, `flex` block-sparse flex_attention, `compiled` torch.compile of the drafter (all of
them: the CUDA default); `compiled_static` compiles it for exact shapes. scripts/bench_step.py
times them; scripts/check_fast_path.py trains them side by side.
"""

from __future__ import annotations

STEP_VARIANTS: dict[str, list[str]] = {
    "reference": ["drafter.attention=sdpa", "loss.logits_chunk=0", "drafter.compile=false"],
    "fused": ["drafter.attention=sdpa", "drafter.compile=false"],
    "flex": ["drafter.attention=flex", "drafter.compile=false"],
    "compiled": ["drafter.attention=flex", "drafter.compile=true"],
    # The same graph compiled for the batch's exact shapes (torch's default) instead of symbolic ones.
    "compiled_static": ["drafter.attention=flex", "drafter.compile=true", "drafter.compile_dynamic=null"],
}
