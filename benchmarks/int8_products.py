"""How a frozen int8 convolution should run on this CPU: dequantized into float32 for BLAS, or by an
integer kernel on the int8 weights and uint8 activations.

The QDQ MobileNetV2 reads each int8 weight through DequantizeLinear before its Conv. odtrain runs that
as it stands: the weight is dequantized at each use into arena bytes that live until the Conv has
read them, then the float32 convolution (im2col + BLAS sgemm). The alternative is an integer kernel
(uint8 x int8 products summed in int32, then requantized), which would also skip dequantizing the
activation. This script times the matrix products of MobileNetV2's pointwise convolutions at batch 8,
224x224, both ways, in one process:
  float:   DequantizeLinear of the weight (odtrain's kernel) + sgemm on the float activation
  integer: a Numba int32-accumulating product of uint8 activations and int8 weights (the loop LLVM
           vectorises best here: over the output's columns), + nothing else
and, for scale, the DequantizeLinear of the activation that the integer path would save.

    python benchmarks/int8_products.py [--repeat 7]

Timing is noisy on a shared machine: each figure is the median of --repeat runs.
"""
import argparse
import statistics
import time

import numpy as np
from numba import njit

from odtrain import jit
from odtrain.kernels.quantize import DEQUANTIZE, affine_call

# (output channels M, input channels K, cells per image) of MobileNetV2's pointwise convolutions at 224x224
SHAPES = [(96, 16, 112 * 112), (144, 24, 56 * 56), (192, 32, 28 * 28), (384, 64, 14 * 14), (960, 160, 7 * 7),
          (1280, 320, 7 * 7)]
BATCH = 8


@njit(cache=True)
def integer_product(w, x, acc):
    """acc[m, n] = Σ_k w[m, k] · x[k, n] in int32, for int8 w and uint8 x (zero points folded elsewhere)."""
    acc[:] = 0
    for m in range(w.shape[0]):
        row = acc[m]
        for k in range(w.shape[1]):
            weight = np.int32(w[m, k])
            column = x[k]
            for n in range(x.shape[1]):
                row[n] += weight * np.int32(column[n])


@njit(cache=True)
def float_product(w, x, out):
    np.dot(w, x, out)


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    jit.load()
    rng = np.random.default_rng(0)
    scale, zero = np.array(0.01, np.float32), np.array(0, np.int8)
    totals = {"float": 0.0, "integer": 0.0, "activation DQ": 0.0}
    print(f"{'M x K x cells':>18} {'float (DQ w + sgemm)':>22} {'integer (int32 acc)':>20} {'activation DQ':>14}  ms")
    for m, k, cells in SHAPES:
        w8 = rng.integers(-128, 128, size=(m, k)).astype(np.int8)
        x8 = rng.integers(0, 256, size=(k, cells)).astype(np.uint8)
        w32, x32 = np.empty((m, k), np.float32), rng.standard_normal((k, cells)).astype(np.float32)
        out32, acc = np.empty((m, cells), np.float32), np.empty((m, cells), np.int32)
        dequantize_w = affine_call(DEQUANTIZE, w8, scale, zero, w32)
        dequantize_x = affine_call(DEQUANTIZE, x8, scale, np.array(0, np.uint8), x32)

        def float_path():
            dequantize_w[0](*dequantize_w[1])
            for _ in range(BATCH):
                float_product(w32, x32, out32)

        def integer_path():
            for _ in range(BATCH):
                integer_product(w8, x8, acc)

        def activation_dequantize():
            for _ in range(BATCH):
                dequantize_x[0](*dequantize_x[1])

        row = {"float": median_ms(float_path, args.repeat), "integer": median_ms(integer_path, args.repeat),
               "activation DQ": median_ms(activation_dequantize, args.repeat)}
        for key in totals:
            totals[key] += row[key]
        print(f"{f'{m} x {k} x {cells}':>18} {row['float']:>22.2f} {row['integer']:>20.2f} {row['activation DQ']:>14.2f}")
    print(f"{'total':>18} {totals['float']:>22.2f} {totals['integer']:>20.2f} {totals['activation DQ']:>14.2f}")
    print(f"integer / float: {totals['integer'] / totals['float']:.1f}x the time")


if __name__ == "__main__":
    main()
