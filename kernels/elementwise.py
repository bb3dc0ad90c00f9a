"""Elementwise kernels: unary maps, same-shape binaries, broadcasting binaries, comparisons, float
classes (IsNaN, IsInf: one kernel), Where.

The scalar expression of every element-wise op is a row of kernels/scalar_expressions.py, the one table that
these loops, the fused loop nests of Scan and Loop bodies and the fused chains of a step all read. Here each
row becomes an inlined scalar function, and the rows are grouped into loops: `UNARY` (cheap maps, one loop
`_unary`), `SPECIAL_UNARY` (erf and GELU's tanh form, loop `_special_unary`), `RARE_UNARY` (the functions few
models use: tan, hyperbolic and inverse functions, softplus, softsign, mish, round; loop `_rare_unary`), and the
binary rows (`_binary_op`, and `_special_binary_op` for the transcendental gradients of (dY, X)).
A row's position is its code, the argument that lets one compiled loop serve a whole group; the loop picks
the function through a dispatch generated from the same table (`_dispatch`), so a code is never written
out. Adding an element-wise op here is adding its row to the table. The graph layer has its own row for the
op (graph/ops/elementwise.py: fold, cost, gradient); the two layers never import each other, and
tests/test_registry.py checks that every registered op has a kernel.

Comparison op codes: 0 ==, 1 <, 2 >, 3 <=, 4 >=, 5 and, 6 or, 7 xor.

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

from .jit import njit, prange  # noqa: F401 (prange: the loops of the written twins)

from .registry import ODTRAIN_DOMAIN, binding
from .copies import first_row, gather_call, next_row, row_start, same_buffer
from .layout import broadcast_layout, flat
from .parallel_split import parallel_twin, split
from . import scalar_expressions as expressions

# Codes: a row's position in the table (kernels/scalar_expressions.py), binary and unary apart.
BINARY = {name: code for code, name in enumerate(expressions.BINARY)}
GELU_GRAD, GELU_TANH_GRAD, FMOD = BINARY["GeluGrad"], BINARY["GeluTanhGrad"], BINARY["Fmod"]
SHIFT = {"LEFT": BINARY["BitShiftLeft"], "RIGHT": BINARY["BitShiftRight"]}
BITWISE = {name: BINARY[name] for name in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")}
COMMUTATIVE = tuple(BINARY[name] for name in ("Add", "Mul", "Max", "Min"))
# ops with a loop of their own in _run_pair, which then vectorise in place (through one name); the others go
# through _binary_op's dispatch per element, and in place ran slower through one name than through two
# (SigmoidGrad before it had its loop; bench_ops.SiluOps)
OWN_LOOPS = tuple(BINARY[name] for name in ("Add", "Sub", "Mul", "Div", "ReluGrad", "SigmoidGrad"))
COMPARE = {"Equal": 0, "Less": 1, "Greater": 2, "LessOrEqual": 3, "GreaterOrEqual": 4, "And": 5, "Or": 6, "Xor": 7}
SPECIAL_BINARY = tuple(BINARY[name] for name in expressions.group(expressions.BINARY, "special"))


def _dispatch(rows: list[str], codes: list[int] | None = None):
    """f(code, x[, y]) = the scalar function of rows[k] where code is codes[k] (by default k), the last row
    serving any other code.

    Its source is written from the table, one `if` per code, so that Numba inlines it into the
    calling loop exactly as a hand-written chain: compiled as fast, cached with that loop (the kernel
    sources' digest covers the table's file). A nest of closures, one per row, doubled `_unary`'s compile time."""
    codes = list(range(len(rows))) if codes is None else codes
    operands = ", ".join(["x", "y"][:expressions.ROWS[rows[0]].arity])
    source = f"def dispatch(code, {operands}):\n"
    source += "".join(f"    if code == {code}:\n        return f{k}({operands})\n" for k, code in enumerate(codes[:-1]))
    source += f"    return f{len(rows) - 1}({operands})\n"
    namespace = {f"f{k}": expressions.scalar_function(name) for k, name in enumerate(rows)}
    exec(source, namespace)  # the source holds only the comparisons above: no data reaches it
    return njit(inline="always")(namespace["dispatch"])


# Unary maps by loop: op type -> scalar function; the row's position is its code in its loop.
UNARY = {name: expressions.scalar_function(name) for name in expressions.group(expressions.UNARY, "cheap")}
# Transcendental maps, in a loop of their own that only models using them compile; GELU's tanh form
# (op Gelu with approximate="tanh") is the last code, after the rows bound by op type.
SPECIAL_UNARY = {"Erf": expressions.scalar_function("Erf")}
# Maps few models use, in a third loop, so that models using erf or GELU do not compile them.
RARE_UNARY = {name: expressions.scalar_function(name) for name in expressions.group(expressions.UNARY, "rare")}
GELU_TANH = len(SPECIAL_UNARY)
NEG, ABS, RELU, COPY, SIGMOID = (list(UNARY).index(name) for name in ("Neg", "Abs", "Relu", "Identity", "Sigmoid"))
_unary_op = _dispatch(list(UNARY))
_special_unary_op = _dispatch(["Erf", "GeluTanh"])
_rare_unary_op = _dispatch(list(RARE_UNARY))
_CHEAP_BINARY = [name for name, row in expressions.BINARY.items() if row.group != "special"]
# the cheap binary ops and the integer ones; the transcendental gradients have kernels of their own
_binary_op = _dispatch(_CHEAP_BINARY, [BINARY[name] for name in _CHEAP_BINARY])
# gradients read through the forward input
_special_binary_op = _dispatch(list(expressions.group(expressions.BINARY, "special")), list(SPECIAL_BINARY))
_sigmoid, gelu, gelu_grad = expressions.sigmoid, expressions.gelu, expressions.gelu_grad


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


_VARIANT_ROWS = {row for choices in expressions.VARIANTS.values() for row in choices.values()}
for _name, _code in BINARY.items():
    if _name not in ("Max", "Min") and _name not in _VARIANT_ROWS and expressions.BINARY[_name].group != "integer":
        # variadic, with attributes or integer-only: bound below
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


