"""Scalar functions the kernels of several families inline: float32 exp, log1p, erf, tanh and the logistic.

Numba has no vector math library here (no SVML), so `np.exp` and `math.erf` run one scalar libm call per
element. `fast_exp`, `fast_log1p_unit` (on [0, 1]: softplus's), `fast_erf` and `fast_tanh` are float32 polynomial
approximations (Cephes' expf and logf; Eigen's erf and tanh rational forms, within a few float32 ulps) that LLVM
vectorises, several times faster than libm's in softmax, GELU, softplus, the recurrent gates and a selective
scan's decay (bench_ops.ElementwiseOps, UnaryOps). `fast_sigmoid` runs on
fast_exp (within 2.3 ulps of float64 numpy over [-100, 100]). `gelu` and `gelu_grad` (erf form) run on them, for
the GELU kernels and the products' GELU epilogue.

Every function here is `inline="always"`: it compiles into the kernel that calls it and is never a kernel of
its own, so no call list names it. Imports numpy and kernels/jit.py only.
"""
from __future__ import annotations

import numpy as np

from .jit import intrinsic, njit, types


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits` (a register move)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@njit(cache=True, inline="always", error_model="numpy")
def fast_exp(x):
    """exp(x) in float32 (Cephes expf: 2^n · e^r, |r| ≤ ln2/2); 0 below -87.3 (e.g. -inf), +inf above 88.7."""
    x = np.float32(x)
    small = x < np.float32(-87.3)
    big = x > np.float32(88.7)
    x = min(max(x, np.float32(-87.3)), np.float32(88.7))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    value = p * _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    value = np.float32(0.0) if small else value
    return np.float32(np.inf) if big else value


@njit(cache=True, inline="always", error_model="numpy")
def fast_log1p_unit(u):
    """log(1 + u) in float32 for 0 ≤ u ≤ 1 (Cephes logf on w = 1 + u = 2^e·(1 + f), f ∈ [√½ − 1, √2 − 1],
    plus (u − (w − 1))/w, the part of u that w lost to rounding)."""
    u = np.float32(u)
    w = np.float32(1.0) + u
    big = w > np.float32(1.41421356237309505)
    f = (w * np.float32(0.5) if big else w) - np.float32(1.0)  # exact: w/2 and w are in [1, 2)
    e = np.float32(1.0) if big else np.float32(0.0)
    z = f * f
    p = np.float32(7.0376836292e-2)
    p = p * f + np.float32(-1.1514610310e-1)
    p = p * f + np.float32(1.1676998740e-1)
    p = p * f + np.float32(-1.2420140846e-1)
    p = p * f + np.float32(1.4249322787e-1)
    p = p * f + np.float32(-1.6668057665e-1)
    p = p * f + np.float32(2.0000714765e-1)
    p = p * f + np.float32(-2.4999993993e-1)
    p = p * f + np.float32(3.3333331174e-1)
    y = p * f * z + e * np.float32(-2.12194440e-4) - np.float32(0.5) * z
    return f + y + e * np.float32(0.693359375) + (u - (w - np.float32(1.0))) / w


@njit(cache=True, inline="always", error_model="numpy")
def fast_erf(x):
    """erf(x) in float32 (Eigen's rational approximation on [-4, 4]; ±1 beyond)."""
    v = min(max(np.float32(x), np.float32(-4.0)), np.float32(4.0))
    v2 = v * v
    p = v2 * np.float32(-2.72614225801306e-10) + np.float32(2.77068142495902e-08)
    p = p * v2 + np.float32(-2.10102402082508e-06)
    p = p * v2 + np.float32(-5.69250639462346e-05)
    p = p * v2 + np.float32(-7.34990630326855e-04)
    p = p * v2 + np.float32(-2.95459980854025e-03)
    p = p * v2 + np.float32(-1.60960333262415e-02)
    q = v2 * np.float32(-1.45660718464996e-05) + np.float32(-2.13374055278905e-04)
    q = q * v2 + np.float32(-1.68282697438203e-03)
    q = q * v2 + np.float32(-7.37332916720468e-03)
    q = q * v2 + np.float32(-1.42647390514189e-02)
    return v * p / q


@njit(cache=True, inline="always", error_model="numpy")
def fast_tanh(x):
    """tanh(x) in float32 (Eigen's rational approximation on [-7.9, 7.9]; x itself near 0, ±1 beyond)."""
    x = np.float32(x)
    v = min(max(x, np.float32(-7.90531110763549805)), np.float32(7.90531110763549805))
    v2 = v * v
    p = v2 * np.float32(-2.76076847742355e-16) + np.float32(2.00018790482477e-13)
    p = p * v2 + np.float32(-8.60467152213735e-11)
    p = p * v2 + np.float32(5.12229709037114e-08)
    p = p * v2 + np.float32(1.48572235717979e-05)
    p = p * v2 + np.float32(6.37261928875436e-04)
    p = p * v2 + np.float32(4.89352455891786e-03)
    q = v2 * np.float32(1.19825839466702e-06) + np.float32(1.18534705686654e-04)
    q = q * v2 + np.float32(2.26843463243900e-03)
    q = q * v2 + np.float32(4.89352518554385e-03)
    value = v * p / q
    return x if abs(x) < np.float32(0.0004) else value


@njit(cache=True, inline="always", error_model="numpy")
def fast_sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: e = exp(-|x|), then 1/(1+e) or e/(1+e)."""
    e = fast_exp(-abs(np.float32(x)))
    return (np.float32(1.0) if x >= 0 else e) / (np.float32(1.0) + e)


@njit(cache=True, inline="always", error_model="numpy")
def fast_sigmoid_pair(x):
    """(sigmoid(x), 1 - sigmoid(x)), each from e = exp(-|x|) as 1/(1+e) or e/(1+e): 1 - sigmoid(x) is never
    formed by cancellation, so both keep float32's relative accuracy."""
    e = fast_exp(-abs(np.float32(x)))
    r = np.float32(1.0) / (np.float32(1.0) + e)
    return (r, e * r) if x >= 0 else (e * r, r)


@njit(cache=True, inline="always", error_model="numpy")
def gelu(x):
    """x · Φ(x) = x/2 · (1 + erf(x/√2))."""
    return np.float32(0.5) * x * (np.float32(1.0) + fast_erf(x * np.float32(0.7071067811865476)))


@njit(cache=True, inline="always", error_model="numpy")
def gelu_grad(dy, x):
    """dy · (Φ(x) + x · φ(x))."""
    cdf = np.float32(0.5) * (np.float32(1.0) + fast_erf(x * np.float32(0.7071067811865476)))
    pdf = np.float32(0.3989422804014327) * fast_exp(np.float32(-0.5) * x * x)
    return dy * (cdf + x * pdf)
