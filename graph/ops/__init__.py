"""The op registry (graph/ops/registry.py) filled by the op families, one module each.

Importing this package imports every module of its folder (sorted by name, so the registry fills in
the same order in every process; private `_` modules and the registry itself excepted: the rule
odtrain/op_families.py holds for graph/ops and kernels both): a new family module registers its ops by
being there, with no list to edit. The family modules import the registry from `.registry`, never from
this package. The names below are the registry's, re-exported.
"""
from __future__ import annotations

from functools import partial

from ...op_families import import_submodules, submodules as _modules_of
from .registry import (OPS, GradContext, OpDef, attr_axes, broadcast_shapes, check_supported, eval_form, grad,
                       is_view, lookup, no_grad, op, same_as_input, upgrade, upgrade_legacy_nodes)

submodules = partial(_modules_of, __path__)  # the modules imported below: odtrain/op_families.py's rule
import_submodules(__name__, __path__)

__all__ = ["OPS", "OpDef", "op", "grad", "no_grad", "eval_form", "check_supported", "lookup", "is_view", "GradContext",
           "broadcast_shapes", "same_as_input", "attr_axes", "upgrade", "upgrade_legacy_nodes", "submodules"]
