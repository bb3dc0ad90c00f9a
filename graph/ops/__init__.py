"""The op registry (graph/ops/registry.py) filled by the op families, one module each.

Importing this package imports every module of its folder (sorted by name, so the registry fills in
the same order in every process; private `_` modules and the registry itself excepted): a new family
module registers its ops by being there, with no list to edit. The family modules import the registry
from `.registry`, never from this package. The names below are the registry's, re-exported.
"""
from __future__ import annotations

import importlib
import pkgutil

from .registry import (OPS, GradContext, OpDef, attr_axes, broadcast_shapes, check_supported, eval_form, grad,
                       is_view, lookup, no_grad, op, same_as_input, upgrade, upgrade_legacy_nodes)

LEAVES = ("registry",)  # imported above; the family modules import it


def submodules() -> list[str]:
    """The names of the modules in this package's folder (a source checkout's or an installed wheel's:
    whatever `__path__` holds) that the package imports, sorted: the family modules, and the helpers they
    share (windows.py), which they import anyway."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__)
                  if not info.name.startswith("_") and info.name not in LEAVES)


for _name in submodules():
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["OPS", "OpDef", "op", "grad", "no_grad", "eval_form", "check_supported", "lookup", "is_view", "GradContext",
           "broadcast_shapes", "same_as_input", "attr_axes", "upgrade", "upgrade_legacy_nodes", "submodules"]
