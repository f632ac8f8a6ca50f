"""Variant defaults that follow the target's shape (pure Python: config checks, the variant and
the export checks read the same rules).

A default fixed for the published targets can make every small target's drafter unservable, or
refused for a key the user never set. Where a schema field is null, these pick the published value
wherever it fits and the nearest value that does elsewhere; a value the user sets is kept as set.
"""

from __future__ import annotations

# The released DFlash2 drafters' (z-lab/Qwen3.8-27B-DFlash2) and speculators' defaults.
RELEASED_CONV_GROUP_SIZE = 16
RELEASED_SELECTOR_TOP_K = 16


def selector_fits_llama_cpp(hidden_size: int, top_k: int) -> bool:
    """llama.cpp's loader refuses a DFlash2 drafter whose hidden size is below K (K + 1) ("too small
    for the selector lattice"); SGLang and vLLM serve it."""
    return hidden_size >= top_k * (top_k + 1)


def largest_servable_top_k(hidden_size: int) -> int:
    """The largest K with K (K + 1) <= hidden_size: what llama.cpp still loads (hidden 64 -> 7)."""
    top_k = 1
    while selector_fits_llama_cpp(hidden_size, top_k + 1):
        top_k += 1
    return top_k


def default_selector_top_k(hidden_size: int, vocab_size: int) -> int:
    """variant.selector_top_k=null: 16, the released drafters' K, where the hidden size holds its
    lattice (>= 16 x 17 = 272); below that the largest K that llama.cpp still loads, so a small
    target's drafter stays servable everywhere. Never above the vocabulary."""
    top_k = min(RELEASED_SELECTOR_TOP_K, largest_servable_top_k(hidden_size))
    return max(1, min(top_k, vocab_size))


def default_conv_group_size(hidden_size: int) -> int:
    """variant.conv_group_size=null: 16, the released drafters' group, where it divides the hidden
    size (every reader requires a divisor); else the largest divisor of the hidden size below 16
    (hidden 100 -> 10)."""
    return next(g for g in range(RELEASED_CONV_GROUP_SIZE, 0, -1) if hidden_size % g == 0)
