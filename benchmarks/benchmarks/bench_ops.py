"""Single op kernels, each over one fixed array, as a step runs them (the binding's prepared calls).

UnaryOps: every unary op of the elementwise kernels (`odtrain.kernels.elementwise`, tables UNARY and
SPECIAL_UNARY: a row added there is a parameter here) over 2^20 float32 values, out of place.
"""
import numpy as np

from . import common

SIZE = 1 << 20


def unary_input(size: int, seed: int = common.SEED) -> np.ndarray:
    """float32 values in [0.5, 2): inside the domain of every unary op (Log, Sqrt, Reciprocal)."""
    return np.random.default_rng(seed).uniform(0.5, 2.0, size).astype(np.float32)


def _unary_ops() -> list[str]:
    from odtrain.kernels.elementwise import SPECIAL_UNARY, UNARY

    return [*UNARY, *SPECIAL_UNARY]


class UnaryOps:
    params = _unary_ops()
    param_names = ["op"]

    def setup(self, op):
        from odtrain.kernels import BINDINGS

        x = unary_input(SIZE)
        self.calls = BINDINGS[("", op)]([x], [np.empty_like(x)])
        self.time_forward(op)  # compiles or loads the kernel

    def time_forward(self, op):
        for kernel, args in self.calls:
            kernel(*args)
