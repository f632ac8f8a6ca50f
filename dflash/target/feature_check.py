"""The start-up check of the target's captured features: one short forward before training.

A drafter trained on broken context features still "converges" (its loss falls on the block
tokens alone) and is then accepted by nothing. Other trainers' users shipped exactly that for
hybrid targets, whose capture returned zeros. So before the first step every captured layer's
features, over the first training sample, must be finite, not all zero, not the same vector at
every position (features that ignore the context), and of a root-mean-square inside
`RMS_RANGE`. The figures are logged and written to the run dir (`feature_check.json`, which
run.json includes); a failure is a refusal naming the layer.

Runs once, before any pipeline thread starts: its host reads are no hot-path sync.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Decoder-layer outputs of real models have per-token RMS from ~0.05 (early layers of small
# models) to a few hundred (late layers with massive activations); outside this range the
# capture or the weights are broken, not the model.
RMS_RANGE = (1e-4, 1e4)
# Tokens of the first sample the check runs (a short forward; the check reads no more).
CHECK_TOKENS = 256
REPORT_FILE = "feature_check.json"


@dataclass(frozen=True)
class LayerFeatures:
    layer: int  # decoder layer id (hidden_states[layer + 1])
    rms: float  # mean over positions of each position's root-mean-square
    max_abs: float
    non_finite: int  # count of NaN / inf values
    positions: int
    position_spread: float  # largest distance of a position's vector from the first position's

    def problem(self) -> str | None:
        if self.non_finite:
            return f"{self.non_finite} non-finite values"
        if self.max_abs == 0.0:
            return "all zero"
        if self.positions > 1 and self.position_spread == 0.0:
            return "the same vector at every position (features that do not depend on the context)"
        low, high = RMS_RANGE
        if not low <= self.rms <= high:
            return f"root-mean-square {self.rms:.3g}, outside [{low:g}, {high:g}]"
        return None


def measure(features_BSF: torch.Tensor, layer_ids: list[int]) -> list[LayerFeatures]:
    """Per captured layer: the fused [1, S, n * hidden] features split back into layers."""
    per_layer = features_BSF[0].float().chunk(len(layer_ids), dim=-1)
    stats = []
    for layer, values_SH in zip(layer_ids, per_layer):
        finite = torch.isfinite(values_SH)
        clean_SH = torch.where(finite, values_SH, torch.zeros_like(values_SH))
        stats.append(
            LayerFeatures(
                layer=layer,
                rms=float(clean_SH.pow(2).mean(dim=-1).sqrt().mean()),
                max_abs=float(clean_SH.abs().max()),
                non_finite=int((~finite).sum()),
                positions=values_SH.shape[0],
                position_spread=float((clean_SH - clean_SH[:1]).norm(dim=-1).max()),
            )
        )
    return stats


def check_target_features(
    *, features_of, input_ids: torch.Tensor, layer_ids: list[int], run_dir: Path | None, source: str
) -> list[LayerFeatures]:
    """Runs `features_of` (a target's `features`) on `input_ids` (one sample, [S]), writes the
    figures to `run_dir` (None: nowhere, as on ranks other than 0), logs them, and refuses broken
    features naming the layer and `source` (the target's config key and path)."""
    ids_BS = input_ids[:CHECK_TOKENS].to(torch.int64).unsqueeze(0)
    stats = measure(features_of(ids_BS), layer_ids)
    problems = [(s.layer, s.problem()) for s in stats if s.problem() is not None]
    report = {
        "tokens": ids_BS.shape[1],
        "layers": [asdict(s) for s in stats],
        "problems": [f"layer {layer}: {what}" for layer, what in problems],
    }
    if run_dir is not None:
        (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    log.info(
        "feature check (%d tokens): %s",
        ids_BS.shape[1],
        ", ".join(f"layer {s.layer} rms {s.rms:.3g} max {s.max_abs:.3g}" for s in stats),
    )
    if problems:
        layer, what = problems[0]
        figures = f" Every layer's figures: {run_dir / REPORT_FILE}" if run_dir is not None else ""
        raise ValueError(
            f"{source}: the target's features at layer {layer} (drafter.target_layer_ids) are {what} "
            f"over the first training sample's first {ids_BS.shape[1]} tokens; a drafter trained on them "
            f"would never be accepted.{figures}"
        )
    return stats
