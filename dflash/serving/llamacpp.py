"""llama.cpp, the engine that serves an exported drafter: its build in the cache
(scripts/build_llamacpp.sh, at the pinned version that carries the DFlash, DSpark and DFlash2
loaders) and its own converter (`convert_hf_to_gguf.py`; a drafter with `--target-model-dir`,
which takes the tokenizer from the target). The server is dflash.serving.server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash.drafters.backbone import DFlashDrafter
from dflash.export.export_registry import export_for

VERSION = "11434.0.0"
BUILD_COMMAND = "bash scripts/build_llamacpp.sh"


def cache_root() -> Path:
    """Where scripts/build_llamacpp.sh builds (DFLASH_LLAMACPP_CACHE, as the script reads it)."""
    base = os.environ.get("DFLASH_LLAMACPP_CACHE") or Path.home() / ".cache" / "dflash" / "llama.cpp"
    return Path(base) / VERSION


@dataclass(frozen=True)
class LlamaCppBuild:
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def source(self) -> Path:
        return self.root / "src" / "llama.cpp"

    def converter_env(self) -> dict[str, str]:
        # The converter's own gguf-py (it knows the dflash architecture; an installed gguf may
        # not) before anything else, then its modules and the one package kept beside the build.
        paths = [self.source / "gguf-py", self.source, self.root / "python"]
        inherited = os.environ.get("PYTHONPATH")
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*map(str, paths), *([inherited] if inherited else [])]),
        }

    def convert(self, checkpoint: Path, out: Path, *, target_dir: Path | None = None) -> Path:
        """`checkpoint` (a target, or with `target_dir` a drafter) as a float32 GGUF at `out`,
        by llama.cpp's own converter; its last lines in the error if it refuses."""
        command = [sys.executable, str(self.source / "convert_hf_to_gguf.py"), str(checkpoint)]
        if target_dir is not None:
            command += ["--target-model-dir", str(target_dir)]
        command += ["--outtype", "f32", "--outfile", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, env=self.converter_env())
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ValueError(f"{checkpoint}: llama.cpp's converter refused it: {tail}")
        return out


def spec_type_for(drafter: DFlashDrafter | type[DFlashDrafter]) -> str:
    """llama-server's `--spec-type` for a drafter (its variant's registered export rules:
    draft-dflash for DFlash and DFlash2, draft-dspark for DSpark); a variant llama.cpp has no
    loader for is refused in one line. `--spec-draft-n-max` is the drafter's drafts per block
    (B-1, or B for DSpark's anchor-first block; the server's default, 3, would cut every draft)."""
    spec_type = export_for(drafter).llama_cpp_spec_type
    if spec_type is None:
        raise ValueError(
            f"llama.cpp {VERSION} has no loader for {drafter.variant_name} drafters: "
            "serve this export with an engine that reads it (docs/EXPORT.md)"
        )
    return spec_type


def find_build(root: Path | None = None) -> LlamaCppBuild:
    """The build in the cache, or a one-line error that names the command that makes it."""
    build = LlamaCppBuild(Path(root) if root else cache_root())
    if not build.server.is_file() or not (build.source / "convert_hf_to_gguf.py").is_file():
        raise ValueError(f"llama.cpp {VERSION} is not built in {build.root}: run `{BUILD_COMMAND}`")
    return build
