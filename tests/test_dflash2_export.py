"""DFlash2 drafters as their readers load them: the z-lab layout of z-lab's released DFlash2
checkpoints (what SGLang, vLLM and llama.cpp's converter read) and speculators' `dflash2` layout
(vLLM), written, read back bit for bit, checked by `dflash export check` against each reader's
rules (docs/EXPORT.md, "DFlash2 drafters"); a checkpoint laid out as the released ones loads, and
a DFlash drafter warm-starts a DFlash2 one with its convolutions at the identity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.dflash2 import DFlash2Drafter, GroupedDynamicConv, add_dflash2_fields
from dflash.export.contract import check_export, reader_limits
from dflash.export.zlab import export_drafter, load_drafter, load_drafter_weights, write_layout
from dflash.run.resume import check_resume_matches, warm_starts_new_parts
from dflash.target.model import FrozenTarget
from dflash.tools.export import main as export_main
from dflash.train import train
from dflash.trainer.checkpoint import save_checkpoint
from tests.test_dflash_rules import MASK_ID, tiny_drafter, tiny_drafter_config, tiny_target
from tests.test_export_contract import edit_config, edit_weights

TINY_TARGET = {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512}
SLIDING = ["sliding_attention", "sliding_attention"]
# k = 3 taps: base_kernel [2, 3, H], whose side and tap axes a transposition would swap (at the
# released k = 2 the two orders have one shape).
FIELDS = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4)
VERIFIER = {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}


def dflash2_config(target: FrozenTarget, *, block_size: int = 4, **fields):
    config = tiny_drafter_config(target, block_size, layer_types=SLIDING, sliding_window=8)
    return add_dflash2_fields(config, **{**FIELDS, **fields})


def tiny_dflash2(
    target: FrozenTarget, *, seed: int = 1, unary: dict | None = None, **fields
) -> DFlash2Drafter:
    """A DFlash2 drafter on the tiny target; every weight moved off its init (they must really load)."""
    config = dflash2_config(target, **fields)
    config.dflash_config.update(unary or {})
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return drafter


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


def released_names(layers: int) -> set[str]:
    """The tensor names of z-lab's released DFlash2 checkpoints (the header of
    z-lab/dflash tests/fixtures/dflash2-safetensors-header.json), written out here rather than
    taken from the model, so a renamed parameter fails this file."""
    names = {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "candidate_selector.hidden_projection.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
    }
    for i in range(layers):
        names |= {
            f"layers.{i}.{name}"
            for name in (
                "attention_conv.base_kernel",
                "attention_conv.kernel_projection.weight",
                "mlp_conv.base_kernel",
                "mlp_conv.kernel_projection.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            )
        }
    return names


@pytest.fixture
def export(tmp_path) -> Path:
    export_drafter(tiny_dflash2(tiny_target()), tmp_path / "drafter")
    return tmp_path / "drafter"


def test_a_dflash2_export_is_the_released_layout_and_reads_back_bit_for_bit(export):
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    # The four fields inside dflash_config, where vLLM and SGLang read them (and only there).
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3], **FIELDS}
    assert not any(key in config for key in FIELDS)
    assert config["is_causal"] is False and config["layer_types"] == SLIDING
    tensors = load_file(str(export / "model.safetensors"))
    assert set(tensors) == released_names(2)
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 3, 64)
    assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * (64 // 8), 64)
    assert tensors["candidate_selector.predecessor_codebook"].shape == (512, 8)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (8, 64)
    assert check_export(export, target=TINY_TARGET) == [] and reader_limits(export) == []
    loaded = load_drafter(export)
    assert isinstance(loaded, DFlash2Drafter) and same_weights(tiny_dflash2(tiny_target()), loaded)
    assert loaded.candidate_selector.top_k == 4 and loaded.settings == FIELDS


def test_a_dflash2_training_checkpoint_round_trips(tmp_path):
    """Checkpoints of a variant=dflash2 run are written by the same exporter (and resume reads
    them back): the same drafter, every weight equal, the contract kept."""
    drafter = tiny_dflash2(tiny_target())
    save_checkpoint(tmp_path, 2, drafter, {"position": {"step": 2}}, "seed: 0\n", keep_last=2)
    assert check_export(tmp_path / "last", target=TINY_TARGET) == []
    loaded = load_drafter(tmp_path / "last")
    assert isinstance(loaded, DFlash2Drafter) and same_weights(drafter, loaded)


def test_the_convolution_keeps_the_released_axes():
    """What each axis of the released tensors means (z-lab/dflash GroupedDynamicCausalConv):
    base_kernel[side, tap, channel] with side 0 applied to the sublayer's input and side 1 to
    its output, tap t reading t positions back inside the block (zero before its start), and
    kernel_projection's output viewed as (side, tap, group), channel c in group c // g. Written
    out here position by position; k = 3 so that a swapped side/tap axis changes the result."""
    torch.manual_seed(0)
    hidden, kernel, group, block = 16, 3, 4, 4
    conv = GroupedDynamicConv(hidden_size=hidden, kernel_size=kernel, group_size=group, block_size=block)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.3)
    x, y = torch.randn(1, 2 * block, hidden), torch.randn(1, 2 * block, hidden)
    dynamic = (x[0] @ conv.kernel_projection.weight.T).view(2 * block, 2, kernel, hidden // group)

    def expected(values: torch.Tensor, side: int) -> torch.Tensor:
        out = torch.zeros(2 * block, hidden)
        for i in range(2 * block):
            for tap in range(kernel):
                if i % block - tap < 0:
                    continue  # before the block's first position
                for c in range(hidden):
                    weight = conv.base_kernel[side, tap, c] + dynamic[i, side, tap, c // group]
                    out[i, c] += weight * values[0, i - tap, c]
        return out

    with torch.no_grad():
        prepared, taps = conv.prepare(x)
        finished = conv.finish(y, taps)
    torch.testing.assert_close(prepared[0], expected(x, side=0))
    torch.testing.assert_close(finished[0], expected(y, side=1))


def test_the_speculators_dflash2_layout_round_trips_and_converts_back(export, tmp_path, tiny_qwen3_dir):
    spec = tmp_path / "spec"
    export_main(
        ["convert", str(export), str(spec), "--layout", "speculators", "--target", str(tiny_qwen3_dir)]
    )
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert {key: config[key] for key in FIELDS} == FIELDS
    assert config["aux_hidden_state_layer_ids"] == [2, 4] and config["mask_token_id"] == MASK_ID
    assert config["draft_vocab_size"] == 512 and config["block_size"] == 4
    assert config["sample_from_anchor"] is False and config["sliding_window_non_causal"] is True
    assert config["speculators_config"]["algorithm"] == "dflash2"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    layer = config["transformer_layer_config"]
    assert layer["is_causal"] is False and "dflash_config" not in layer and layer["layer_types"] == SLIDING
    assert not any(key in config for key in ("output_multiplier", "final_logit_softcapping"))
    # The z-lab layout's tensors plus the target's tables, as speculators' save_pretrained writes
    # them (its loader reads them from the drafter directory).
    written = load_file(str(spec / "model.safetensors"))
    assert set(written) == released_names(2) | {"embed_tokens.weight", "lm_head.weight"}
    target = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], target["lm_head.weight"].float())
    assert torch.equal(written["embed_tokens.weight"], target["model.embed_tokens.weight"].float())
    assert check_export(spec, target=TINY_TARGET) == []
    assert reader_limits(spec) == [
        "the speculators layout of a DFlash2 drafter: vLLM serves it; SGLang and llama.cpp's converter "
        "read the z-lab layout (dflash export convert DIR DST --layout zlab --target TARGET)"
    ]
    loaded = load_drafter(spec)
    assert isinstance(loaded, DFlash2Drafter) and same_weights(load_drafter(export), loaded)
    back = tmp_path / "back"
    export_main(["convert", str(spec), str(back), "--layout", "zlab", "--target", str(tiny_qwen3_dir)])
    assert check_export(back, target=TINY_TARGET) == []
    original, returned = (
        load_file(str(export / "model.safetensors")),
        load_file(str(back / "model.safetensors")),
    )
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)
    assert (
        json.loads((back / "config.json").read_text())["dflash_config"]
        == json.loads((export / "config.json").read_text())["dflash_config"]
    )


def test_logit_transforms_stay_in_the_zlab_layout(tmp_path, tiny_qwen3_dir, capsys):
    """A released drafter's output_multiplier / softcap have no speculators field: converting
    such a drafter there is refused, naming the layout that keeps them."""
    drafter = tiny_dflash2(tiny_target(), unary={"output_multiplier": 0.25, "final_logit_softcapping": 20.0})
    export_drafter(drafter, tmp_path / "zlab")
    assert check_export(tmp_path / "zlab", target=TINY_TARGET) == []
    assert load_drafter(tmp_path / "zlab").settings == {
        **FIELDS,
        "output_multiplier": 0.25,
        "final_logit_softcapping": 20.0,
    }
    with pytest.raises(SystemExit) as stopped:
        export_main(
            [
                "convert",
                str(tmp_path / "zlab"),
                str(tmp_path / "s"),
                "--layout",
                "speculators",
                "--target",
                str(tiny_qwen3_dir),
            ]
        )
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "output_multiplier=0.25" in error and "--layout zlab" in error
    assert not (tmp_path / "s").exists()


def move_to_top_level(config: dict) -> None:
    config["selector_top_k"] = config["dflash_config"].pop("selector_top_k")


def weight_suffixed_codebooks(weights: dict) -> dict:
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}.weight"] = weights.pop(f"candidate_selector.{name}")
    return weights


def transposed_base_kernel(weights: dict) -> dict:
    name = "layers.0.attention_conv.base_kernel"
    weights[name] = weights[name].transpose(0, 1).contiguous()  # [tap, side, H]
    return weights


@pytest.mark.parametrize(
    "config_edit, weights_edit, expected",
    [
        (
            move_to_top_level,
            None,
            [
                "dflash_config.selector_top_k is missing (it is at the top level, where vLLM and SGLang do not look)"
            ],
        ),
        (
            None,
            weight_suffixed_codebooks,
            [
                "tensor candidate_selector.predecessor_codebook is missing",
                "unexpected tensor candidate_selector.predecessor_codebook.weight (the codebooks are stored "
                "without `.weight`: SGLang skips this name",
                "unexpected tensor candidate_selector.successor_codebook.weight",
            ],
        ),
        (
            None,
            transposed_base_kernel,
            ["tensor layers.0.attention_conv.base_kernel has shape [3, 2, 64], the config needs [2, 3, 64]"],
        ),
        (
            lambda c: c["dflash_config"].update(conv_group_size=7),
            None,
            ["dflash_config.conv_group_size 7 does not divide hidden_size 64"],
        ),
        (lambda c: c.pop("is_causal"), None, ["is_causal is None: false is needed"]),
        (lambda c: c.update(is_causal=True), None, ["is_causal is True: false is needed"]),
        (
            lambda c: c["dflash_config"].update(selector_top_k=600),
            None,
            ["dflash_config.selector_top_k 600 is larger than vocab_size 512"],
        ),
        (
            lambda c: c["dflash_config"].update(conv_kernel_size=5),
            None,
            ["dflash_config.conv_kernel_size 5 is larger than block_size 4"],
        ),
        (
            lambda c: c["dflash_config"].update(output_multiplier=0),
            None,
            ["dflash_config.output_multiplier is 0: a positive number is needed"],
        ),
        (
            lambda c: c.update(architectures=["DFlashDraftModel"]),
            None,
            ["architectures is ['DFlashDraftModel'], not ['DFlash2DraftModel']"],
        ),
        (
            None,
            lambda w: {**w, "lm_head.weight": torch.zeros(512, 64)},
            ["unexpected tensor lm_head.weight (a DFlash2 drafter carries no embedding or LM head"],
        ),
        (
            None,
            lambda w: {**w, "embed_tokens.weight": torch.zeros(512, 64)},
            ["unexpected tensor embed_tokens.weight (a DFlash2 drafter carries no embedding"],
        ),
        (
            None,
            lambda w: {f"model.{name}": tensor for name, tensor in w.items()},
            ["tensor fc.weight is missing", "unexpected tensor model.fc.weight"],
        ),
    ],
    ids=[
        "field_at_top_level",
        "weight_suffixed_codebooks",
        "transposed_base_kernel",
        "group_not_dividing_hidden",
        "is_causal_missing",
        "is_causal_true",
        "top_k_past_vocab",
        "kernel_past_block",
        "output_multiplier_zero",
        "dflash_architecture",
        "lm_head_bundled",
        "embedding_bundled",
        "model_prefix",
    ],
)
def test_a_broken_dflash2_export_is_named_one_line_each(export, capsys, config_edit, weights_edit, expected):
    if config_edit is not None:
        edit_config(export, config_edit)
    if weights_edit is not None:
        edit_weights(export, weights_edit)
    problems = check_export(export, target=TINY_TARGET)
    for message in expected:
        assert any(message in problem for problem in problems), (message, problems)
    with pytest.raises(SystemExit) as stopped:
        export_main(["check", str(export)])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("dflash export: ") for line in lines)
    assert len(lines) == len(check_export(export))


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda c: c.update(conv_kernel_size=5),
            "dflash_config.conv_kernel_size 5 is larger than block_size 4",
        ),
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor is true"),
        (lambda c: c.pop("draft_vocab_size"), "draft_vocab_size is missing"),
        (lambda c: c.update(draft_vocab_size=256), "a reduced draft vocabulary is not supported"),
        (lambda c: c.update(selector_top_k=600), "selector_top_k 600 is larger than vocab_size 512"),
        (lambda c: c.update(output_multiplier=0.2), "output_multiplier in a speculators config"),
        (
            lambda c: c["speculators_config"].update(algorithm="dflash"),
            "algorithm is 'dflash', not 'dflash2'",
        ),
        (
            lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
            "proposes [4] tokens; a block of 4 drafts 3",
        ),
        (
            lambda c: c["transformer_layer_config"].pop("is_causal"),
            "transformer_layer_config.is_causal is None",
        ),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), "without the selector"),
    ],
    ids=[
        "kernel_past_block",
        "sample_from_anchor",
        "no_draft_vocab",
        "reduced_vocab",
        "top_k_past_vocab",
        "logit_scale",
        "algorithm",
        "proposal_length",
        "is_causal_missing",
        "architecture",
    ],
)
def test_a_broken_speculators_dflash2_config_is_named(export, tmp_path, tiny_qwen3_dir, edit, expected):
    spec = tmp_path / "spec"
    write_layout(load_drafter(export), spec, "speculators", target_dir=tiny_qwen3_dir, verifier=VERIFIER)
    assert check_export(spec) == []
    edit_config(spec, edit)
    problems = check_export(spec)
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize("table", ["embed_tokens.weight", "lm_head.weight"])
def test_a_speculators_dflash2_export_without_the_targets_tables_is_named(
    export, tmp_path, tiny_qwen3_dir, table
):
    """speculators' loader builds both tables uninitialised and fills them from the verifier
    only when they read as NaN: a directory without them drafts from garbage, silently."""
    spec = tmp_path / "spec"
    write_layout(load_drafter(export), spec, "speculators", target_dir=tiny_qwen3_dir, verifier=VERIFIER)
    edit_weights(spec, lambda w: {name: t for name, t in w.items() if name != table})
    problems = check_export(spec)
    assert len(problems) == 1, problems
    assert f"model.safetensors: tensor {table} is missing (speculators' loader reads" in problems[0]


def test_llama_cpps_hidden_size_limit_refuses_the_zlab_layout(tmp_path, tiny_qwen3_dir, capsys):
    """llama.cpp refuses hidden < top_k (top_k + 1) ("hidden size is too small for the selector
    lattice"), and reads the z-lab layout: there the check and convert refuse it, naming the
    option to change; the speculators layout (which llama.cpp does not read) notes it."""
    export_drafter(tiny_dflash2(tiny_target(), selector_top_k=8), tmp_path / "zlab")  # 8 x 9 = 72 > 64
    problems = check_export(tmp_path / "zlab", target=TINY_TARGET)
    assert problems == [
        f"{tmp_path / 'zlab' / 'config.json'}: dflash_config.selector_top_k 8: hidden_size 64 < 8 x 9 = 72, "
        "which llama.cpp refuses ('hidden size is too small for the selector lattice'); train with "
        "variant.selector_top_k <= 7"
    ]
    with pytest.raises(SystemExit) as stopped:
        export_main(["check", str(tmp_path / "zlab")])
    assert stopped.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    spec, back = tmp_path / "spec", tmp_path / "back"
    to_speculators = ["convert", str(tmp_path / "zlab"), str(spec), "--layout", "speculators"]
    export_main([*to_speculators, "--target", str(tiny_qwen3_dir)])
    assert "note: dflash_config.selector_top_k 8: hidden_size 64 < 8 x 9 = 72, which llama.cpp refuses" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as stopped:
        export_main(["convert", str(spec), str(back), "--layout", "zlab", "--target", str(tiny_qwen3_dir)])
    assert stopped.value.code == 2 and "variant.selector_top_k <= 7" in capsys.readouterr().err
    assert not back.exists()


def write_as_released(directory: Path, *, unary: bool = True) -> dict[str, torch.Tensor]:
    """A tiny DFlash2 checkpoint laid out as z-lab's released ones (z-lab/dflash
    tests/fixtures/dflash2-config.json and its safetensors header): transformers-5 config with
    `rope_parameters` only (no `rope_theta`), `block_size` inside `dflash_config` only, the
    four fields there, `is_causal: false`, all-sliding layers; bf16 tensors under the released
    names, no embedding, no LM head. With `unary`, Muse-Glimmer's output_multiplier and softcap."""
    hidden, inner, layers, heads, kv_heads, head_dim, vocab = 64, 128, 2, 4, 2, 16, 512
    kernel, group, rank = 2, 16, 8
    groups = hidden // group
    dflash_config = {
        "block_size": 4,
        "conv_group_size": group,
        "conv_kernel_size": kernel,
        "mask_token_id": MASK_ID,
        "selector_rank": rank,
        "selector_top_k": 4,
        "target_layer_ids": [1, 3],
    }
    if unary:
        dflash_config.update(output_multiplier=0.19611613513818404, final_logit_softcapping=20.0)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "is_causal": False,
        "dflash_config": dflash_config,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inner,
        "layer_types": ["sliding_attention"] * layers,
        "max_position_embeddings": 512,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_target_layers": 6,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": 8,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": vocab,
    }
    shapes = {
        "fc.weight": (hidden, 2 * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "candidate_selector.hidden_projection.weight": (rank, hidden),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * groups, hidden)
        shapes.update(
            {
                f"layers.{i}.input_layernorm.weight": (hidden,),
                f"layers.{i}.post_attention_layernorm.weight": (hidden,),
                f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"layers.{i}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"layers.{i}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"layers.{i}.self_attn.q_norm.weight": (head_dim,),
                f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
                f"layers.{i}.mlp.gate_proj.weight": (inner, hidden),
                f"layers.{i}.mlp.up_proj.weight": (inner, hidden),
                f"layers.{i}.mlp.down_proj.weight": (hidden, inner),
            }
        )
    assert set(shapes) == released_names(layers)
    generator = torch.Generator().manual_seed(3)
    tensors = {
        name: (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def test_a_released_dflash2_checkpoint_keeps_the_contract_and_loads(tmp_path):
    tensors = write_as_released(tmp_path)
    assert check_export(tmp_path, target=TINY_TARGET) == []
    drafter = load_drafter(tmp_path)
    assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == 4
    assert drafter.settings == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "output_multiplier": 0.19611613513818404,
        "final_logit_softcapping": 20.0,
    }
    state = drafter.state_dict()
    assert all(torch.equal(state[name].to(torch.bfloat16), tensor) for name, tensor in tensors.items())
    # Its logit transforms act on the unary logits as the reference's compute_logits does.
    logits = torch.linspace(-300.0, 300.0, 7)
    expected = torch.tanh(logits * 0.19611613513818404 / 20.0) * 20.0
    torch.testing.assert_close(drafter.unary_logits(logits), expected)


def test_drafter_init_from_a_released_dflash2_checkpoint(tmp_path):
    """drafter.init_from: the run builds its DFlash2 drafter from its own config and takes the
    released weights; a released drafter that scales its logits does not start a run that
    would train it without (a 5x logit difference, silently), naming the field."""
    target = tiny_target()
    run_config = dflash2_config(target, conv_kernel_size=2, conv_group_size=16)
    plain = tmp_path / "plain"
    tensors = write_as_released(plain, unary=False)
    check_resume_matches(plain, run_config, {}, key="drafter.init_from")
    fresh = DFlash2Drafter(run_config)
    load_drafter_weights(fresh, plain)
    state = fresh.state_dict()
    assert all(torch.equal(state[name].to(torch.bfloat16), tensor) for name, tensor in tensors.items())
    write_as_released(tmp_path / "scaled")
    with pytest.raises(ValueError, match=r"dflash_config.output_multiplier.*checkpoint 0.196.*this run None"):
        check_resume_matches(tmp_path / "scaled", run_config, {}, key="drafter.init_from")
    other = dflash2_config(target, conv_kernel_size=2, conv_group_size=16, selector_top_k=8)
    with pytest.raises(ValueError, match=r"variant.selector_top_k: checkpoint 4, this run 8"):
        check_resume_matches(plain, other, {}, key="drafter.init_from")


def test_weights_of_other_shapes_are_refused_in_one_line_naming_the_tensor_and_the_file(tmp_path):
    """The loader's net under the preflight's config comparison: a tensor of another shape than
    the drafter's is one line naming it, both shapes, how many more differ and the file (torch's
    own refusal is a line per tensor naming no file)."""
    target = tiny_target()
    narrower = tiny_dflash2(target, conv_kernel_size=2)
    export_drafter(narrower, tmp_path / "k2")
    wider = DFlash2Drafter(dflash2_config(target, conv_kernel_size=3))
    with pytest.raises(ValueError) as refused:
        load_drafter_weights(wider, tmp_path / "k2")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'k2' / 'model.safetensors'}: ")
    first = "layers.0.attention_conv.base_kernel"
    there, here = (list(drafter.state_dict()[first].shape) for drafter in (narrower, wider))
    # Each of the 2 layers' 2 convolutions: its base kernel and its kernel projection.
    assert f"tensor {first} is {there} there, {here} in the drafter (and 7 more tensors" in message


def without_tensor(directory: Path, destination: Path, name: str) -> Path:
    """A copy of the drafter checkpoint `directory` whose model.safetensors lacks tensor `name`."""
    shutil.copytree(directory, destination)
    edit_weights(destination, lambda weights: {k: v for k, v in weights.items() if k != name})
    return destination


def test_a_dflash_drafter_warm_starts_dflash2_with_identity_convolutions(tmp_path):
    """drafter.init_from a DFlash drafter into a DFlash2 run: the backbone loads, the
    convolutions stay the identity and the selector its fresh init, so the warm-started drafter's
    hidden states are the DFlash drafter's exactly. Any other missing weight is still refused."""
    target = tiny_target()
    dflash = tiny_drafter(target, layer_types=SLIDING, sliding_window=8)
    with torch.no_grad():
        for parameter in dflash.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    export_drafter(dflash, tmp_path / "dflash")
    run_config = dflash2_config(target)
    saved = load_drafter(tmp_path / "dflash").config
    assert warm_starts_new_parts(saved, run_config, "drafter.init_from")
    assert not warm_starts_new_parts(saved, run_config, "resume")
    check_resume_matches(tmp_path / "dflash", run_config, {}, key="drafter.init_from")
    torch.manual_seed(5)
    fresh = DFlash2Drafter(run_config)
    selector = {k: v.clone() for k, v in fresh.candidate_selector.state_dict().items()}
    with pytest.raises(ValueError, match="missing: .*attention_conv.base_kernel"):
        load_drafter_weights(fresh, tmp_path / "dflash")
    # Warm-starting excuses the added modules only: a backbone tensor the checkpoint lost is named.
    broken = without_tensor(tmp_path / "dflash", tmp_path / "broken", "layers.1.mlp.down_proj.weight")
    with pytest.raises(
        ValueError, match=r"missing: \['layers\.1\.mlp\.down_proj\.weight'\]; unexpected: none"
    ):
        load_drafter_weights(fresh, broken, new_parts=True)
    load_drafter_weights(fresh, tmp_path / "dflash", new_parts=True)
    for layer in fresh.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            identity = torch.zeros_like(conv.base_kernel)
            identity[:, 0] = 1.0
            assert torch.equal(conv.base_kernel, identity)
            assert not conv.kernel_projection.weight.any()
    assert all(torch.equal(fresh.candidate_selector.state_dict()[k], v) for k, v in selector.items())
    features, emb = torch.randn(1, 6, 2 * 64), torch.randn(1, 4, 64)
    positions, mask = torch.arange(6, 10)[None], torch.ones(1, 4, 10, dtype=torch.bool)
    with torch.no_grad():
        masks = {8: mask}
        assert torch.equal(fresh(features, emb, positions, masks), dflash(features, emb, positions, masks))
    # A DFlash2 checkpoint resumed into a DFlash run is another drafter.
    export_drafter(fresh, tmp_path / "d2")
    plain_config = load_drafter(tmp_path / "dflash").config
    with pytest.raises(ValueError, match="variant.conv_kernel_size: checkpoint 3, this run None"):
        check_resume_matches(tmp_path / "d2", plain_config, {}, key="drafter.init_from")
    assert isinstance(load_drafter(tmp_path / "dflash"), DFlashDrafter)


DFLASH2_RUN = ["variant=dflash2", "variant.selector_rank=16", "variant.selector_top_k=7"]  # 7 x 8 <= 64


def released_form(directory: Path, drafter: DFlash2Drafter) -> Path:
    """`drafter` written as z-lab writes its released DFlash2 checkpoints: transformers 5's
    config (no rope_theta, rope_scaling or torch_dtype), block_size inside dflash_config only,
    bf16 tensors."""
    export_drafter(drafter, directory)
    config = json.loads((directory / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        config.pop(key)
    config["dflash_config"]["block_size"] = config.pop("block_size")
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))
    edit_weights(directory, lambda w: {name: t.to(torch.bfloat16) for name, t in w.items()})
    return directory


def test_variant_dflash2_runs_start_from_a_dflash_checkpoint_and_from_a_released_drafter(make_cfg, tmp_path):
    """drafter.init_from through a run's own preflight and loader: a DFlash checkpoint gives the
    backbone (convolutions at the identity, selector new); a drafter in the released layout gives
    every weight."""
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading

    plain = train(make_cfg(["train.total_steps=2"], output_dir=tmp_path / "dflash"))
    warm_cfg = make_cfg(DFLASH2_RUN + [f"drafter.init_from={plain['checkpoint']}"], tmp_path / "warm")
    warm = build_models(check_before_loading(warm_cfg)).drafters[0]
    assert isinstance(warm, DFlash2Drafter)
    source = load_drafter(Path(plain["checkpoint"])).state_dict()
    state = warm.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in source.items())
    added = {name for name in state if name not in source}
    assert (
        added == {name for name in state if "_conv." in name or name.startswith("candidate_selector.")}
        and added
    )
    assert all(not layer.attention_conv.kernel_projection.weight.any() for layer in warm.layers)

    with torch.no_grad():
        for parameter in warm.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    released = released_form(tmp_path / "released", warm)
    assert check_export(released, target=TINY_TARGET) == []
    run_cfg = make_cfg(DFLASH2_RUN + [f"drafter.init_from={released}"], tmp_path / "fine_tune")
    started = build_models(check_before_loading(run_cfg)).drafters[0].state_dict()
    tensors = load_file(str(released / "model.safetensors"))
    assert all(torch.equal(started[name].to(torch.bfloat16), tensor) for name, tensor in tensors.items())
    assert set(started) == set(tensors)
