"""Elementwise kernels: unary maps, same-shape binaries, broadcasting binaries, comparisons, float
classes (IsNaN, IsInf: one kernel), Where.

Unary ops come from one table per loop, each row an op type and its scalar function: `UNARY`
(cheap maps, one loop `_unary`), `SPECIAL_UNARY` (erf and GELU's tanh form, loop `_special_unary`)
and `RARE_UNARY` (the functions few models use: tan, hyperbolic and inverse functions, softplus,
softsign, mish, round; loop `_rare_unary`).
A row's position is its code, the argument that lets one compiled loop serve the whole table;
the loop picks the function through a dispatch generated from the same table (`_dispatch`), so
a code is never written out. Adding a unary op here is adding its row. The graph layer has its
own row for the op (graph/ops/elementwise.py: fold, cost, gradient); the two layers never import
each other, and tests/test_registry.py checks that every registered op has a kernel.

Binary and comparison op codes (arguments, so one compiled kernel serves a family):
  binary: 0 add, 1 sub, 2 mul, 3 div, 4 relu-grad(dy, y), 5 sigmoid-grad(dy, y), 6 tanh-grad(dy, y),
          7 pow, 8 max, 9 min, 10 erf-grad(dy, x), 11 atan-grad(dy, x), 12 gelu-grad(dy, x),
          13 gelu-tanh-grad(dy, x), 14 mod (the divisor's sign), 15 fmod (the dividend's sign),
          16 shift left, 17 shift right, 18 bitwise and, 19 or, 20 xor (integers only), 21 prelu (x, or x·slope
          below 0)
  compare: 0 ==, 1 <, 2 >, 3 <=, 4 >=, 5 and, 6 or, 7 xor

The transcendental ops (erf, GELU and their gradients, codes in SPECIAL_*) have kernels of
their own, so that models without them do not compile them; exact GELU, the common one, also
has in-place twins: a loop that reads and writes one buffer through two names fails LLVM's
run-time overlap check and runs scalar, which costs most there (cheap ops are memory-bound
either way).

Erf, GELU, float32 Sigmoid and their gradients run on the float32 approximations of kernels/scalar.py
(`fast_exp`, `fast_erf`, `fast_tanh`: vectorised where libm's are one call per element), and so do Swish and
its gradient (kernels/nn.py); float64 keeps libm's exp.

With threads, the flat kernels (and _binary_strided) have `_parts` twins (kernels/parallel_split.py) that run them
on parts of their elements (rows) in one parallel region; every value is as in one thread.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, overload, prange, types  # noqa: F401 (prange: the loops of the written twins)

from .registry import ODTRAIN_DOMAIN, binding
from .copies import first_row, gather_call, next_row, row_start, same_buffer
from .layout import broadcast_layout, flat
from .parallel_split import parallel_twin, split
from .scalar import fast_erf, fast_exp, fast_sigmoid, fast_tanh, gelu, gelu_grad

BINARY = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "ReluGrad": 4, "SigmoidGrad": 5, "TanhGrad": 6,
          "Pow": 7, "Max": 8, "Min": 9, "ErfGrad": 10, "AtanGrad": 11, "Mod": 14, "PRelu": 21}
GELU_GRAD, GELU_TANH_GRAD = 12, 13
FMOD = 15
SHIFT = {"LEFT": 16, "RIGHT": 17}
BITWISE = {"BitwiseAnd": 18, "BitwiseOr": 19, "BitwiseXor": 20}
COMMUTATIVE = (0, 2, 8, 9)  # add, mul, max, min
# ops with a loop of their own in _run_pair, which then vectorise in place (through one name); the others go
# through _binary_op's dispatch per element, and in place ran slower through one name than through two
# (SigmoidGrad before it had its loop; bench_ops.SiluOps)
OWN_LOOPS = (0, 1, 2, 3, 4, 5)
COMPARE = {"Equal": 0, "Less": 1, "Greater": 2, "LessOrEqual": 3, "GreaterOrEqual": 4, "And": 5, "Or": 6, "Xor": 7}


@njit(cache=True, inline="always", error_model="numpy")
def gelu_tanh(x):
    """x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))."""
    inner = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + fast_tanh(inner))


@njit(cache=True, inline="always", error_model="numpy")
def gelu_tanh_grad(dy, x):
    """dy · d/dx of the tanh approximation."""
    inner = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    t = fast_tanh(inner)
    d_inner = np.float32(0.7978845608028654) * (np.float32(1.0) + np.float32(0.134145) * x * x)
    return dy * (np.float32(0.5) * (np.float32(1.0) + t) + np.float32(0.5) * x * (np.float32(1.0) - t * t) * d_inner)


def c_fmod(x, y):
    """x - y · trunc(x / y), the sign of x (C's fmod); Numba's np.fmod gets it wrong on integers."""
    return np.fmod(x, y)


@overload(c_fmod)
def _c_fmod(x, y):
    if isinstance(x, types.Integer) and isinstance(y, types.Integer):
        def integer_fmod(x, y):
            r = x % y
            return r - y if r != 0 and (r < 0) != (x < 0) else r

        return integer_fmod
    return lambda x, y: np.fmod(x, y)


def integer_op(code, x, y):
    """Shifts and bitwise operations (codes 16-20) on integers; x itself for other types, which never
    reach it (a shift does not type on floats, and one compiled kernel serves every code)."""
    return x


@overload(integer_op)
def _integer_op(code, x, y):
    if not (isinstance(x, types.Integer) and isinstance(y, types.Integer)):
        return lambda code, x, y: x
    bits = x.bitwidth

    def on_integers(code, x, y):
        if code <= 17 and (y < 0 or y >= bits):  # shifted out entirely
            return -1 if code == 17 and x < 0 else 0
        if code == 16:
            return x << y
        if code == 17:
            return x >> y
        if code == 18:
            return x & y
        if code == 19:
            return x | y
        return x ^ y  # 20

    return on_integers


@njit(cache=True, inline="always")
def _binary_op(code, x, y):
    """The cheap binary ops (codes 0-9, 14-20); the transcendental gradients have their own kernels."""
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
    if code == 6:  # dy * (1 - y²)
        return x * (1 - y * y)
    if code == 7:
        return x ** y
    if code == 8:
        return max(x, y)
    if code == 14:
        return x % y
    if code == 15:
        return c_fmod(x, y)
    if code == 21:
        return x if x >= 0 else x * y
    if code >= 16:
        return integer_op(code, x, y)
    return min(x, y)  # 9


@njit(cache=True, inline="always")
def _special_binary_op(code, dy, x):
    """Gradients read through the forward input: codes 10-13."""
    if code == 10:  # dy · 2/√π · exp(-x²)
        return dy * np.float32(1.1283791670955126) * fast_exp(-x * x)
    if code == 11:  # dy / (1 + x²)
        return dy / (1 + x * x)
    if code == 12:
        return gelu_grad(dy, x)
    return gelu_tanh_grad(dy, x)  # 13


@njit(inline="always")
def _negative(x):
    return -x


@njit(inline="always")
def _absolute(x):
    return abs(x)


@njit(inline="always")
def _relu(x):
    return x if x > 0 else x * 0


def _sigmoid(x):
    """Overflow-free logistic: 1 / (1 + e^-x), or e^x / (1 + e^x) below 0; fast_sigmoid in float32."""
    e = np.exp(-abs(x))
    return (x * 0 + 1 if x >= 0 else e) / (1 + e)


@overload(_sigmoid)
def _sigmoid_of(x):
    if x == types.float32:
        return lambda x: fast_sigmoid(x)
    return _sigmoid


@njit(inline="always")
def _sign(x):
    return (x > 0) - (x < 0) + x * 0


@njit(inline="always")
def _reciprocal(x):
    return 1 / x


@njit(inline="always")
def _copy(x):
    return x


@njit(inline="always")
def _softplus(x):
    """log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|)."""
    return max(x, x * 0) + np.log1p(np.exp(-abs(x)))


@njit(inline="always")
def _softsign(x):
    return x / (1 + abs(x))


@njit(inline="always")
def _mish(x):
    return x * np.tanh(_softplus(x))


# Cheap unary maps: op type -> scalar function; the row's position is its code in `_unary`.
UNARY = {
    "Neg": _negative, "Abs": _absolute, "Exp": np.exp, "Log": np.log, "Relu": _relu, "Sigmoid": _sigmoid,
    "Tanh": np.tanh, "Sign": _sign, "Sqrt": np.sqrt, "Reciprocal": _reciprocal, "Identity": _copy,
    "Atan": np.arctan, "Floor": np.floor, "Ceil": np.ceil, "Sin": np.sin, "Cos": np.cos,
}
# Transcendental maps, in a loop of their own that only models using them compile; GELU's tanh form
# (op Gelu with approximate="tanh") is the last code, after the rows bound by op type.
SPECIAL_UNARY = {"Erf": fast_erf}
# Maps few models use, in a third loop, so that models using erf or GELU do not compile them.
RARE_UNARY = {"Tan": np.tan, "Sinh": np.sinh, "Cosh": np.cosh, "Asin": np.arcsin, "Acos": np.arccos,
              "Atanh": np.arctanh, "Asinh": np.arcsinh, "Acosh": np.arccosh, "Softplus": _softplus,
              "Softsign": _softsign, "Mish": _mish, "Round": np.rint}
GELU_TANH = len(SPECIAL_UNARY)
NEG, ABS, RELU, COPY, SIGMOID = (list(UNARY).index(name) for name in ("Neg", "Abs", "Relu", "Identity", "Sigmoid"))


def _dispatch(functions: tuple):
    """f(code, x) = functions[code](x), the last function serving any larger code.

    Its source is written from the table, one `if` per code, so that Numba inlines it into the
    calling loop exactly as a hand-written chain: compiled as fast, cached with that loop (whose
    file holds the table). A nest of closures, one per row, doubled `_unary`'s compile time."""
    source = "def dispatch(code, x):\n"
    source += "".join(f"    if code == {code}:\n        return f{code}(x)\n" for code in range(len(functions) - 1))
    source += f"    return f{len(functions) - 1}(x)\n"
    namespace = {f"f{code}": function for code, function in enumerate(functions)}
    exec(source, namespace)  # the source holds only the comparisons above: no data reaches it
    return njit(inline="always")(namespace["dispatch"])


_unary_op = _dispatch(tuple(UNARY.values()))
_special_unary_op = _dispatch((*SPECIAL_UNARY.values(), gelu_tanh))
_rare_unary_op = _dispatch(tuple(RARE_UNARY.values()))
SPECIAL_BINARY = (10, 11, 12, 13)


@njit(cache=True, error_model="numpy")
def _unary(code, x, out):
    """out[i] = f(x[i]) over flat arrays. One loop per common op, so each vectorises."""
    n = out.size
    if code == NEG:
        for i in range(n):
            out[i] = -x[i]
    elif code == ABS:
        for i in range(n):
            out[i] = abs(x[i])
    elif code == RELU:
        for i in range(n):
            out[i] = max(x[i], 0)
    elif code == COPY:
        for i in range(n):
            out[i] = x[i]
    elif code == SIGMOID:
        for i in range(n):
            out[i] = _sigmoid(x[i])
    else:
        for i in range(n):
            out[i] = _unary_op(code, x[i])


@njit(cache=True, error_model="numpy")
def _special_unary(code, x, out):
    """out[i] = erf or tanh-GELU of x[i] (rarer: one kernel for both)."""
    for i in range(out.size):
        out[i] = _special_unary_op(code, x[i])


@njit(cache=True, error_model="numpy")
def _rare_unary(code, x, out):
    """out[i] = f(x[i]) for RARE_UNARY's maps: tan, the hyperbolic and inverse functions, softplus, softsign,
    mish, round (halves to even)."""
    for i in range(out.size):
        out[i] = _rare_unary_op(code, x[i])


@njit(cache=True, error_model="numpy")
def _gelu(x, out):
    """out = x · Φ(x) (out is not x)."""
    for i in range(out.size):
        out[i] = gelu(x[i])


@njit(cache=True, error_model="numpy")
def _gelu_inplace(x):
    """x = x · Φ(x). In place, a loop must read and write through one array: given two names for one
    buffer, LLVM's run-time overlap check fails and this loop stays scalar."""
    for i in range(x.size):
        x[i] = gelu(x[i])


@njit(cache=True, inline="always", error_model="numpy")
def _run_pair(code, a, b, out):
    """out[k] = f(a[k], b[k]) over arrays (slices) of one length. One loop per common op, so each vectorises;
    slices index from 0, so LLVM needs no per-element wraparound select."""
    n = out.size
    if code == 0:
        for k in range(n):
            out[k] = a[k] + b[k]
    elif code == 1:
        for k in range(n):
            out[k] = a[k] - b[k]
    elif code == 2:
        for k in range(n):
            out[k] = a[k] * b[k]
    elif code == 3:
        for k in range(n):
            out[k] = a[k] / b[k]
    elif code == 4:  # branch-free, so it vectorises even when out aliases a (in place)
        for k in range(n):
            out[k] = a[k] * (b[k] > 0)
    elif code == 5:  # dy · y(1 - y)
        for k in range(n):
            out[k] = a[k] * (b[k] * (1 - b[k]))
    else:
        for k in range(n):
            out[k] = _binary_op(code, a[k], b[k])


@njit(cache=True, inline="always", error_model="numpy")
def _run_scalar(code, x, y, out, y_first):
    """out[k] = f(x[k], y), or f(y, x[k]) if y_first: a run against one broadcast value."""
    n = out.size
    if code == 0:
        for k in range(n):
            out[k] = x[k] + y
    elif code == 2:
        for k in range(n):
            out[k] = x[k] * y
    elif y_first:
        for k in range(n):
            out[k] = _binary_op(code, y, x[k])
    else:
        for k in range(n):
            out[k] = _binary_op(code, x[k], y)


@njit(cache=True, error_model="numpy")
def _binary(code, a, b, out):
    """out[i] = f(a[i], b[i]) over flat arrays of one size."""
    _run_pair(code, a, b, out)


@njit(cache=True, error_model="numpy")
def _binary_into(code, out, b):
    """out[i] = f(out[i], b[i]): in place through one name, so LLVM sees one buffer and vectorises (a kernel
    given the buffer under two names fails the run-time overlap check and runs scalar)."""
    _run_pair(code, out, b, out)


@njit(cache=True, error_model="numpy")
def _special_binary(code, dy, x, out):
    """out[i] = f(dy[i], x[i]) for the erf, atan and tanh-GELU gradients (rarer: one kernel for all)."""
    for i in range(out.size):
        out[i] = _special_binary_op(code, dy[i], x[i])


@njit(cache=True, error_model="numpy")
def _gelu_grad(dy, x, out):
    """out = dy · (Φ(x) + x·φ(x))."""
    for i in range(out.size):
        out[i] = gelu_grad(dy[i], x[i])


@njit(cache=True, error_model="numpy")
def _gelu_grad_into_dy(dy, x):
    """dy = dy · (Φ(x) + x·φ(x)), in place through dy's own name (see _gelu_inplace)."""
    for i in range(dy.size):
        dy[i] = gelu_grad(dy[i], x[i])


@njit(cache=True, error_model="numpy")
def _binary_scalar(code, a, b, out):
    """out[i] = f(a[i], b[0])."""
    _run_scalar(code, a, b[0], out, False)


@njit(cache=True, error_model="numpy")
def _binary_strided(code, a, b, out, dims, sa, sb, in_place, first, last):
    """out (flat, C order over dims) = f(a[strided], b[strided]) over a 6-axis layout, for the rows (the outer
    five axes read as one number in C order) in [first, last). Each row is a run of dims[5]: a run of each
    operand, or one of its values repeated (stride 0), as slices so that it vectorises. `in_place`: a is out
    (same layout), read through out's name (see _binary_into)."""
    if last <= first:
        return
    n = dims[5]
    i0, i1, i2, i3, i4 = first_row(first, dims)
    for row in range(first, last):
        ia = row_start(0, sa, i0, i1, i2, i3, i4)
        ib = row_start(0, sb, i0, i1, i2, i3, i4)
        target = out[row * n:(row + 1) * n]
        if in_place and sb[5] == 1:
            _run_pair(code, target, b[ib:ib + n], target)
        elif in_place and sb[5] == 0:
            _run_scalar(code, target, b[ib], target, False)
        elif sa[5] == 1 and sb[5] == 1:
            _run_pair(code, a[ia:ia + n], b[ib:ib + n], target)
        elif sa[5] == 1 and sb[5] == 0:
            _run_scalar(code, a[ia:ia + n], b[ib], target, False)
        elif sa[5] == 0 and sb[5] == 1:
            _run_scalar(code, b[ib:ib + n], a[ia], target, True)
        else:
            for k in range(n):
                target[k] = _binary_op(code, a[ia + k * sa[5]], b[ib + k * sb[5]])
        i0, i1, i2, i3, i4 = next_row(i0, i1, i2, i3, i4, dims)


@njit(cache=True, error_model="numpy")
def _compare_strided(code, a, b, out, dims, sa, sb):
    """out (bool, flat over dims) = a <op> b over a broadcast 4-D layout."""
    k = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ia = i0 * sa[0] + i1 * sa[1] + i2 * sa[2]
                ib = i0 * sb[0] + i1 * sb[1] + i2 * sb[2]
                for i3 in range(dims[3]):
                    x = a[ia + i3 * sa[3]]
                    y = b[ib + i3 * sb[3]]
                    if code == 0:
                        out[k] = x == y
                    elif code == 1:
                        out[k] = x < y
                    elif code == 2:
                        out[k] = x > y
                    elif code == 3:
                        out[k] = x <= y
                    elif code == 4:
                        out[k] = x >= y
                    elif code == 5:
                        out[k] = (x != 0) and (y != 0)
                    elif code == 6:
                        out[k] = (x != 0) or (y != 0)
                    else:
                        out[k] = (x != 0) != (y != 0)
                    k += 1


@njit(cache=True, error_model="numpy")
def _where_strided(cond, a, b, out, dims, sc, sa, sb):
    """out (flat over dims) = a if cond else b, each operand broadcast through its strides."""
    k = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ic = i0 * sc[0] + i1 * sc[1] + i2 * sc[2]
                ia = i0 * sa[0] + i1 * sa[1] + i2 * sa[2]
                ib = i0 * sb[0] + i1 * sb[1] + i2 * sb[2]
                for i3 in range(dims[3]):
                    out[k] = a[ia + i3 * sa[3]] if cond[ic + i3 * sc[3]] else b[ib + i3 * sb[3]]
                    k += 1


@njit(cache=True, error_model="numpy")
def _logical_not(x, out):
    for i in range(out.size):
        out[i] = not x[i]


@njit(cache=True, error_model="numpy")
def _float_class(x, out, nan, positive, negative):
    """out[i] = x[i] is NaN (if nan), +inf (if positive) or -inf (if negative): IsNaN and IsInf."""
    for i in range(out.size):
        v = x[i]
        out[i] = (nan and v != v) or (positive and v == np.inf) or (negative and v == -np.inf)


# ---- the same on parts of the flat arrays (or of the rows), in parallel: every value as in one thread -----


_unary_parts = parallel_twin(_unary, sliced=("x", "out"))
_special_unary_parts = parallel_twin(_special_unary, sliced=("x", "out"))
_rare_unary_parts = parallel_twin(_rare_unary, sliced=("x", "out"))
_gelu_parts = parallel_twin(_gelu, sliced=("x", "out"))
_gelu_inplace_parts = parallel_twin(_gelu_inplace, sliced=("x",))
_binary_parts = parallel_twin(_binary, sliced=("a", "b", "out"))
_binary_into_parts = parallel_twin(_binary_into, sliced=("out", "b"))
_special_binary_parts = parallel_twin(_special_binary, sliced=("dy", "x", "out"))
_gelu_grad_parts = parallel_twin(_gelu_grad, sliced=("dy", "x", "out"))
_gelu_grad_into_dy_parts = parallel_twin(_gelu_grad_into_dy, sliced=("dy", "x"))
_binary_scalar_parts = parallel_twin(_binary_scalar, sliced=("a", "out"))
_binary_strided_parts = parallel_twin(_binary_strided, range=("first", "last"))


def unary_call(code: int, x: np.ndarray, out: np.ndarray, threads: int = 1):
    """out = UNARY's map number `code` of x."""
    return split((_unary, (code, flat(x), flat(out))), out.size, out.size, threads)


def binary_calls(code: int, a: np.ndarray, b: np.ndarray, out: np.ndarray, threads: int = 1) -> list:
    """The cheapest kernel call computing out = f(a, b) with broadcasting."""
    if code in SPECIAL_BINARY:  # gradients f(dY, X): operands of one shape
        if not (a.shape == b.shape == out.shape):
            raise ValueError(f"a gradient of shapes {a.shape} and {b.shape} into {out.shape}")
        if code == GELU_GRAD:
            if same_buffer(a, out):
                return [split((_gelu_grad_into_dy, (flat(a), flat(b))), out.size, out.size, threads)]
            return [split((_gelu_grad, (flat(a), flat(b), flat(out))), out.size, out.size, threads)]
        return [split((_special_binary, (code, flat(a), flat(b), flat(out))), out.size, out.size, threads)]
    if same_buffer(b, out) and code in COMMUTATIVE and not same_buffer(a, out):  # the output over b: read as a
        a, b = b, a
    if a.shape == out.shape and b.shape == out.shape:
        if same_buffer(a, out) and code in OWN_LOOPS:
            return [split((_binary_into, (code, flat(out), flat(b))), out.size, out.size, threads)]
        return [split((_binary, (code, flat(a), flat(b), flat(out))), out.size, out.size, threads)]
    in_place = same_buffer(a, out) and code in OWN_LOOPS
    if a.shape == out.shape and b.size == 1 and not in_place:
        return [split((_binary_scalar, (code, flat(a), flat(b), flat(out))), out.size, out.size, threads)]
    dims, _, sa, sb = broadcast_layout(out.shape, a.shape, b.shape)  # 4 axes, padded to the rows' 6
    dims, sa, sb = (np.concatenate([[fill, fill], v]).astype(np.int64) for fill, v in ((1, dims), (0, sa), (0, sb)))
    rows = int(np.prod(dims[:5]))
    return [split((_binary_strided, (code, flat(a), flat(b), flat(out), dims, sa, sb, in_place, 0, rows)), rows,
                  out.size, threads)]


def compare_calls(code: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> list:
    dims, _, sa, sb = broadcast_layout(out.shape, a.shape, b.shape)
    return [(_compare_strided, (code, flat(a), flat(b), flat(out), dims, sa, sb))]


def _make_binary(code):
    def bind(inputs, outputs, threads=1):
        return binary_calls(code, inputs[0], inputs[1], outputs[0], threads)

    return bind


def _make_unary(kernel, code):
    def bind(inputs, outputs, threads=1):
        x, out = inputs[0], outputs[0]
        return [split((kernel, (code, flat(x), flat(out))), out.size, out.size, threads)]

    return bind


for _name, _code in BINARY.items():
    if _name not in ("Max", "Min", "Mod"):  # variadic, or with attributes: bound below
        binding(_name, ODTRAIN_DOMAIN if _name.endswith("Grad") else "", parallel=True)(_make_binary(_code))
for _kernel, _table in ((_unary, UNARY), (_special_unary, SPECIAL_UNARY), (_rare_unary, RARE_UNARY)):
    for _code, _name in enumerate(_table):
        binding(_name, parallel=True)(_make_unary(_kernel, _code))


def _variadic(code: int, inputs, out, threads: int = 1) -> list:
    """out = x0 ∘ x1 ∘ ...; the first pair writes out, the rest combine into it."""
    if len(inputs) == 1:
        if inputs[0].shape == out.shape:
            return [] if same_buffer(inputs[0], out) else [unary_call(COPY, inputs[0], out, threads)]
        dims, _, sx = broadcast_layout(out.shape, inputs[0].shape)
        return [gather_call(inputs[0], out, dims, sx)]
    first = inputs[0]
    if first.shape != out.shape and inputs[1].shape == out.shape and code in COMMUTATIVE:
        first, second = inputs[1], inputs[0]
    else:
        second = inputs[1]
    calls = binary_calls(code, first, second, out, threads)
    for extra in inputs[2:]:
        calls += binary_calls(code, out, extra, out, threads)
    return calls


@binding("Sum", parallel=True)
def Sum(inputs, outputs, threads=1):
    return _variadic(BINARY["Add"], inputs, outputs[0], threads)


@binding("Max", parallel=True)
def Max(inputs, outputs, threads=1):
    return _variadic(BINARY["Max"], inputs, outputs[0], threads)


@binding("Mean", parallel=True)
def Mean(inputs, outputs, threads=1):
    out = outputs[0]
    share = np.array([1 / len(inputs)], dtype=out.dtype)
    scale = split((_binary_scalar, (BINARY["Mul"], flat(out), share, flat(out))), out.size, out.size, threads)
    return _variadic(BINARY["Add"], inputs, out, threads) + [scale]


@binding("Mod", parallel=True)
def Mod(inputs, outputs, fmod=0, threads=1):
    return binary_calls(FMOD if fmod else BINARY["Mod"], inputs[0], inputs[1], outputs[0], threads)


@binding("BitShift", parallel=True)
def BitShift(inputs, outputs, direction="LEFT", threads=1):
    direction = direction.decode() if isinstance(direction, bytes) else direction
    return binary_calls(SHIFT[direction], inputs[0], inputs[1], outputs[0], threads)


for _name, _code in BITWISE.items():
    binding(_name, parallel=True)(_make_binary(_code))


@binding("Min", parallel=True)
def Min(inputs, outputs, threads=1):
    return _variadic(BINARY["Min"], inputs, outputs[0], threads)


@binding("Gelu", parallel=True)
def Gelu(inputs, outputs, approximate="none", threads=1):
    x, out = inputs[0], outputs[0]
    if approximate != "none":
        call = (_special_unary, (GELU_TANH, flat(x), flat(out)))
    else:
        call = (_gelu_inplace, (flat(x),)) if same_buffer(x, out) else (_gelu, (flat(x), flat(out)))
    return [split(call, out.size, out.size, threads)]


binding("Gelu", ODTRAIN_DOMAIN, parallel=True)(Gelu)


@binding("GeluGrad", ODTRAIN_DOMAIN, parallel=True)
def GeluGrad(inputs, outputs, approximate="none", threads=1):
    return binary_calls(GELU_GRAD if approximate == "none" else GELU_TANH_GRAD, inputs[0], inputs[1], outputs[0],
                        threads)


def _make_compare(code):
    def bind(inputs, outputs):
        return compare_calls(code, inputs[0], inputs[1], outputs[0])

    return bind


for _name, _code in COMPARE.items():
    binding(_name)(_make_compare(_code))


@binding("Not")
def Not(inputs, outputs):
    return [(_logical_not, (flat(inputs[0]), flat(outputs[0])))]


@binding("IsNaN")
def IsNaN(inputs, outputs):
    return [(_float_class, (flat(inputs[0]), flat(outputs[0]), True, False, False))]


@binding("IsInf")
def IsInf(inputs, outputs, detect_negative=1, detect_positive=1):
    return [(_float_class, (flat(inputs[0]), flat(outputs[0]), False, bool(detect_positive), bool(detect_negative)))]


@njit(cache=True, error_model="numpy")
def _bitwise_not(x, out):
    for i in range(out.size):
        out[i] = ~x[i]


@binding("BitwiseNot")
def BitwiseNot(inputs, outputs):
    return [(_bitwise_not, (flat(inputs[0]), flat(outputs[0])))]


@binding("Where")
def Where(inputs, outputs):
    cond, a, b = inputs
    out = outputs[0]
    dims, _, sc, sa, sb = broadcast_layout(out.shape, cond.shape, a.shape, b.shape)
    return [(_where_strided, (flat(cond), flat(a), flat(b), flat(out), dims, sc, sa, sb))]


