"""Elementwise kernels: unary maps, same-shape binaries and broadcasting binaries.

Op codes (arguments, so one compiled kernel serves a family):
  binary: 0 add, 1 sub, 2 mul, 3 div, 4 relu-grad(dy, y), 5 sigmoid-grad(dy, y), 6 tanh-grad(dy, y)
  unary:  0 neg, 1 abs, 2 exp, 3 log, 4 relu, 5 sigmoid, 6 tanh, 7 sign, 8 sqrt, 9 reciprocal, 10 copy
"""
from __future__ import annotations


import numpy as np
from numba import njit

from . import ODTRAIN_DOMAIN, binding
from .layout import broadcast_layout, flat

BINARY = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "ReluGrad": 4, "SigmoidGrad": 5, "TanhGrad": 6}
UNARY = {"Neg": 0, "Abs": 1, "Exp": 2, "Log": 3, "Relu": 4, "Sigmoid": 5, "Tanh": 6, "Sign": 7,
         "Sqrt": 8, "Reciprocal": 9, "Identity": 10}
COPY = UNARY["Identity"]


@njit(cache=True, inline="always")
def _binary_op(code, x, y):
    if code == 0:
        return x + y
    if code == 1:
        return x - y
    if code == 2:
        return x * y
    if code == 3:
        return x / y
    if code == 4:  # dy * (y > 0)
        return x if y > 0 else x * 0
    if code == 5:  # dy * y * (1 - y)
        return x * y * (1 - y)
    return x * (1 - y * y)  # 6: dy * (1 - y²)


@njit(cache=True, inline="always")
def _unary_op(code, x):
    if code == 0:
        return -x
    if code == 1:
        return abs(x)
    if code == 2:
        return np.exp(x)
    if code == 3:
        return np.log(x)
    if code == 4:
        return x if x > 0 else x * 0
    if code == 5:  # overflow-free logistic
        if x >= 0:
            return 1 / (1 + np.exp(-x))
        e = np.exp(x)
        return e / (1 + e)
    if code == 6:
        return np.tanh(x)
    if code == 7:
        return (x > 0) - (x < 0) + x * 0
    if code == 8:
        return np.sqrt(x)
    if code == 9:
        return 1 / x
    return x  # 10: copy


@njit(cache=True, error_model="numpy")
def _unary(code, x, out):
    """out[i] = f(x[i]) over flat arrays. One loop per op, so each vectorises."""
    n = out.size
    if code == 0:
        for i in range(n):
            out[i] = -x[i]
    elif code == 1:
        for i in range(n):
            out[i] = abs(x[i])
    elif code == 4:
        for i in range(n):
            out[i] = max(x[i], 0)
    elif code == 10:
        for i in range(n):
            out[i] = x[i]
    else:
        for i in range(n):
            out[i] = _unary_op(code, x[i])


@njit(cache=True, error_model="numpy")
def _binary(code, a, b, out):
    """out[i] = f(a[i], b[i]) over flat arrays of one size. One loop per op, so each vectorises."""
    n = out.size
    if code == 0:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif code == 1:
        for i in range(n):
            out[i] = a[i] - b[i]
    elif code == 2:
        for i in range(n):
            out[i] = a[i] * b[i]
    elif code == 3:
        for i in range(n):
            out[i] = a[i] / b[i]
    elif code == 4:
        for i in range(n):
            out[i] = a[i] if b[i] > 0 else 0
    else:
        for i in range(n):
            out[i] = _binary_op(code, a[i], b[i])


@njit(cache=True, error_model="numpy")
def _binary_scalar(code, a, b, out):
    """out[i] = f(a[i], b[0])."""
    y = b[0]
    for i in range(out.size):
        out[i] = _binary_op(code, a[i], y)


@njit(cache=True, error_model="numpy")
def _binary_strided(code, a, b, out, dims, sa, sb):
    """out (flat, C order over dims) = f(a[strided], b[strided]) over a 4-D layout."""
    k = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ia = i0 * sa[0] + i1 * sa[1] + i2 * sa[2]
                ib = i0 * sb[0] + i1 * sb[1] + i2 * sb[2]
                for i3 in range(dims[3]):
                    out[k] = _binary_op(code, a[ia + i3 * sa[3]], b[ib + i3 * sb[3]])
                    k += 1


@njit(cache=True, error_model="numpy")
def _gather_strided(x, out, dims, sx, scale):
    """out (flat, C order over dims) = x[strided] · scale: transpose, expand."""
    k = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                for i3 in range(dims[3]):
                    out[k] = x[ix + i3 * sx[3]] * scale
                    k += 1


def binary_calls(code: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> list:
    """The cheapest kernel call computing out = f(a, b) with broadcasting."""
    if a.shape == out.shape and b.shape == out.shape:
        return [(_binary, (code, flat(a), flat(b), flat(out)))]
    if a.shape == out.shape and b.size == 1:
        return [(_binary_scalar, (code, flat(a), flat(b), flat(out)))]
    dims, _, sa, sb = broadcast_layout(out.shape, a.shape, b.shape)
    return [(_binary_strided, (code, flat(a), flat(b), flat(out), dims, sa, sb))]


def gather_call(x: np.ndarray, out: np.ndarray, dims, strides, scale: float = 1.0):
    return (_gather_strided, (flat(x), flat(out), dims, strides, out.dtype.type(scale)))


def _make_binary(code):
    def bind(inputs, outputs):
        return binary_calls(code, inputs[0], inputs[1], outputs[0])

    return bind


def _make_unary(code):
    def bind(inputs, outputs):
        return [(_unary, (code, flat(inputs[0]), flat(outputs[0])))]

    return bind


for _name, _code in BINARY.items():
    binding(_name, ODTRAIN_DOMAIN if _name.endswith("Grad") else "")(_make_binary(_code))
for _name, _code in UNARY.items():
    binding(_name)(_make_unary(_code))


@binding("Sum")
def Sum(inputs, outputs):
    """out = x0 + x1 + ...; the first pair writes out, the rest add into it."""
    out = outputs[0]
    if len(inputs) == 1:
        return _make_unary(COPY)(inputs, outputs)
    calls = binary_calls(BINARY["Add"], inputs[0], inputs[1], out)
    for extra in inputs[2:]:
        calls += binary_calls(BINARY["Add"], out, extra, out)
    return calls


