"""A drafter variant's options are written once, in its config dataclass
(dflash/config/variant_schema.py): the YAML option (conf/variant/NAME.yaml) starts from it and
repeats no value, the training side's class (dflash/step/variant.py) takes them with
`variant_options`, and `variant=NAME` composes to exactly the config pinned here, key order
included (runs are reviewed by config diffs; sweeps override these keys)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf

from dflash.config.schema import COMPONENT_OPTIONS
from dflash.config.variant_schema import DSparkVariantConfig, VariantConfig, variant_options
from dflash.tools.compose import CONF_DIR
from tests.conftest import compose_config

VARIANT_OPTIONS = COMPONENT_OPTIONS["variant"]
# The package's variants: those whose options dflash defines. A test module registers a variant
# of its own too (tests/test_variant_training.py), or not, by which modules this run collects.
PACKAGE_VARIANTS = sorted(
    name for name, options in VARIANT_OPTIONS.items() if options.__module__.partition(".")[0] == "dflash"
)

# `dflash train variant=NAME --cfg job`'s variant node, as every earlier release composed it.
PINNED = {
    "dflash": """\
_target_: dflash.step.variant.DFlashVariant
""",
    "dspark": """\
_target_: dflash.step.variant.DSparkVariant
markov_rank: 256
markov_head_type: vanilla
markov_head_class: null
confidence_head: true
confidence_with_markov: true
ce_weight: 0.1
tv_weight: 0.9
confidence_weight: 1.0
fused_terms: auto
""",
    "dflash2": """\
_target_: dflash.step.variant.DFlash2Variant
conv_kernel_size: 2
conv_group_size: null
selector_rank: 256
selector_top_k: null
selector_alpha: 1.0
""",
    "lilicorr": """\
_target_: dflash.step.lilicorr_variant.LiLiCorrVariant
candidate_topk: 8
hidden_size: null
factor_dim: null
num_layers: 2
num_heads: 8
mlp_ratio: 2.0
logit_scale: 8.0
vector_eps: 0.0001
ce_weight: 0.25
margin_weight: 0.0
penalty_weight: 0.25
margin: 2.0
conv_kernel_size: null
conv_group_size: null
""",
}


def composed_variant(name: str, *overrides: str, run_dir=None):
    """The composed config of `variant=NAME`; `run_dir` for a config that is resolved."""
    return compose_config([f"variant={name}", *overrides], output_dir=run_dir, cache_dir=run_dir)


def test_every_variant_option_is_pinned():
    assert (
        {path.stem for path in (CONF_DIR / "variant").glob("*.yaml")} == set(PACKAGE_VARIANTS) == set(PINNED)
    )


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_variant_composes_to_its_pinned_config(name):
    assert OmegaConf.to_yaml(composed_variant(name).variant) == PINNED[name]


@pytest.mark.parametrize("name", PACKAGE_VARIANTS)
def test_each_variant_yaml_starts_from_its_dataclass_and_repeats_no_option(name):
    """The YAML option holds its schema's name and nothing else: a value written there too would
    be a second source, free to drift from the dataclass and the training side."""
    text = (CONF_DIR / "variant" / f"{name}.yaml").read_text()
    assert yaml.safe_load(text) == {"defaults": [f"/schema/variant/{name}@_here_"]}
    composed = OmegaConf.to_yaml(composed_variant(name).variant)
    assert composed == OmegaConf.to_yaml(OmegaConf.structured(VARIANT_OPTIONS[name]))


@pytest.mark.parametrize("name", PACKAGE_VARIANTS)
def test_each_training_variant_takes_its_config_options_and_defaults(name, tmp_path):
    """The class `_target_` names has the config's options as its fields, same order, same
    defaults: a variant built without a config (a test, a tool) is the composed default one."""
    from dflash.config.typed import typed_config
    from dflash.step.build import build_variant

    config_class = VARIANT_OPTIONS[name]
    variant_class = get_class(config_class._target_)
    options = [(f.name, f.default) for f in dataclasses.fields(config_class) if f.name != "_target_"]
    assert [(f.name, f.default) for f in dataclasses.fields(variant_class)] == options
    assert build_variant(typed_config(composed_variant(name, run_dir=tmp_path)).variant) == variant_class()


def test_an_override_reaches_the_built_variant_and_leaves_the_other_defaults(tmp_path):
    from dflash.config.typed import typed_config
    from dflash.step.build import build_variant
    from dflash.step.variant import DSparkVariant

    overrides = ("variant.ce_weight=0.2", "variant.markov_head_type=gated")
    cfg = typed_config(composed_variant("dspark", *overrides, run_dir=tmp_path))
    built = build_variant(cfg.variant)
    assert built == DSparkVariant(ce_weight=0.2, markov_head_type="gated")
    assert built.head_type == "gated" and built.tv_weight == DSparkVariantConfig.tv_weight


def test_variant_options_gives_a_class_the_options_of_its_config():
    """A variant of one's own: its config's options (a default factory too) become the training
    side's fields, in order; declaring one of them again on the class is refused."""

    @dataclass
    class WindowedConfig(VariantConfig):
        _target_: str = "my_variants.Windowed"
        radius: int = 3
        taps: list[float] = field(default_factory=lambda: [0.5, 0.5])

    @dataclass(frozen=True)
    @variant_options(WindowedConfig)
    class Windowed:
        name = "windowed"

    assert [f.name for f in dataclasses.fields(Windowed)] == ["radius", "taps"]
    assert Windowed() == Windowed(radius=3, taps=[0.5, 0.5]) and Windowed(radius=1).radius == 1
    assert Windowed().taps is not Windowed().taps
    with pytest.raises(
        TypeError, match=r"Twice\.radius is an option of .*WindowedConfig: declare it there only"
    ):

        @dataclass(frozen=True)
        @variant_options(WindowedConfig)
        class Twice:
            radius: int = 4


def test_the_configuration_doc_names_every_option_of_every_variant():
    """docs/configuration.md's `variant` section names each option (its defaults stay beside the
    fields, where they are written once)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    section = doc.split("\n## variant\n", 1)[1].split("\n## ", 1)[0]
    for name in PACKAGE_VARIANTS:
        assert f"`{name}`" in section, name
        config_class = VARIANT_OPTIONS[name]
        for option in dataclasses.fields(config_class):
            if option.name != "_target_":
                assert f"`{option.name}`" in section, f"variant.{option.name}"
