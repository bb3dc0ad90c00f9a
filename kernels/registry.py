"""The kernel registry: each op's binding, its scratch-size function and whether it runs in parallel parts.

A leaf of kernels/ (it imports none of its modules): each family module imports `binding` from here, and
importing the package `kernels` imports every family module, which fills BINDINGS, SCRATCH and PARALLEL
(see kernels/__init__.py for what a binding is). Imports nothing but odtrain/op_families.py, for
ODTRAIN_DOMAIN, the domain of the ops odtrain adds.
"""
from __future__ import annotations

from ..op_families import ODTRAIN_DOMAIN  # noqa: F401  (the family modules import it from here)

BINDINGS: dict[tuple[str, str], object] = {}
SCRATCH: dict[tuple[str, str], object] = {}
PARALLEL: set[tuple[str, str]] = set()


def binding(op_type: str, domain: str = "", scratch=None, parallel: bool = False):
    """Register a binding under (domain, op_type), with its scratch-size function if it needs one; a
    `parallel` binding (and its scratch-size function) takes the step's thread count as `threads=`."""

    def register(fn):
        BINDINGS[(domain, op_type)] = fn
        if scratch is not None:
            SCRATCH[(domain, op_type)] = scratch
        if parallel:
            PARALLEL.add((domain, op_type))
        return fn

    return register
