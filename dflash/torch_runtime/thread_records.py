"""transformers' and `kernels`' per-call records kept per thread while another thread compiles.

Both libraries keep a record for the forward in hand in a `CompileableContextVar`: a context
variable (one value per thread) in eager code, a plain attribute while dynamo traces (dynamo
cannot trace `ContextVar.get`). transformers' is the output collector its hooks fill for
`output_hidden_states=True` (dflash's features); `kernels`' is the table of active kernel
functions every attention forward sets and resets. They tell the two cases apart by
`torch.compiler.is_compiling()`, which in torch 2.13 (pytorch/pytorch#184614) is true in every
thread for a whole compile session. So while one thread compiles (the drafter's first
step, a recompile), every other thread's eager transformers forward shares one attribute: a
target thread's hooks filled another thread's collector or none (features lost or swapped),
and a reset stored a context token where `kernels` expects a table ("'Token' object has no
attribute 'get'"). `torch.compiler.is_dynamo_compiling()` is true only inside dynamo's trace
of the code that asks, which is the case each library means; `keep_records_per_thread`
gives the two records subclasses that ask it. Traced code takes the same path as
before; eager code keeps its own record per thread.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# (module, attribute, the record's fields the per-thread methods use) of each record; absent
# with older transformers or without `kernels`.
_TRANSFORMERS_COLLECTOR = (
    "transformers.utils.output_capturing",
    "_active_collector",
    ("context_var", "global_var", "compiling"),
)
_KERNELS_TABLE = (
    "kernels._internals.layer.layer",
    "_ACTIVE_KERNEL_FUNCS",
    ("context_var", "global_var", "uses_global_var"),
)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _collector_class(base: type) -> type:
    class PerThreadCollector(base):
        """transformers' collector: the shared attribute only inside dynamo's trace."""

        def set(self, value):
            if torch.compiler.is_dynamo_compiling():
                self.global_var = value
                self.compiling = True
                return None
            return self.context_var.set(value)

    return PerThreadCollector


def _kernel_table_class(base: type) -> type:
    class PerThreadKernelTable(base):
        """`kernels`' active-function table: the shared attribute only inside dynamo's trace
        (or while a traced `set` left it in use, as the library's own `reset` decides)."""

        def get(self):
            if self.uses_global_var or torch.compiler.is_dynamo_compiling():
                return self.global_var
            return self.context_var.get()

        def set(self, value):
            if self.uses_global_var or torch.compiler.is_dynamo_compiling():
                previous = self.global_var
                self.global_var = value
                self.uses_global_var = True
                return previous
            return self.context_var.set(value)

    return PerThreadKernelTable


def _replace(location: tuple[str, str, tuple[str, ...]], make_class) -> None:
    module_name, name, fields = location
    module = _module(module_name)
    record = getattr(module, name, None) if module is not None else None
    if record is None or getattr(type(record), "_dflash_per_thread", False):
        return
    if not all(field in vars(record) for field in fields):
        # Another release's layout: the methods below would not fit it; left as it is.
        log.warning(
            "%s.%s has fields %s, not %s: left shared between threads while compiling",
            module_name,
            name,
            sorted(vars(record)),
            list(fields),
        )
        return
    per_thread = make_class(type(record))
    per_thread._dflash_per_thread = True
    # The same object, its class swapped: every reference to it (a forward in hand included)
    # sees the per-thread methods, and its context variable keeps its values.
    record.__class__ = per_thread


def keep_records_per_thread() -> None:
    """Make transformers' output collector and `kernels`' active-function table, where
    installed, per-thread records (idempotent; called before threads run a target)."""
    _replace(_TRANSFORMERS_COLLECTOR, _collector_class)
    _replace(_KERNELS_TABLE, _kernel_table_class)
