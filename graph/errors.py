"""The odtrain error family.

Every error a user can cause is an `OdtrainError`, and also the matching
built-in exception, so `except ValueError` keeps working. Messages name the
file, node, input or parameter at fault and say what to do.

Defined here, at the bottom layer, so that `odtrain.graph` can raise them
without importing `odtrain`; `odtrain` re-exports them.
"""


class OdtrainError(Exception):
    """Base class of every error odtrain raises for a user's input or call."""


class ModelError(OdtrainError, ValueError):
    """An ONNX model that odtrain cannot load, train or export."""


class UnsupportedOpError(ModelError):
    """A node whose op type has no forward kernel or gradient rule."""


class InputError(OdtrainError, ValueError):
    """Feeds of the wrong number, name, dtype or shape."""


class ArgumentError(OdtrainError, ValueError):
    """An argument with a value that odtrain cannot use."""


class ParameterError(OdtrainError, KeyError):
    """A parameter name that the model or checkpoint does not have."""

    def __str__(self):  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class CheckpointError(OdtrainError, ValueError):
    """A checkpoint file that is damaged, truncated, foreign or of another version."""


class ArtifactNotFoundError(OdtrainError, FileNotFoundError):
    """A model, checkpoint or artifact path that does not exist."""


class StateError(OdtrainError, RuntimeError):
    """An API call made in a state where it cannot work (e.g. step before any gradient)."""


class NonFiniteError(OdtrainError, FloatingPointError):
    """A NaN or infinity in an input, the loss or a gradient, found by Module(..., check_finite=True)."""


class MemoryBudgetError(OdtrainError, ValueError, MemoryError):
    """A plan that does not fit: a memory budget that no plan, even with recomputation, can meet (names
    the smallest that works), or an arena or constant larger than the machine can hold (names the plan's
    size, its largest values and the memory budget that would fit, if any). `smallest_bytes`: the
    smallest arena odtrain can plan for the step, when known."""

    def __init__(self, message: str, smallest_bytes: int | None = None):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


class KernelsUnavailableError(OdtrainError, RuntimeError):
    """A step whose kernels neither a kernel library holds nor Numba can compile (a device without Numba):
    names the library's folder or the node, kernel and argument types missing, and the `odtrain compile`
    command that builds them."""
