"""Every variant's exports, byte for byte: a fixed seeded drafter of each variant written in each
layout it exports, compared by sha256 with the digests recorded when the layouts were last
changed on purpose. A refactor of the export path (the variant registry, the layouts' code)
must leave what readers load exactly as it was; a deliberate change to a layout updates the
digests here in the same commit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash.config.variant_schema import BUILT_IN_VARIANTS
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.lilicorr import LiLiCorrDrafter
from dflash.export.export_registry import registered_exports
from dflash.export.zlab import export_drafter, write_layout
from tests.test_dflash2_export import tiny_dflash2
from tests.test_dflash_rules import tiny_drafter, tiny_target
from tests.test_dspark_export import tiny_dspark
from tests.test_lilicorr import lilicorr_config, tiny_lilicorr

VERIFIER = {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}


def moved(drafter: DFlashDrafter, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return drafter


DRAFTERS = {
    "dflash": lambda target: moved(tiny_drafter(target)),
    "dspark": lambda target: tiny_dspark(target),
    "dflash2": lambda target: tiny_dflash2(target),
    "lilicorr": lambda target: moved(tiny_lilicorr(target)),
    # LiLiCorr+conv: DFlash2's convolution keys and tensors beside the head's.
    "lilicorr-conv": lambda target: moved(
        LiLiCorrDrafter(lilicorr_config(target, conv_kernel_size=2, conv_group_size=16))
    ),
}


def target_dir(tmp_path: Path) -> Path:
    """The tiny target's embedding and LM head, where the bundling layouts read them."""
    target = tiny_target()
    directory = tmp_path / "target"
    directory.mkdir()
    tables = {
        "model.embed_tokens.weight": target.embed_tokens.weight.detach().contiguous(),
        "lm_head.weight": target.lm_head.weight.detach().contiguous(),
    }
    save_file(tables, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def digest(directory: Path) -> str:
    """sha256 over config.json (less the writing transformers' version, which a library upgrade
    changes and no reader reads) and model.safetensors."""
    config = json.loads((directory / "config.json").read_text())
    config.pop("transformers_version", None)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    hasher = hashlib.sha256(text.encode())
    hasher.update((directory / "model.safetensors").read_bytes())
    return hasher.hexdigest()


def write(kind: str, layout: str, tmp_path: Path) -> Path:
    target = tiny_target()
    drafter = DRAFTERS[kind](target)
    out = tmp_path / f"{kind}-{layout}"
    if layout == "native":
        export_drafter(drafter, out)
    elif layout == "deepspec-bundled":
        write_layout(drafter, out, "deepspec", target_dir=target_dir(tmp_path))
    else:
        write_layout(drafter, out, "speculators", target_dir=target_dir(tmp_path), verifier=VERIFIER)
    return out


EXPECTED = {
    ("dflash", "native"): "8f5d6e7720272fd2e5dab3c14be10aebf8afe3e5633dae0427132ef961f5e89e",
    ("dflash", "speculators"): "dc445035c6f8eb647d576717139b1374c05193990871877736aa82b3fea4086d",
    ("dspark", "native"): "d44a207a86c69f033e8716fa7916eb83fe67f104611bafdce7a3e2e6c9a78c67",
    ("dspark", "deepspec-bundled"): "e8a2b5641c7d8efe5e994f4c4b18da0a27900763156311f5f7dd7f635fbc77e6",
    ("dspark", "speculators"): "459baf28fd6800f7eee6caf5451d0e050bd45604c92967a690eab74e4e1533c1",
    ("dflash2", "native"): "6885a1bc342fa3fc5fab1706ec51b95654209a2b5f0466e09dff34a22c2ba9c6",
    ("dflash2", "speculators"): "5a3c98520dad4281b5e63523fd9a0ce7c770f25c9cb07a016616f54e29d32ea4",
    # z-lab only: no other reader loads the lattice head (dflash/export/lilicorr_rules.py).
    ("lilicorr", "native"): "c237e98dd00c77c9a4f7fcd1fc8186e009392dd50e403ae49819b7b8ae088243",
    ("lilicorr-conv", "native"): "e72ef15aba8dfb136707f31551f1939fb35bceb64f63063cce1849a97aded4c7",
}


@pytest.mark.parametrize("kind, layout", sorted(EXPECTED))
def test_each_variants_export_is_byte_identical_to_the_recorded_one(kind, layout, tmp_path):
    assert digest(write(kind, layout, tmp_path)) == EXPECTED[kind, layout]


def test_every_layout_a_built_in_variant_writes_has_its_recorded_bytes():
    """The test above runs the recorded pairs alone: a built-in variant, or a layout one declares,
    without its entry in EXPECTED would be written by users and checked by nothing."""
    for variant in BUILT_IN_VARIANTS:
        spec = registered_exports()[variant.name]
        for layout in spec.layouts:
            recorded = "native" if layout == spec.drafter.native_layout else layout
            assert (variant.name, recorded) in EXPECTED, (variant.name, layout)
