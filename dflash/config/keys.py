"""Refuse config keys the schema does not know.

Hydra's hint for an unknown key (`To append to your config use +loss.gamm=5`) invites exactly the
`+` form, and a `+key` that no code reads is silently ignored: a typo in a sweep would run the
whole sweep on the default. After composition every key must be a field of the schema
dataclasses; only the free-form dict fields (`target.arch`, `eval.benchmarks`, ...) take any key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf


def schema_keys(schema: type, prefix: str = "") -> tuple[set[str], set[str]]:
    """(every dotted field path of the dataclass tree, the paths of free-form dict fields)."""
    known, free_form = set(), set()
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        path = f"{prefix}{field.name}"
        known.add(path)
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            sub_known, sub_free = schema_keys(kind, f"{path}.")
            known |= sub_known
            free_form |= sub_free
        elif dict in (typing.get_origin(kind), *(typing.get_origin(a) for a in typing.get_args(kind))):
            free_form.add(path)
    return known, free_form


def _option_schema_keys(node: Any, prefix: str, known: set[str], free_form: set[str]) -> None:
    """Adds the keys of each component node's own option schema (MaskRampNoiseConfig's `start`,
    beside the group's base NoiseConfig fields) to `known` and `free_form`, in place."""
    if not isinstance(node, DictConfig) or prefix.rstrip(".") in free_form:
        return
    node_type = OmegaConf.get_type(node)
    if prefix and dataclasses.is_dataclass(node_type):
        own_known, own_free = schema_keys(node_type, prefix)
        known |= own_known
        free_form |= own_free
    for key in node.keys():
        _option_schema_keys(node._get_node(key), f"{prefix}{key}.", known, free_form)


def _unknown(node: Any, prefix: str, known: set[str], free_form: set[str]) -> list[str]:
    """Dotted paths under `node` that the schema lacks (an unknown subtree counts once)."""
    if not isinstance(node, DictConfig) or prefix.rstrip(".") in free_form:
        return []
    unknown = []
    for key in node.keys():
        path = f"{prefix}{key}"
        if path not in known:
            unknown.append(path)
        else:
            unknown += _unknown(node._get_node(key), f"{path}.", known, free_form)
    return unknown


def _suggestions(path: str, known: set[str]) -> list[str]:
    parent, _, name = path.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(name, sorted(siblings), n=2, cutoff=0.6)
    if close:
        return [siblings[c] for c in close]
    return difflib.get_close_matches(path, sorted(known), n=2, cutoff=0.75)


def refuse_unknown_keys(cfg: DictConfig, schema: type, ignore: tuple[str, ...] = ("hydra",)) -> None:
    """ValueError naming the first key the schema does not have, with the nearest known keys."""
    known, free_form = schema_keys(schema)
    _option_schema_keys(cfg, "", known, free_form)
    unknown = [p for p in _unknown(cfg, "", known, free_form) if p.split(".")[0] not in ignore]
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], known, others=unknown[1:4]))


def unknown_key_message(key: str, known: set[str], others: list[str] | tuple[str, ...] = ()) -> str:
    """The refusal of an unknown key, with the nearest known keys: written once for the `+key`
    refusal above and for Hydra's own refusal of `key=value` (dflash/tools/hydra_app.py)."""
    if key in known:  # a field of another option of the group (noise.start under noise=none)
        group = key.split(".")[0]
        return (
            f"config key {key!r} is not a setting of the chosen {group} option; pick an option "
            f"that has it ({group}=...) or see `--cfg job` for this option's keys"
        )
    close = _suggestions(key, known)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    also = f" (and {', '.join(others)})" if others else ""
    return f"unknown config key {key!r}{also}: no dflash setting reads it{hint}"
