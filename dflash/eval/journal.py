"""An evaluation's prompts, one JSON line each as it finishes, beside its report
(`eval.json` -> `eval.prompts.jsonl`): `dflash-eval eval.resume=true` run again after a time limit
or a crash decodes only the prompts the journal lacks, and reports over all of them.

The first line holds the settings the outcomes depend on (the drafter's weights, the target, the
dtype and device kind, the decoding settings); a resume under other settings is refused naming
them, since its figures would mix two measurements. Each later line is one prompt's outcome,
keyed by benchmark, temperature and index, with a digest of the prompt's tokens (a prompt file
edited in between is refused rather than reported under the old prompt's figures). A line cut
short by a kill is dropped, and that prompt decoded again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from dflash.decoding.reference import DecodeResult

JOURNAL_KIND = "dflash-eval prompts"
OutcomeKey = tuple[str, float, int]  # benchmark, temperature, prompt index


def journal_path(report: Path) -> Path:
    """The journal beside a report: eval.json -> eval.prompts.jsonl."""
    return report.with_name(f"{report.stem}.prompts.jsonl")


def prompt_digest(prompt: list[int]) -> str:
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:16]


@dataclasses.dataclass
class PromptOutcome:
    """One prompt's DFlash decoding and, where the plain reference ran, whether its output was
    identical and, for a greedy difference, where and by what logit gap (evaluate.first_divergence)."""

    result: DecodeResult
    identical: bool | None = None
    divergence: tuple[int, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "result": dataclasses.asdict(self.result),
            "identical": self.identical,
            "divergence": list(self.divergence) if self.divergence is not None else None,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> PromptOutcome:
        divergence = row["divergence"]
        return cls(
            result=decode_result(row["result"]),
            identical=row["identical"],
            divergence=(int(divergence[0]), float(divergence[1])) if divergence is not None else None,
        )


def decode_result(recorded: dict[str, Any]) -> DecodeResult:
    """A journal line's decode result. A journal written before a decoding kept its variant's
    per-round figures under `round_figures` held each figure as a field of its own beside the
    acceptance, every variant's in every line (empty where the drafter records none): each of
    those that holds rounds becomes the round figure of its name, so such a journal resumes."""
    known = {field.name for field in dataclasses.fields(DecodeResult)}
    result = DecodeResult(**{name: value for name, value in recorded.items() if name in known})
    for name, rounds in recorded.items():
        if name in known:
            continue
        if not isinstance(rounds, list):
            raise TypeError(f"{name!r} is no per-round figure")
        if rounds:
            result.round_figures[name] = rounds
    return result


class EvalJournal:
    """Append-only; `outcome(...)` answers from what an earlier run recorded, `record(...)` adds
    a prompt as soon as it is decoded (flushed: a kill loses at most the prompt in flight)."""

    def __init__(self, path: Path, settings: dict[str, Any], *, resume: bool):
        self.path = path
        self.settings = json.loads(json.dumps(settings))  # as read back: tuples -> lists
        self.recorded: dict[OutcomeKey, tuple[str, PromptOutcome]] = {}
        self.taken = 0  # outcomes `outcome` answered from the journal in this run
        if self.path.is_file() and self.path.stat().st_size:
            if not resume:
                raise ValueError(
                    f"eval.resume: {self.path} holds an earlier evaluation's prompts; eval.resume=true "
                    "continues it (the same settings), or write this one elsewhere (eval.output or paths.output_dir)"
                )
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write([json.dumps({"journal": JOURNAL_KIND, "settings": self.settings})])
        self._handle = self.path.open("a")

    @property
    def resumed(self) -> int:
        """Prompt outcomes taken from the earlier run."""
        return len(self.recorded)

    def _load(self) -> None:
        recorded_settings, self.recorded, kept = _parse(self.path)
        differences = [
            f"{key} {recorded_settings.get(key)!r} there, {value!r} here"
            for key, value in self.settings.items()
            if recorded_settings.get(key) != value
        ]
        if differences:
            raise ValueError(
                f"eval.resume: {self.path} was written under other settings ({'; '.join(differences)}); "
                "continue it with its own settings, or write this evaluation elsewhere (eval.output or paths.output_dir)"
            )
        # Rewritten without a cut line, so the appends that follow start on a line of their own.
        self._write(kept)

    def _write(self, lines: list[str]) -> None:
        """Whole or not at all (a kill while rewriting keeps the earlier journal)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)

    def holds(self, benchmark: str, temperature: float, index: int) -> bool:
        return (benchmark, float(temperature), index) in self.recorded

    def outcome(
        self, benchmark: str, temperature: float, index: int, prompt: list[int]
    ) -> PromptOutcome | None:
        """The recorded outcome of this prompt, or None (not decoded yet)."""
        found = self.recorded.get((benchmark, float(temperature), index))
        if found is None:
            return None
        digest, outcome = found
        self.taken += 1
        if digest != prompt_digest(prompt):
            raise ValueError(
                f"eval.resume: {self.path} recorded another prompt {index} of benchmark {benchmark!r} "
                "(its prompt file changed since); write this evaluation elsewhere (eval.output or paths.output_dir)"
            )
        return outcome

    def record(
        self, benchmark: str, temperature: float, index: int, prompt: list[int], outcome: PromptOutcome
    ) -> None:
        row = {
            "benchmark": benchmark,
            "temperature": float(temperature),
            "index": index,
            "prompt_digest": prompt_digest(prompt),
            **outcome.to_json(),
        }
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_outcomes(path: Path) -> dict[OutcomeKey, tuple[str, PromptOutcome]]:
    """A journal's prompt outcomes, each with its prompt's digest (read only: what a finished or
    interrupted evaluation decoded, e.g. to compare two evaluations on the prompts both hold)."""
    return _parse(path)[1]


def _parse(path: Path) -> tuple[dict[str, Any], dict[OutcomeKey, tuple[str, PromptOutcome]], list[str]]:
    """(settings, outcomes, the whole lines) of a journal; a last line cut short by a kill is
    dropped, any other line that is not an outcome refused naming it."""
    lines = path.read_text().split("\n")  # ends with "" when the last line is whole
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("journal") != JOURNAL_KIND:
        raise ValueError(f"eval.resume: {path}:1 is not a dflash-eval journal")
    outcomes: dict[OutcomeKey, tuple[str, PromptOutcome]] = {}
    kept = [lines[0]]
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (row["benchmark"], float(row["temperature"]), int(row["index"]))
            outcomes[key] = (row["prompt_digest"], PromptOutcome.from_json(row))
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                break  # the last line, cut short by a kill (no newline): that prompt is decoded again
            raise ValueError(f"eval.resume: {path}:{number} is not a prompt outcome") from None
        kept.append(line)
    return header.get("settings") or {}, outcomes, kept
