"""Components named by `_target_` in their config node, built with hydra.utils.instantiate.

A node (a schema dataclass, or a mapping for the free-form `logger.sinks` and `callbacks`) names
a class or function and its keyword arguments; a `_partial_` node also takes runtime objects (a
planner the samples' lengths, an optimizer the parameters) when it is built. `check_buildable`
resolves the target and matches its signature against the node's keys and those runtime names
before anything is built, so a user class that cannot be imported or does not take the
arguments is refused in one line naming the config key, before any weights load.

No torch here: the launcher and the tools check every component while composing.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any

# Instantiate's own keys: not constructor arguments.
_SPECIAL = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


def node_items(node: Any) -> dict[str, Any]:
    """The node's keys and values: a schema dataclass's fields or a mapping's entries."""
    if dataclasses.is_dataclass(node):
        return {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    return dict(node.items())


def target_of(node: Any, key: str) -> str:
    target = node_items(node).get("_target_")
    if not isinstance(target, str) or not target:
        raise ValueError(f"{key} needs a _target_ (the class or function to build), e.g. {key}._target_=my_module.MyClass")  # fmt: skip
    return target


def check_buildable(node: Any, key: str, *, runtime: Iterable[str] = (), exclude: Iterable[str] = ()) -> Any:
    """The node's target object, once it is known to import and to accept the node's keys (less
    `exclude`) plus the `runtime` keyword arguments it will get; else a ValueError naming `key`."""
    from hydra.utils import get_object

    target = target_of(node, key)
    try:
        built_by = get_object(target)
    except Exception as exc:  # an import error, a missing attribute, a module that fails to load
        raise ValueError(f"{key}._target_={target!r} cannot be imported ({exc})") from exc
    if not callable(built_by):  # a module, a constant: instantiate would fail after loading
        kind = "a module" if inspect.ismodule(built_by) else f"a {type(built_by).__name__}"
        raise ValueError(f"{key}._target_={target!r} is {kind}, not a class or function to build")
    arguments = {k: v for k, v in node_items(node).items() if k not in _SPECIAL and k not in set(exclude)}
    arguments.update(dict.fromkeys(runtime))
    try:
        signature = inspect.signature(built_by)
    except (TypeError, ValueError):  # no Python signature (a builtin): the call will say
        return built_by
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        raise ValueError(
            f"{key}: {target} does not take the arguments it would be built with "
            f"({', '.join(sorted(arguments)) or 'none'}): {exc}"
        ) from exc
    return built_by


def build(node: Any, key: str, *, exclude: Iterable[str] = (), **runtime: Any) -> Any:
    """hydra.utils.instantiate of the node (less `exclude`; containers converted to plain lists
    and dicts), then a call with the `runtime` keyword arguments. Runtime objects never pass
    through instantiate itself: it would copy them into a config (a resolved run config holds
    `_target_` keys of its own, which it would then try to build)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_buildable(node, key, runtime=runtime, exclude=exclude)
    spec = {k: v for k, v in node_items(node).items() if k not in set(exclude)}
    if runtime:
        spec["_partial_"] = True
    try:
        made = instantiate(spec, _convert_="all")
        return made(**runtime) if spec.get("_partial_") else made
    except (ValueError, OSError):
        raise  # a refusal of the component's own: it names what is wrong
    except InstantiationException as exc:  # Hydra's wrapper of the constructor's error
        cause = exc.__cause__ or exc
        raise ValueError(
            f"{key}: building {spec['_target_']} failed ({type(cause).__name__}: {cause})"
        ) from exc
    except Exception as exc:  # the constructor itself raised (a user's class): one line, the key
        raise ValueError(f"{key}: building {spec['_target_']} failed ({type(exc).__name__}: {exc})") from exc
