"""odtrain: train ONNX models on the device that holds the data.

`odtrain.artifacts.generate_artifacts` prepares a forward-only ONNX model for
training (offline); `odtrain.api` trains it on the device with ONNX Runtime
training's API; `odtrain.InferenceSession` runs a model as
`onnxruntime.InferenceSession` does. Heavy modules load on first use (the
names below that need them resolve through `__getattr__`), so `import odtrain`
imports neither numpy, Numba nor onnx.
"""
import os as _os

# Installed, graph/ and kernels/ are mapped to odtrain.graph and odtrain.kernels (pyproject.toml).
# Run from a source checkout, they sit beside this folder: let the same names resolve there.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "graph", "ir.py")) and _checkout not in __path__:
    __path__.append(_checkout)

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
