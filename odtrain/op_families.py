"""What the two op layers share: the ONNX domain of odtrain's own ops, and how a package of op families
finds its family modules.

graph/ops/ (shape and gradient rules) and kernels/ (bindings) register the same ops under the same
(domain, op type) keys, and both fill their registry by importing every module of their folder. Those two
facts live here, once, for both:

- ODTRAIN_DOMAIN: the domain of the ops odtrain adds (gradient ops, fused losses, optimizers), so that every
  artifact is a valid ONNX file;
- `submodules(path)` and `import_submodules(package, path)`: every module of a package's folder (a source
  checkout's or an installed wheel's: whatever `__path__` holds), sorted by name so that the registries fill
  in the same order in every process; private `_` modules and the registry (LEAVES, which the family modules
  import themselves) are left out. A new family module registers by being there, with no list to edit.

A leaf below both layers: imports the standard library only, and nothing of odtrain's, so that the layering
rules (kernels import numpy and Numba only, graph numpy and onnx only) allow exactly this module besides
(tests/test_layering.py).
"""
from __future__ import annotations

import importlib
import pkgutil

ODTRAIN_DOMAIN = "ai.odtrain"
LEAVES = ("registry",)  # each package imports its registry first; the family modules import it from there


def submodules(path) -> list[str]:
    """The names of the modules in a package's folders (`path`: its `__path__`) that the package imports, sorted:
    the family modules, and the modules they share, which they import anyway."""
    return sorted(info.name for info in pkgutil.iter_modules(path)
                  if not info.name.startswith("_") and info.name not in LEAVES)


def import_submodules(package: str, path) -> None:
    """Import every module `submodules(path)` names, as `package.<name>`, in that order."""
    for name in submodules(path):
        importlib.import_module(f"{package}.{name}")
