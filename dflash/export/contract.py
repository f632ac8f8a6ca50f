"""The export contract: what a drafter directory must hold for every reader users serve it
with (the z-lab reference under its pinned transformers 4.57.1, SGLang, vLLM; for a DSpark
drafter DeepSpec, SGLang, vLLM and llama.cpp's converter) to read it the same way.
docs/EXPORT.md says, reader by reader, why each rule exists; `dflash export check DIR` runs
`check_export` (and prints `reader_limits`: readers that refuse a well-formed drafter). A DFlash2
drafter's rules (both its layouts) are dflash/export/dflash2_rules.py's.

Every rule here guards a failure that is silent in at least one reader: SGLang skips weight
names it does not know, so a renamed tensor is a drafter left at its initial weights; transformers
4.57 reads the rotary base from `rope_theta` only, so an export without it rotates at 10000; a
layer id past the target's depth captures nothing in one engine and another layer in another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open

from dflash.drafters.drafter_class import drafter_from_config
from dflash.export.export_registry import ZLAB, bundled_tables, export_for_config, layout_named, layout_of
from dflash.export.rules import positive_int
from dflash.export.zlab import exported_state, nonfinite_problem, read_drafter_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LAYER_TYPES = ("full_attention", "sliding_attention")
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# A dflash checkpoint keeps its run's resolved config beside the export (dflash.trainer.checkpoint):
# the block size the drafter was trained with.
RUN_CONFIG_FILE = "config.yaml"


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a drafter of this config: Qwen3 layers (per-head q/k norms, no
    biases), the context projection `fc` over the fused target features, its `hidden_norm`, and
    the final `norm`; a DSpark drafter's heads (dflash/export/deepspec.py), a DFlash2 drafter's
    convolutions and selector (dflash/export/dflash2_rules.py). No embedding and no LM head: every
    engine takes the target's."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inner = config["intermediate_size"]
    features = len(config["dflash_config"]["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, features * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}"
        shapes.update(
            {
                f"{layer}.input_layernorm.weight": (hidden,),
                f"{layer}.post_attention_layernorm.weight": (hidden,),
                f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"{layer}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"{layer}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{layer}.self_attn.q_norm.weight": (head_dim,),
                f"{layer}.self_attn.k_norm.weight": (head_dim,),
                f"{layer}.mlp.gate_proj.weight": (inner, hidden),
                f"{layer}.mlp.up_proj.weight": (inner, hidden),
                f"{layer}.mlp.down_proj.weight": (hidden, inner),
            }
        )
    shapes.update(export_for_config(config).tensor_shapes(config))
    return shapes


def _field(config: dict[str, Any], key: str) -> Any:
    """`block_size` and `num_target_layers`: top level, or inside dflash_config (both are read)."""
    return config.get(key, (config.get("dflash_config") or {}).get(key))


def config_problems(
    config: dict[str, Any], *, target: dict[str, Any] | None, layout: str = "zlab"
) -> list[str]:
    """The config rules; `target` (the target's text config as a dict, or None) adds the pairing
    rules: depth, hidden size and vocabulary. layout="speculators" (converted to z-lab fields):
    it records no num_target_layers (only a target can check its layer ids), and its readers
    (speculators, vLLM) run transformers 5, so the 4.57 rotary fields are not needed.
    layout="deepspec" (converted to z-lab fields): its own rules (architecture, top-level keys,
    heads) are `deepspec.deepspec_problems`, checked on the file as written; its readers run
    transformers 5 (DeepSpec pins 5.10.2) or read `rope_parameters` themselves: DeepSpec's
    released checkpoints carry no `rope_theta`, and every engine serves them. The variant's own
    rules are its registered ones (dflash/export/export_registry.py)."""
    records_depth = layout_named(layout).records_depth
    spec = export_for_config(config)
    problems = []
    architectures = [spec.zlab_architecture]
    if layout == ZLAB.name and config.get("architectures") != architectures:
        problems.append(
            f"architectures is {config.get('architectures')!r}, not {architectures!r} "
            "(SGLang and vLLM pick the drafter class by it)"
        )
    if config.get("model_type") != "qwen3":
        problems.append(
            f"model_type is {config.get('model_type')!r}, not 'qwen3' (the reference builds Qwen3 layers)"
        )
    sizes = [
        f"{key} is {config.get(key)!r}: a positive integer is needed"
        for key in SIZE_FIELDS
        if not isinstance(config.get(key), int) or config[key] <= 0
    ]
    if sizes:
        return problems + sizes  # the rules below read these fields
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config['hidden_act']!r}; SGLang's DFlash MLP runs silu only")
    if not isinstance(config.get("dflash_config"), dict):
        return problems + ["dflash_config is missing (mask_token_id, target_layer_ids)"]
    problems += dflash_config_problems(config, target=target, records_depth=records_depth)
    if layout == ZLAB.name and spec.needs_rope_theta(config):
        problems += rope_problems(config)
    problems += layer_type_problems(config)
    problems += spec.field_problems(config) + spec.layout_problems(config, layout=layout)
    if target is not None:
        problems += pairing_problems(config, target, records_depth=records_depth)
    return problems


def dflash_config_problems(
    config: dict[str, Any], *, target: dict[str, Any] | None, records_depth: bool
) -> list[str]:
    """The DFlash fields: the mask token and the vocabulary, the target layers and the target's
    depth, the block size (top level or inside dflash_config)."""
    dflash = config["dflash_config"]
    mask_id, layer_ids = dflash.get("mask_token_id"), dflash.get("target_layer_ids")
    vocab = config.get("vocab_size")
    problems = []
    if not positive_int(vocab):
        # Without it transformers' Qwen3Config reads 151936: a mask id past the target's
        # vocabulary would pass, and every masked position embed out of range.
        problems.append(f"vocab_size is {vocab!r}: the target's vocabulary size is needed")
    if not isinstance(mask_id, int) or isinstance(mask_id, bool) or mask_id < 0:
        problems.append(f"dflash_config.mask_token_id is {mask_id!r}: a token id is needed")
    elif positive_int(vocab) and mask_id >= vocab:
        problems.append(f"dflash_config.mask_token_id {mask_id} is outside the vocabulary ({vocab})")
    depth = _field(config, "num_target_layers") if records_depth else (target or {}).get("num_hidden_layers")
    if records_depth and (not isinstance(depth, int) or depth <= 0):
        problems.append(f"num_target_layers is {depth!r}: the target's layer count is needed")
        depth = None
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
        problems.append(f"dflash_config.target_layer_ids is {layer_ids!r}: a list of layer ids is needed")
    else:
        if len(set(layer_ids)) != len(layer_ids):
            problems.append(f"dflash_config.target_layer_ids {layer_ids} repeats a layer")
        if depth is not None and not all(0 <= i < depth for i in layer_ids):
            problems.append(
                f"dflash_config.target_layer_ids {layer_ids} are not all inside the target's {depth} layers"
            )
    block = _field(config, "block_size")
    if not positive_int(block) or block < 2:
        problems.append(f"block_size is {block!r}: an integer >= 2 is needed (SGLang would assume 16)")
    nested_block = dflash.get("block_size")
    if "block_size" in config and nested_block is not None and nested_block != config["block_size"]:
        # The reference reads dflash_config first, dflash's loader the top level first.
        problems.append(
            f"block_size {config['block_size']!r} differs from dflash_config.block_size {nested_block!r}: "
            "readers would serve blocks of either size"
        )
    return problems


def trained_block_problems(directory: Path, declared: Any) -> list[str]:
    """A dflash checkpoint's run config beside it records the block the drafter was trained
    with; an export declaring another one is served at a size it never drafted (the DFlash2
    convolution's taps, DSpark's head, the positions' noise schedule all are per block)."""
    path = Path(directory) / RUN_CONFIG_FILE
    if not path.is_file():
        return []  # trained elsewhere: its config.json is all there is to go by
    try:
        run = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: not a readable run config ({exc})"]
    trained = (run.get("drafter") or {}).get("block_size") if isinstance(run, dict) else None
    if trained is None or trained == declared:
        return []
    return [
        f"{Path(directory) / CONFIG_FILE}: block_size {declared!r}, but the drafter was trained with "
        f"drafter.block_size={trained} ({path}): serve it at the block it was trained with"
    ]


def rope_problems(config: dict[str, Any]) -> list[str]:
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta")
    if theta is None:
        return [
            "rope_theta is missing: transformers 4.57 (the z-lab reference's pin) reads the rotary base only there and falls back to 10000"
        ]
    if "rope_theta" in rope and rope["rope_theta"] != theta:
        return [f"rope_theta {theta} differs from rope_parameters.rope_theta {rope['rope_theta']}"]
    scaled = rope.get("rope_type", "default") != "default"
    scaling = config.get("rope_scaling")
    if scaled and (not isinstance(scaling, dict) or scaling.get("rope_type") != rope.get("rope_type")):
        return [
            f"rope_parameters has rope_type {rope['rope_type']!r} but rope_scaling is {scaling!r}: transformers 4.57 would not scale"
        ]
    return []


def layer_type_problems(config: dict[str, Any]) -> list[str]:
    layer_types = config.get("layer_types")
    sliding = "sliding_attention" in (layer_types or [])
    problems = []
    causal = config.get("is_causal")
    if causal is True or (sliding and causal is not False):
        problems.append(
            f"is_causal is {causal!r}: false is needed (SGLang and vLLM run a sliding layer causally "
            "inside the block unless it is false, every layer when it is true; dflash trains it bidirectional)"
        )
    if layer_types is None:
        return problems
    if len(layer_types) != config["num_hidden_layers"]:
        problems.append(
            f"layer_types has {len(layer_types)} entries for {config['num_hidden_layers']} layers"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types holds {unknown}; the readers know {list(LAYER_TYPES)}")
    if not sliding:
        return problems
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        problems.append(f"sliding layers need a positive sliding_window, got {window!r}")
    elif isinstance(_field(config, "block_size"), int) and window < _field(config, "block_size"):
        problems.append(
            f"sliding_window {window} is shorter than block_size {_field(config, 'block_size')}: "
            "a sliding layer would not see its whole block"
        )
    if config.get("use_sliding_window") is not True:
        problems.append(
            "sliding layers need use_sliding_window: true (transformers, 4.57 and 5, sets "
            "sliding_window to null without it: the reference would run full attention)"
        )
    return problems


def pairing_problems(
    config: dict[str, Any], target: dict[str, Any], *, records_depth: bool = True
) -> list[str]:
    problems = []
    depth = _field(config, "num_target_layers")
    if records_depth and depth != target["num_hidden_layers"]:
        problems.append(f"num_target_layers {depth} but the target has {target['num_hidden_layers']} layers")
    if config["hidden_size"] != target["hidden_size"]:
        problems.append(f"hidden_size {config['hidden_size']} but the target's is {target['hidden_size']}")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab != target["vocab_size"]:
        # The drafter scores with the target's LM head: another vocabulary is another target.
        problems.append(f"vocab_size {vocab} but the target's is {target['vocab_size']}")
    mask_id = config["dflash_config"].get("mask_token_id")
    if isinstance(mask_id, int) and mask_id >= target["vocab_size"]:
        problems.append(
            f"dflash_config.mask_token_id {mask_id} is outside the target's vocabulary ({target['vocab_size']})"
        )
    return problems


def weight_problems(
    path: Path,
    config: dict[str, Any],
    tables: dict[str, tuple[int, ...]] | None = None,
    *,
    tables_required: bool = False,
) -> list[str]:
    """Names, shapes, dtypes and values of model.safetensors against the config. `tables`: the
    target's embedding and LM head a layout may also hold (DeepSpec's) or must hold (speculators',
    `tables_required`). A DSpark drafter's head of the user's own: its `markov_head.*` tensors
    are its own (dtype rules only): a variant's `own_tensors`."""
    try:
        with safe_open(str(path), "pt") as handle:
            found = {name: handle.get_slice(name) for name in handle.keys()}
            shapes = {name: tuple(s.get_shape()) for name, s in found.items()}
            dtypes = {name: s.get_dtype() for name, s in found.items()}
    except (OSError, SafetensorError) as exc:
        return [f"{path}: not readable safetensors ({exc})"]
    tables = tables or {}
    required = {**expected_tensors(config), **(tables if tables_required else {})}
    problems = [
        f"{path}: tensor {name} is missing{TABLE_MISSING if name in tables else ''}"
        for name in required
        if name not in shapes
    ]
    expected = {**required, **{name: shape for name, shape in tables.items() if name in shapes}}
    spec = export_for_config(config)
    expected.update(spec.own_tensors(config, shapes))
    for name in sorted(set(shapes) - set(expected)):
        why = spec.unexpected_tensor_reason(name) or "SGLang would skip it silently, vLLM would refuse it"
        problems.append(f"{path}: unexpected tensor {name} ({why})")
    for name, shape in expected.items():
        if name in shapes and shapes[name] != shape:
            problems.append(
                f"{path}: tensor {name} has shape {list(shapes[name])}, the config needs {list(shape)}"
            )
    kinds = set(dtypes.values())
    if not kinds <= set(FLOAT_DTYPES):
        return problems + [f"{path}: tensor dtypes {sorted(kinds)}; the readers load bf16, fp16 or fp32"]
    if len(kinds) > 1:
        problems.append(f"{path}: mixed tensor dtypes {sorted(kinds)}")
    elif kinds:
        stored = FLOAT_DTYPES[kinds.pop()]
        declared = config.get("torch_dtype") or config.get("dtype")
        if declared is not None and declared != stored:
            problems.append(f"{path}: tensors are {stored} but config.json declares {declared}")
    return problems + nonfinite_problems(path)


# Why a speculators export must carry the target's tables (speculators' DraftVocabMixin).
TABLE_MISSING = (
    " (speculators' loader reads the target's embedding and LM head from the drafter directory, as "
    "its save_pretrained writes them; without them it drafts from uninitialised tables, silently: "
    "convert with --target)"
)


def nonfinite_problems(path: Path) -> list[str]:
    """The tensors of a safetensors file holding NaN or inf, one line each (dflash's loader
    refuses them by the same rule: zlab.nonfinite_problem)."""
    with safe_open(str(path), "pt") as handle:
        found = (nonfinite_problem(path, name, handle.get_tensor(name)) for name in handle.keys())
        return [problem for problem in found if problem is not None]


def check_export(directory: Path, *, target: dict[str, Any] | None = None) -> list[str]:
    """Every problem of a drafter directory, one line each ([] when it keeps the contract): the
    readers' rules, then (when those hold) whatever dflash's own loader still refuses, so a
    directory this passes is one `dflash eval`, `convert` and `drafter.init_from` read."""
    config_path, weights_path = Path(directory) / CONFIG_FILE, Path(directory) / WEIGHTS_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"{config_path}: not a readable config ({exc})"]
    if not isinstance(config, dict):
        return [f"{config_path}: not a readable config (a JSON object is needed)"]
    layout = layout_of(config)
    if layout is ZLAB:
        # A variant's config in the z-lab form, which its readers do not load (a DSpark drafter's):
        # held to its own layout's rules.
        layout = layout_named(_written_layout(export_for_config(config).layouts))
    layout_problems = layout.problems(config)
    if layout_problems:
        return [f"{config_path}: {p}" for p in layout_problems]
    serving = layout.serving_problems(config)
    config, tables = layout.to_zlab(config), {}
    if layout.bundled and _describes_tensors(config) and isinstance(config.get("vocab_size"), int):
        table = (config["vocab_size"], config["hidden_size"])
        tables = {name: table for name in layout.bundled}
    problems = [
        f"{config_path}: {p}" for p in serving + config_problems(config, target=target, layout=layout.name)
    ]
    problems += trained_block_problems(Path(directory), _field(config, "block_size"))
    if not weights_path.is_file():
        return problems + [f"{weights_path}: missing"]
    if not _describes_tensors(config):
        return problems  # which tensors belong there cannot be said from this config
    problems += weight_problems(
        weights_path, config, tables, tables_required=layout.tables_required is not None
    )
    return problems or loader_problems(Path(directory))


def _written_layout(layouts: tuple[str, ...]) -> str:
    return ZLAB.name if ZLAB.name in layouts else layouts[0]


def loader_problems(directory: Path) -> list[str]:
    """What dflash's loader refuses in a directory the rules above pass: its config reading and
    the drafter it builds (on the meta device: no memory, no weights), e.g. a Markov head type
    it cannot build. One contract: these are the loader's own checks, not a copy of them."""
    try:
        config = read_drafter_config(directory)
        with torch.device("meta"):
            drafter = drafter_from_config(config)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        return [message if str(directory) in message else f"{Path(directory) / CONFIG_FILE}: {message}"]
    # The tensors it loads, both ways (a head class of the user's own has its own: see weight_problems).
    path = Path(directory) / WEIGHTS_FILE
    with safe_open(str(path), "pt") as handle:
        tables = bundled_tables()
        found = {
            name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys() if name not in tables
        }
    built = {name: tuple(tensor.shape) for name, tensor in exported_state(drafter).items()}
    problems = [
        f"{path}: tensor {name} is missing (the drafter's class builds it)"
        for name in built
        if name not in found
    ]
    problems += [
        f"{path}: unexpected tensor {name} (the drafter's class has no such parameter)"
        for name in found
        if name not in built
    ]
    return problems + [
        f"{path}: tensor {name} has shape {list(found[name])}, the drafter's class needs {list(shape)}"
        for name, shape in built.items()
        if name in found and found[name] != shape
    ]


def _describes_tensors(config: dict[str, Any]) -> bool:
    layer_ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    spec = export_for_config(config)
    sizes = SIZE_FIELDS + spec.size_fields
    described = all(isinstance(config.get(k), int) and config[k] > 0 for k in sizes) and isinstance(
        layer_ids, list
    )
    return described and spec.describes_tensors(config)


def reader_limits(directory: Path) -> list[str]:
    """Readers that refuse a drafter directory that keeps the contract (a DSpark drafter whose
    heads some engine does not build, a DFlash2 drafter too narrow for llama.cpp or in a layout
    SGLang does not read), one line each, as its variant's rules say; [] for every DFlash drafter."""
    try:
        config = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return []
    layout = layout_of(config)
    if layout.problems(config):
        return []  # not a drafter its readers could be asked about (check_export says why)
    zlab = layout.to_zlab(config)
    return export_for_config(zlab).reader_limits(zlab, layout=layout.name)
