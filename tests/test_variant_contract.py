"""Every registered drafter variant through the stages past training, by the one interface
(dflash/drafters/backbone.py) and the registry (dflash/drafters/drafter_registry.py): both decoders lossless
at fp32 greedy, drafting the same tokens round by round and reporting the same per-round
figures; its native export read back as the same class with the same weights and the same
drafts; every layout it declares (dflash/export/export_registry.py) written, checked, read back, warm
started from (`drafter.init_from`) and converted to its other layouts and back. Among them a
variant defined here, outside the package and registered through the public `register_drafter`
and `register_export`: a new head needs nothing edited inside dflash/ to decode and export."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from dflash.config.variant_schema import BUILT_IN_VARIANTS
from dflash.decoding import engine, reference
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import plain_generate, speculative_generate
from dflash.decoding.settings import DecodeSettings
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import register_drafter, registered_drafters
from dflash.eval.evaluate import Decoders
from dflash.eval.journal import EvalJournal
from dflash.eval.prompt_sets import PromptSet
from dflash.eval.results import BenchmarkResult, EvalReport
from dflash.export import export_registry as registry
from dflash.export.contract import check_export
from dflash.export.export_registry import export_for, layout_of, register_export, registered_exports
from dflash.export.rules import VariantExport
from dflash.export.zlab import (
    export_drafter,
    load_drafter,
    load_drafter_weights,
    read_drafter_config,
    write_layout,
)
from dflash.run.checks import is_summary_metric
from dflash.run.resume import warm_starts_new_parts
from dflash.tools.export import LAYOUTS
from dflash.tools.export import main as export_main
from tests.test_dflash2_decoding import RoundRecorder, prompt_of
from tests.test_dflash2_export import same_weights, tiny_dflash2
from tests.test_dflash_rules import tiny_drafter, tiny_drafter_config, tiny_target
from tests.test_dspark_decoding import evaluated
from tests.test_dspark_export import tiny_dspark
from tests.test_export_bytes import DRAFTERS, moved
from tests.test_lilicorr import tiny_lilicorr


class MarginTally:
    """The Margin head's round figure over an evaluation: the mean margin of the drafts the
    target accepted and of those it rejected (a margin worth reading separates the two)."""

    figures: ClassVar[tuple[str, ...]] = ("margins",)
    reports: ClassVar[tuple[str, ...]] = ("margin_accepted", "margin_rejected")

    def __init__(self, drafts: int):
        self.accepted: list[float] = []
        self.rejected: list[float] = []

    def add(self, result: Any) -> None:
        for margins, accepted in zip(result.round_figures.get("margins", []), result.accepted_drafts):
            self.accepted += margins[:accepted]
            self.rejected += margins[accepted:]

    def fields(self) -> dict[str, Any]:
        if not self.accepted and not self.rejected:
            return {}
        return {
            "margin_accepted": round(sum(self.accepted) / len(self.accepted), 4) if self.accepted else None,
            "margin_rejected": round(sum(self.rejected) / len(self.rejected), 4) if self.rejected else None,
        }

    @classmethod
    def table_lines(cls, results: list) -> list[str]:
        lines = ["margin head: mean logit margin over the runner-up, accepted / rejected drafts:"]
        for result in results:
            figures = result.tallied_figures()
            accepted, rejected = (figures[name] for name in cls.reports)
            lines.append(f"  {result.benchmark} t={result.temperature:g}  {accepted} / {rejected}")
        return lines


@register_drafter
class MarginDrafter(DFlashDrafter):
    """A trivial head: DFlash's drafts, and beside them each draft's logit margin over the
    runner-up (what a confidence head would learn to predict), recorded per round and tallied
    by its own `MarginTally`."""

    variant_name: ClassVar[str] = "test_margin"
    display_name: ClassVar[str] = "Margin"
    round_extra: ClassVar[str | None] = "margin"
    round_tally = MarginTally

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
            result.record_round({"margins": extra})


class MarginExport(VariantExport):
    """Its export rules: the backbone's z-lab layout alone (no speculators model type names it)."""

    drafter = MarginDrafter
    other_layouts: ClassVar[tuple[str, ...]] = ()
    speculators_type: ClassVar[str | None] = None


register_export(MarginExport())


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


def test_every_built_in_variant_has_a_maker():
    """The tests below run the variants MAKERS builds: a built-in variant without an entry
    would skip every stage past training unnoticed."""
    assert {variant.name for variant in BUILT_IN_VARIANTS} <= set(MAKERS)


def test_every_registered_variant_is_in_the_contract():
    assert set(registered_drafters()) == set(MAKERS)
    assert set(registered_exports()) == set(MAKERS), "a drafter variant without its export rules"


def decode(target, drafter, monkeypatch, prompts) -> tuple[list, list]:
    """Each prompt through both decoders (checked lossless against plain greedy); the rounds
    each settled and their results."""
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    ours_rounds, static_rounds = RoundRecorder(monkeypatch, reference), RoundRecorder(monkeypatch, engine)
    results = []
    for prompt in prompts:
        plain = plain_generate(target, prompt, DecodeSettings(20)).output_ids
        ours = speculative_generate(target, drafter, prompt, DecodeSettings(20))
        static = decoder.speculative(prompt, DecodeSettings(20))
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
    for ours, static in results:
        # The variant's own per-round figures reach both decoders' results alike: every figure
        # its tally reads, one entry per round (none for a variant without a tally).
        assert set(ours.round_figures) == set(getattr(drafter.round_tally, "figures", ()))
        assert ours.round_figures.keys() == static.round_figures.keys()
        assert all(len(rows) == len(ours.acceptance_lengths) for rows in ours.round_figures.values())
        for figure, mine in ours.round_figures.items():
            torch.testing.assert_close(torch.tensor(static.round_figures[figure]), torch.tensor(mine))
    if drafter.round_tally is not None:  # its tally fills in every field it declares
        tally = drafter.round_tally(drafter.drafts_per_block)
        for ours, _ in results:
            tally.add(ours)
        assert set(tally.fields()) == set(drafter.round_tally.reports)
    export_drafter(drafter, tmp_path / name)
    loaded = load_drafter(tmp_path / name).eval()
    assert type(loaded) is type(drafter)
    saved, back = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    # The export reads back into a drafter that drafts the same tokens, round by round.
    recorder = RoundRecorder(monkeypatch, reference)
    for prompt in prompts:
        speculative_generate(target, loaded, prompt, DecodeSettings(20))
    assert recorder.rounds == rounds


@pytest.mark.parametrize("name", sorted({*MAKERS, "lilicorr-conv"}))
def test_a_variants_export_is_claimed_by_its_own_rules_alone(name, tmp_path):
    """Each variant's rules claim its exports and no other variant's, so none needs a tie-break:
    LiLiCorr's with convolutions (DFlash2's keys in its dflash_config) among them. The
    backbone's rules are what no other claims."""
    drafter = (MAKERS.get(name) or DRAFTERS[name])(tiny_target())
    export_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = layout_of(raw).to_zlab(raw)
    claims = [
        spec.variant
        for spec in registered_exports().values()
        if spec.drafter is not DFlashDrafter and spec.describes(config)
    ]
    assert claims == ([] if type(drafter) is DFlashDrafter else [drafter.variant_name])


def test_a_plugin_variants_round_figures_reach_the_evaluation_result_and_resume_from_its_journal(tmp_path):
    """The Margin head's per-round figure, recorded by its own hook and summed by its own tally,
    reaches the evaluation's result and report with nothing in dflash/ naming it; its journal
    keeps the figure, so a resumed evaluation reports the same."""
    target = tiny_target()
    drafter = margin_drafter(target).eval()
    prompts = PromptSet("random", [prompt_of(seed, 8) for seed in range(3)])
    decoders = Decoders.build(target, drafter, max_len=8 + 20, graphs=False)
    journal_file = tmp_path / "eval.prompts.jsonl"

    def journaled(journal: EvalJournal) -> BenchmarkResult:
        result = evaluated(target, decoders, drafter, prompts, journal=journal)
        journal.close()
        return result

    result = journaled(EvalJournal(journal_file, {}, resume=False))
    # The figures are the decodes' own: recount them from the reference decoder's rounds.
    accepted, rejected = [], []
    for prompt in prompts.prompts:
        decoded = speculative_generate(target, drafter, prompt, DecodeSettings(20))
        for margins, kept in zip(decoded.round_figures["margins"], decoded.accepted_drafts):
            accepted += margins[:kept]
            rejected += margins[kept:]
    assert rejected  # an untrained head: its drafts are mostly rejected, maybe all
    assert result.variant_figures == {
        "margin_accepted": round(sum(accepted) / len(accepted), 4) if accepted else None,
        "margin_rejected": round(sum(rejected) / len(rejected), 4),
    }
    assert (
        result.lossless_frac == 1.0 and result.confidence_tau is None and result.selector_change_frac is None
    )
    report = EvalReport(results=[result])
    assert report.to_json()["results"][0]["variant_figures"] == result.variant_figures
    assert report.metrics()["eval/random/margin_rejected"] == result.variant_figures["margin_rejected"]
    # Its table section is its tally's own, asked for as the built-in tallies' are; and each
    # of its figures is a per-benchmark metric `objective=` may name.
    figures = result.variant_figures
    table = report.table().splitlines()
    at = table.index("margin head: mean logit margin over the runner-up, accepted / rejected drafts:")
    assert table[at - 1 : at + 2] == [
        "",
        table[at],
        f"  random t=0  {figures['margin_accepted']} / {figures['margin_rejected']}",
    ]
    assert "the drafter's own figures:" not in table
    assert [key for key in report.metrics() if not is_summary_metric(key)] == []
    resumed = EvalJournal(journal_file, {}, resume=True)
    assert journaled(resumed) == result and resumed.taken == len(prompts.prompts)


def test_a_round_tally_cannot_overwrite_a_figure_the_evaluation_fills_itself():
    report = BenchmarkResult("set", 0.0, 1, 10, 2, 5.0, [0.0])
    report.add_figures({"confidence_tau": 2.5, "margin": 1.0})
    assert report.confidence_tau == 2.5 and report.variant_figures == {"margin": 1.0}
    with pytest.raises(ValueError, match="round tally reports 'tau', a figure the evaluation fills itself"):
        report.add_figures({"tau": 9.0})


VERIFIER = {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}


def round_trip(drafter: DFlashDrafter, layout: str, tmp_path: Path, target_dir: Path) -> None:
    """`drafter` written in `layout`, checked against the readers' rules, read back, warm started
    from as a run's `drafter.init_from` does (dflash/run/launch.py), and converted to each other
    layout its variant declares: the same class and weights every way."""
    directory = tmp_path / layout
    write_layout(drafter, directory, layout, target_dir=target_dir, verifier=VERIFIER)
    assert check_export(directory) == []
    loaded = load_drafter(directory)
    assert type(loaded) is type(drafter) and same_weights(loaded, drafter)
    fresh = type(drafter)(copy.deepcopy(drafter.config))
    new_parts = warm_starts_new_parts(read_drafter_config(directory), fresh.config, "drafter.init_from")
    load_drafter_weights(fresh, directory, new_parts=new_parts)
    assert not new_parts and same_weights(fresh, drafter)
    pairing = ["--target", str(target_dir), "--num-anchors", "8"]
    for other in export_for(drafter).layouts:
        if other == layout:
            continue
        converted = tmp_path / f"{layout}-as-{other}"
        export_main(["convert", str(directory), str(converted), "--layout", other, *pairing])
        back = load_drafter(converted)
        assert type(back) is type(drafter) and same_weights(back, drafter)


@pytest.mark.parametrize(
    "name, layout",
    [(name, layout) for name in sorted(MAKERS) for layout in registered_exports()[name].layouts],
)
def test_every_declared_layout_round_trips_through_export_init_from_and_convert(
    name, layout, tmp_path, tiny_qwen3_dir
):
    round_trip(MAKERS[name](tiny_target()), layout, tmp_path, tiny_qwen3_dir)


def test_which_checkpoints_start_a_variant_is_the_run_drafters_one_answer():
    """drafter.init_from from another drafter class (`warm_starts`): a DFlash drafter starts every
    variant, a variant of one's own included with nothing declared; a DFlash2 one starts LiLiCorr,
    which names it; no other pair, and no class starts itself as new parts (a resume, or a start
    from the same variant, must fit in every part). Resume asks exactly this."""
    drafters = registered_drafters()
    starts = {
        (source, run)
        for source, source_class in drafters.items()
        for run, run_class in drafters.items()
        if run_class.warm_starts(source_class)
    }
    variants = {name for name, drafter_class in drafters.items() if drafter_class is not DFlashDrafter}
    backbone = DFlashDrafter.variant_name
    assert "test_margin" in variants
    assert starts == {(backbone, name) for name in variants} | {("dflash2", "lilicorr")}


def test_convert_offers_every_registered_layout():
    assert set(LAYOUTS) == set(registry._LAYOUTS)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_convert_refuses_a_layout_the_variant_does_not_declare(name, tmp_path, tiny_qwen3_dir, capsys):
    drafter = MAKERS[name](tiny_target())
    declared = export_for(drafter).layouts
    export_drafter(drafter, tmp_path / "native")
    for layout in sorted(set(registry._LAYOUTS) - set(declared)):
        arguments = ["convert", str(tmp_path / "native"), str(tmp_path / layout), "--layout", layout]
        with pytest.raises(SystemExit) as stopped:
            export_main([*arguments, "--target", str(tiny_qwen3_dir)])
        assert stopped.value.code == 2 and not (tmp_path / layout).exists()
        message = capsys.readouterr().err
        assert f"is not written in the {layout} layout: --layout {' or '.join(declared)}" in message


class Overclaiming(MarginExport):
    """The Margin head claiming layouts it cannot be written in: DeepSpec's (which asserts the
    heads' fields) and speculators' (which has no model type for it)."""

    other_layouts = ("deepspec", "speculators")


@pytest.mark.parametrize("layout", Overclaiming.other_layouts)
def test_a_variant_declaring_a_layout_it_cannot_write_fails_the_round_trip(
    layout, tmp_path, tiny_qwen3_dir, monkeypatch
):
    monkeypatch.setitem(registry._EXPORTS, MarginDrafter.variant_name, Overclaiming())
    drafter = margin_drafter(tiny_target())
    with pytest.raises((AssertionError, ValueError)) as failure:
        round_trip(drafter, layout, tmp_path, tiny_qwen3_dir)
    expected = "markov_rank" if layout == "deepspec" else "no speculators model type"
    assert expected in str(failure.value) or expected in str(check_export(tmp_path / layout))


def test_a_drafter_variant_without_export_rules_is_refused_at_its_export(tmp_path):
    class Unexported(DFlashDrafter):
        variant_name: ClassVar[str] = "test_unexported"

    target = tiny_target()
    with pytest.raises(ValueError, match="registers no export rules: register them with .*register_export"):
        export_drafter(Unexported(tiny_drafter_config(target)), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_export_and_serving_reach_a_variants_export_code_through_the_registry_only():
    """Past the registry, export, `dflash export` and serving import no variant's own module
    (dflash/export/deepspec.py, dflash/export/dflash2_rules.py, dflash/drafters/dspark.py, ...): what
    they need of a variant they ask its registered rules, so a variant they were not written
    for is served alike."""
    from tests.test_variant_plugin import PACKAGE, is_own, variants

    own_modules = {
        path.relative_to(PACKAGE).as_posix(): name
        for path in PACKAGE.rglob("*.py")
        for name in variants()
        if is_own(path.relative_to(PACKAGE).as_posix(), name)
    }
    scanned = [*PACKAGE.glob("export/*.py"), *PACKAGE.glob("tools/export*.py"), *PACKAGE.glob("serving/*.py")]
    found = []
    for path in scanned:
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "export/export_registry.py" or relative in own_modules:
            continue
        for line, module in imports_of(path):
            for candidate in (module, *(f"{module}.{name}" for name in imported_names(path, line))):
                where = candidate.removeprefix("dflash.").replace(".", "/") + ".py"
                if where in own_modules:
                    found.append(f"{relative}:{line} imports {candidate}")
    assert not found, found


def imports_of(path: Path) -> list[tuple[int, str]]:
    import ast

    tree = ast.parse(path.read_text())
    found = [(node.lineno, node.module) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    found += [
        (node.lineno, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    return [(line, module) for line, module in found if module and module.startswith("dflash")]


def imported_names(path: Path, line: int) -> list[str]:
    """The names a `from package import a, b` at `line` imports (modules among them)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.lineno == line:
            return [alias.name for alias in node.names]
    return []
