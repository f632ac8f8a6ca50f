"""Which target layers feed the drafter (pure Python: used by config validation before any load)."""

from __future__ import annotations


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """docs/ARCHITECTURE.md §1: one feature -> the middle layer; else evenly spread over [1, N - 3].

    Qwen3-8B (36 layers) with 5 features -> [1, 9, 17, 25, 33]. Ids index decoder layers, so with
    HF `output_hidden_states=True` layer i is `hidden_states[i + 1]`.

    A target with fewer than n + 3 layers has too few layers in [1, N - 3] for n distinct ids
    (6 layers, 5 features: the formula gives [1, 2, 2, 2, 3]); there the ids spread the same way
    over [1, N - 1], or over every layer [0, N - 1] when that is still too narrow (6 layers, 5
    features -> [1, 2, 3, 4, 5]; 4 layers, 4 features -> [0, 1, 2, 3]). Wherever the formula's
    ids are distinct and inside the target they are kept as they are: released drafters were
    trained on them. More features than the target has layers is refused, naming the keys.
    """
    if num_features < 1:
        raise ValueError(f"drafter.num_features must be >= 1, got {num_features}")
    if num_features > num_target_layers:
        raise ValueError(
            f"the target has {num_target_layers} layers and the drafter asks for {num_features} "
            f"features (drafter.num_features={num_features}), one distinct layer each: set "
            f"drafter.num_features <= {num_target_layers}, or drafter.target_layer_ids to distinct ids "
            f"in 0..{num_target_layers - 1}"
        )
    if num_features == 1:
        return [num_target_layers // 2]
    ids = _spread(1, num_target_layers - 3, num_features)
    if len(set(ids)) == num_features and all(0 <= i < num_target_layers for i in ids):
        return ids
    # Shallow targets: the last layers join first (layer 0, the embedding's neighbour, carries
    # the least context), then layer 0.
    low = 1 if num_target_layers - 1 >= num_features else 0
    return _spread(low, num_target_layers - 1, num_features)


def _spread(low: int, high: int, count: int) -> list[int]:
    """`count` ids evenly spread from `low` to `high`, rounded (distinct when the band holds at
    least `count` layers: the step is then >= 1)."""
    return [round(low + i * (high - low) / (count - 1)) for i in range(count)]
