"""Quantization kernels on a MobileNetV2-sized activation (batch 8, 96 channels, 56x56; per tensor, uint8),
each bound once as the executor binds it: QuantizeLinear, DequantizeLinear, the training model's
FakeQuantize (in place, as the planner places it) and its straight-through gradient.
"""
import numpy as np

from . import common

SHAPE = (8, 96, 56, 56)


class QuantizeKernels:
    params = ["QuantizeLinear", "DequantizeLinear", "FakeQuantize", "FakeQuantizeGrad"]
    param_names = ["op"]

    def setup(self, op):
        from odtrain import jit
        from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN

        jit.load()
        rng = np.random.default_rng(common.SEED)
        x = rng.standard_normal(SHAPE).astype(np.float32)
        scale, zero = np.array(0.02, np.float32), np.array(128, np.uint8)
        quantized = np.empty(SHAPE, np.uint8)
        if op == "QuantizeLinear":
            inputs, outputs = [x, scale, zero], [quantized]
        elif op == "DequantizeLinear":
            inputs, outputs = [rng.integers(0, 256, SHAPE).astype(np.uint8), scale, zero], [x]
        elif op == "FakeQuantize":
            inputs, outputs = [x, scale, zero], [x]  # in place
        else:
            dy = rng.standard_normal(SHAPE).astype(np.float32)
            inputs, outputs = [dy, x, scale, zero], [dy]  # in place over dy
        domain = "" if op in ("QuantizeLinear", "DequantizeLinear") else ODTRAIN_DOMAIN
        self.calls = BINDINGS[(domain, op)](inputs, outputs)
        self.time_op(op)  # compiles or loads the kernel

    def time_op(self, op):
        for kernel, args in self.calls:
            kernel(*args)
