"""Every registered drafter variant through the stages past training, by the one interface
(dflash/models/drafter.py) and the registry (dflash/models/variants.py): both decoders lossless
at fp32 greedy, drafting the same tokens round by round and reporting the same per-round
figures; its native export read back as the same class with the same weights and the same
drafts. Among them a variant defined here, outside the package and registered through the public
`register_drafter`: a new head needs nothing edited inside dflash/ to decode and export."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from dflash.decoding import engine, reference
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import plain_generate, speculative_generate
from dflash.export.zlab import export_drafter, load_drafter
from dflash.models.drafter import DFlashDrafter
from dflash.models.variants import register_drafter, registered_drafters
from tests.test_dflash2_decoding import RoundRecorder, prompt_of
from tests.test_dflash2_export import tiny_dflash2
from tests.test_dflash_rules import tiny_drafter, tiny_drafter_config, tiny_target
from tests.test_dspark_export import tiny_dspark
from tests.test_export_bytes import moved
from tests.test_lilicorr import tiny_lilicorr


@register_drafter
class MarginDrafter(DFlashDrafter):
    """A trivial head: DFlash's drafts, and beside them each draft's logit margin over the
    runner-up (what a confidence head would learn to predict), recorded per round."""

    variant_name: ClassVar[str] = "test_margin"
    display_name: ClassVar[str] = "Margin"
    round_extra: ClassVar[str | None] = "margin"

    @classmethod
    def describes(cls, config: Any) -> bool:
        return bool(getattr(config, "dflash_config", {}).get("margin_drafts"))

    @torch.no_grad()
    def draft_block(self, lm_head, hidden_1BH, anchor_1, choose):
        logits_PV = lm_head(hidden_1BH.to(lm_head.weight.dtype))[0, 1:].float()
        top = logits_PV.topk(2, dim=-1).values
        return choose(logits_PV), top[:, 0] - top[:, 1]

    def add_round_figures(self, result: Any, extra: list | None, **outcome: Any) -> None:
        if extra is not None:
            result.__dict__.setdefault("margins", []).append(extra)


def margin_drafter(target) -> MarginDrafter:
    config = tiny_drafter_config(target)
    config.dflash_config["margin_drafts"] = True
    torch.manual_seed(1)
    return moved(MarginDrafter(config))


MAKERS = {
    "dflash": lambda target: moved(tiny_drafter(target)),
    "dspark": tiny_dspark,
    "dflash2": tiny_dflash2,
    "lilicorr": tiny_lilicorr,
    "test_margin": margin_drafter,
}


def test_every_registered_variant_is_in_the_contract():
    assert set(registered_drafters()) == set(MAKERS)


def decode(target, drafter, monkeypatch, prompts) -> tuple[list, list]:
    """Each prompt through both decoders (checked lossless against plain greedy); the rounds
    each settled and their results."""
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    ours_rounds, static_rounds = RoundRecorder(monkeypatch, reference), RoundRecorder(monkeypatch, engine)
    results = []
    for prompt in prompts:
        plain = plain_generate(target, prompt, 20).output_ids
        ours = speculative_generate(target, drafter, prompt, 20)
        static = decoder.speculative(prompt, 20)
        assert ours.output_ids == plain and static.output_ids == plain
        assert ours.acceptance_lengths == static.acceptance_lengths
        assert all(1 <= n <= drafter.verify_len for n in ours.acceptance_lengths)
        results.append((ours, static))
    assert static_rounds.rounds == ours_rounds.rounds and ours_rounds.rounds
    assert all(len(draft) == drafter.drafts_per_block for draft, _ in ours_rounds.rounds)
    monkeypatch.undo()
    return ours_rounds.rounds, results


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_variant_decodes_losslessly_alike_and_exports_round_trip(name, monkeypatch, tmp_path):
    target = tiny_target()
    drafter = MAKERS[name](target).eval()
    prompts = [prompt_of(seed, 6 + 5 * seed) for seed in range(2)]
    rounds, results = decode(target, drafter, monkeypatch, prompts)
    if name == "test_margin":  # the hook ran: an out-of-package variant's figures are recorded
        assert all(len(ours.margins) == len(ours.acceptance_lengths) for ours, _ in results)
    for ours, static in results:
        # The variant's own per-round figures reach both decoders' results alike.
        for figure in ("confidence", "selector_changed", "margins"):
            mine, theirs = getattr(ours, figure, []), getattr(static, figure, [])
            torch.testing.assert_close(torch.tensor(theirs), torch.tensor(mine))
    export_drafter(drafter, tmp_path / name)
    loaded = load_drafter(tmp_path / name).eval()
    assert type(loaded) is type(drafter)
    saved, back = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    # The export reads back into a drafter that drafts the same tokens, round by round.
    recorder = RoundRecorder(monkeypatch, reference)
    for prompt in prompts:
        speculative_generate(target, loaded, prompt, 20)
    assert recorder.rounds == rounds
