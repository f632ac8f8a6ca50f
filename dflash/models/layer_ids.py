"""Which target layers feed the drafter (pure Python: used by config validation before any load)."""

from __future__ import annotations


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """docs/ARCHITECTURE.md §1: one feature -> the middle layer; else evenly spread over [1, N - 3].

    Qwen3-8B (36 layers) with 5 features -> [1, 9, 17, 25, 33]. Ids index decoder layers, so with
    HF `output_hidden_states=True` layer i is `hidden_states[i + 1]`.
    """
    if num_features < 1:
        raise ValueError(f"drafter.num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_features - 1)) for i in range(num_features)]
