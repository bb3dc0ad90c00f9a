"""odtrain: train ONNX models on the device that holds the data.

`odtrain.artifacts.generate_artifacts` prepares a forward-only ONNX model for
training (offline); `odtrain.api` trains it on the device with ONNX Runtime
training's API; `odtrain.InferenceSession` runs a model as
`onnxruntime.InferenceSession` does. Heavy modules load on first use (the
names below that need them resolve through `__getattr__`), so `import odtrain`
imports neither numpy, Numba nor onnx.
"""
import os as _os
import sys as _sys

# graph/ and kernels/ sit beside odtrain/ at the top of the repository, and are the packages odtrain.graph and
# odtrain.kernels: an install maps them so (pyproject.toml's [tool.setuptools.package-dir], which
# tests/test_layering.py checks against this table); run from a source checkout, the finder below maps exactly
# these two names to their folders, and no other folder of the checkout becomes part of odtrain.
CHECKOUT_PACKAGES = {"odtrain.graph": "graph", "odtrain.kernels": "kernels"}


class _CheckoutFinder:
    """Finds odtrain.graph and odtrain.kernels in the checkout at `root` (their subpackages and modules then
    resolve through the package's own `__path__`). First on sys.meta_path, so that a checkout imported from
    its root uses its own folders, whatever odtrain another install maps elsewhere."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = CHECKOUT_PACKAGES.get(fullname)
        if folder is None:
            return None
        from importlib.util import spec_from_file_location

        location = _os.path.join(self.root, folder)
        return spec_from_file_location(fullname, _os.path.join(location, "__init__.py"),
                                       submodule_search_locations=[location])


_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "graph", "ir.py")) and not any(
        isinstance(finder, _CheckoutFinder) and finder.root == _checkout for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _CheckoutFinder(_checkout))

# Where the compiled kernels are cached (ODTRAIN_CACHE_DIR, else Numba's choice), set before numba loads.
from .jit.cache import configure as _configure_cache  # noqa: E402

_configure_cache()

from .graph.errors import (  # noqa: E402
    ArgumentError,
    ArtifactNotFoundError,
    CheckpointError,
    InputError,
    KernelsUnavailableError,
    MemoryBudgetError,
    ModelError,
    NonFiniteError,
    OdtrainError,
    ParameterError,
    StateError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

_LAZY = {"InferenceSession": "inference"}  # top-level name -> the module that defines it, imported on first use

__all__ = [
    "OdtrainError", "ModelError", "UnsupportedOpError", "InputError", "ArgumentError",
    "ParameterError", "CheckpointError", "ArtifactNotFoundError", "StateError", "NonFiniteError", "MemoryBudgetError",
    "KernelsUnavailableError", "__version__",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'odtrain' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
