"""The one table of element-wise ops as scalar expressions: what each op computes at one element.

A row is an op type (with the ONNX domain its node carries) and the text of its value at one element, over the
operands' scalars `{0}` (and `{1}`): `"Add": "({0} + {1})"`; a gradient op's row is over (dY, X) or (dY, Y), the
operands its node takes. The text calls numpy, the float32 approximations of kernels/scalar.py and the scalar
functions below, all names of this module. Three consumers read the rows, and nothing else states these facts:
- the per-op kernels (kernels/elementwise.py): each row becomes an inlined scalar function (`scalar_function`)
  and the loops' dispatch by code is written from the rows (a row's position in its group is its code);
- the fused loop nests of Scan and Loop bodies (odtrain/body_fusion.py);
- the fused chains of a step (kernels/fused_elementwise.py), whose generated kernels hash `table_digest`, so an
  edit here compiles them anew.
The group of a row says which compiled loop of kernels/elementwise.py serves it: `cheap` (the common maps, in
`_unary`/`_binary`), `special` (erf, GELU and the transcendental gradients, in loops that models without them
never compile), `rare` (the maps few models use), `integer` (bitwise ops, never fused). Adding an element-wise
op is adding its row (and its graph-side rule in graph/ops/elementwise.py).

Values are the same bits wherever a row is evaluated: float32 arithmetic rounds each operation to float32
whether the value stays in a register or goes to memory (no fast-math, so no contraction into FMA), and every
consumer evaluates the same text.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, overload, types
from .scalar import fast_erf, fast_exp, fast_log1p_unit, fast_sigmoid, fast_tanh, gelu, gelu_grad  # GELU's erf form: products' epilogues use it too


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


def exp(x):
    """e^x: fast_exp in float32 (LLVM vectorises it, where libm's expf is one call per element), np.exp otherwise."""
    return np.exp(x)


@overload(exp)
def _exp_of(x):
    if x == types.float32:
        return lambda x: fast_exp(x)
    return exp


def sigmoid(x):
    """Overflow-free logistic: 1 / (1 + e^-x), or e^x / (1 + e^x) below 0; fast_sigmoid in float32."""
    e = np.exp(-abs(x))
    return (x * 0 + 1 if x >= 0 else e) / (1 + e)


@overload(sigmoid)
def _sigmoid_of(x):
    if x == types.float32:
        return lambda x: fast_sigmoid(x)
    return sigmoid


def softplus(x):
    """log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|); in float32 on fast_exp and fast_log1p_unit."""
    return max(x, x * 0) + np.log1p(np.exp(-abs(x)))


@overload(softplus)
def _softplus_of(x):
    if x == types.float32:
        return lambda x: max(x, np.float32(0.0)) + fast_log1p_unit(fast_exp(-abs(x)))
    return softplus


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


def integer_op(which, x, y):
    """Shifts (0 left, 1 right) and bitwise and, or, xor (2-4) on integers; x itself for other types, which
    never reach it (a shift does not type on floats, and one compiled kernel serves every code)."""
    return x


@overload(integer_op)
def _integer_op(which, x, y):
    if not (isinstance(x, types.Integer) and isinstance(y, types.Integer)):
        return lambda which, x, y: x
    bits = x.bitwidth

    def on_integers(which, x, y):
        if which <= 1 and (y < 0 or y >= bits):  # shifted out entirely
            return -1 if which == 1 and x < 0 else 0
        if which == 0:
            return x << y
        if which == 1:
            return x >> y
        if which == 2:
            return x & y
        if which == 3:
            return x | y
        return x ^ y  # 4

    return on_integers


class Row:
    """One element-wise op: its scalar expression over `{0}` (and `{1}`), how many operands, which loop of
    kernels/elementwise.py serves it, and the domain its node carries."""

    __slots__ = ("expression", "arity", "group", "domain")

    def __init__(self, expression: str, arity: int, group: str, domain: str = ""):
        self.expression, self.arity, self.group, self.domain = expression, arity, group, domain

    def __repr__(self):
        return f"Row({self.expression!r}, {self.arity}, {self.group!r}, {self.domain!r})"

    @property
    def fusable(self) -> bool:
        """Whether a fused chain may hold it: float ops only (integer ops have no fused float loop)."""
        return self.group != "integer"


def _rows(arity: int, group: str, domain: str = "", **expressions) -> dict:
    return {name: Row(text, arity, group, domain) for name, text in expressions.items()}


ODTRAIN = "ai.odtrain"
# op type -> Row, in code order within each group (the per-op loops' codes are positions in a group).
UNARY = _rows(1, "cheap", Neg="(-{0})", Abs="abs({0})", Exp="exp({0})", Log="np.log({0})",
              Relu="({0} if {0} > 0 else {0} * 0)", Sigmoid="sigmoid({0})", Tanh="np.tanh({0})",
              Sign="(({0} > 0) - ({0} < 0) + {0} * 0)", Sqrt="np.sqrt({0})", Reciprocal="(1 / {0})",
              Identity="{0}", Atan="np.arctan({0})", Floor="np.floor({0})", Ceil="np.ceil({0})",
              Sin="np.sin({0})", Cos="np.cos({0})")
UNARY |= _rows(1, "special", Erf="fast_erf({0})", Gelu="gelu({0})", GeluTanh="gelu_tanh({0})")
UNARY |= _rows(1, "rare", Tan="np.tan({0})", Sinh="np.sinh({0})", Cosh="np.cosh({0})", Asin="np.arcsin({0})",
               Acos="np.arccos({0})", Atanh="np.arctanh({0})", Asinh="np.arcsinh({0})", Acosh="np.arccosh({0})",
               Softplus="softplus({0})", Softsign="({0} / (1 + abs({0})))", Mish="({0} * np.tanh(softplus({0})))",
               Round="np.rint({0})")
BINARY = _rows(2, "cheap", Add="({0} + {1})", Sub="({0} - {1})", Mul="({0} * {1})", Div="({0} / {1})")
BINARY |= _rows(2, "cheap", ODTRAIN,
                ReluGrad="({0} if {1} > 0 else {0} * 0)",  # dY · (Y > 0)
                SigmoidGrad="({0} * ({1} * (1 - {1})))",  # dY · Y(1 - Y), associated as its own loop in elementwise.py
                TanhGrad="({0} * (1 - {1} * {1}))")  # dY · (1 - Y²)
BINARY |= _rows(2, "cheap", Pow="({0} ** {1})", Max="max({0}, {1})", Min="min({0}, {1})", Mod="({0} % {1})",
                Fmod="c_fmod({0}, {1})", PRelu="({0} if {0} >= 0 else {0} * {1})")
BINARY |= _rows(2, "special", ODTRAIN,
                ErfGrad="({0} * np.float32(1.1283791670955126) * fast_exp(-{1} * {1}))",  # dY · 2/√π · exp(-X²)
                AtanGrad="({0} / (1 + {1} * {1}))",  # dY / (1 + X²)
                GeluGrad="gelu_grad({0}, {1})", GeluTanhGrad="gelu_tanh_grad({0}, {1})")
BINARY |= _rows(2, "integer", BitShiftLeft="integer_op(0, {0}, {1})", BitShiftRight="integer_op(1, {0}, {1})",
                BitwiseAnd="integer_op(2, {0}, {1})", BitwiseOr="integer_op(3, {0}, {1})",
                BitwiseXor="integer_op(4, {0}, {1})")
# Rows named apart from their node's op type: (op type, the attribute that picks them) -> {value: row name}.
VARIANTS = {("Gelu", "approximate"): {"none": "Gelu", "tanh": "GeluTanh"}, ("Mod", "fmod"): {0: "Mod", 1: "Fmod"},
            ("GeluGrad", "approximate"): {"none": "GeluGrad", "tanh": "GeluTanhGrad"},
            ("BitShift", "direction"): {"LEFT": "BitShiftLeft", "RIGHT": "BitShiftRight"}}
ROWS = {**UNARY, **BINARY}
# Op types that compute a row under another name: Sum of two operands is Add (a gradient's fan-in).
SAME_AS = {"Sum": "Add"}


def group(table: dict, name: str) -> list[str]:
    """The op names of one group of `table`, in code order."""
    return [op for op, row in table.items() if row.group == name]


def scalar_source(name: str, operands: list[str]) -> str:
    """Row `name`'s expression over the given operand texts."""
    return ROWS[name].expression.format(*operands)


def scalar_function(name: str):
    """Row `name` as an inlined scalar function f(x) or f(x, y) (compiled into the loop that calls it)."""
    arguments = ["x", "y"][:ROWS[name].arity]
    namespace = dict(globals())
    exec(f"def {name.lower()}_scalar({', '.join(arguments)}):\n    return {scalar_source(name, arguments)}\n",
         namespace)  # the text is this module's own rows: no data reaches it
    return njit(inline="always")(namespace[f"{name.lower()}_scalar"])


def names() -> dict:
    """The names a row's expression may use (a generated kernel's globals)."""
    return {"np": np, "fast_erf": fast_erf, "fast_exp": fast_exp, "fast_tanh": fast_tanh, "exp": exp, "sigmoid": sigmoid,
            "softplus": softplus, "gelu": gelu, "gelu_tanh": gelu_tanh, "gelu_grad": gelu_grad,
            "gelu_tanh_grad": gelu_tanh_grad, "c_fmod": c_fmod, "integer_op": integer_op}


def row_of(op_type: str, attrs: dict) -> str | None:
    """The row a node of `op_type` with `attrs` computes, or None (not element-wise, or an attribute the table
    does not read). A variadic op (Sum) computes its row when it has the row's operands."""
    for (variant, attribute), choices in VARIANTS.items():
        if variant == op_type:
            value = attrs.get(attribute, next(iter(choices)))
            value = value.decode() if isinstance(value, bytes) else value
            extra = set(attrs) - {attribute}
            return None if extra else choices.get(value)
    if op_type in ROWS and not attrs:
        return op_type
    return SAME_AS.get(op_type) if not attrs else None


def text_hash(text: bytes) -> str:
    """A 64-bit FNV-1a hash of `text`, in hex: a name for generated code (kernels/ imports numpy and numba only,
    so not hashlib; a clash needs two texts of one process and one cache folder, at 2^-64)."""
    value = 0xCBF29CE484222325
    for byte in text:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


_DIGEST: list[str] = []


def table_digest() -> str:
    """A digest of this file (the rows and the scalar functions they call): generated kernels are named by it,
    so an edit here compiles them anew."""
    if not _DIGEST:
        with open(__file__, "rb") as file:
            _DIGEST.append(text_hash(file.read()))
    return _DIGEST[0]
