"""Kernels: quantization (QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear), the integer
products (MatMulInteger, ConvInteger) and their requantizing forms (QLinearMatMul, QLinearConv),
and the fake quantization of training models (FakeQuantize and its gradient).

Quantization groups: x is seen as [outer, A, inner] around its quantization axis, the scale
and zero point as [outer or 1, groups along A, inner or 1]: one value (per tensor), one per
index of the axis (per axis), or one per `block` consecutive indices (blocked). One loop,
`_affine`, runs each elementwise form over that view, `mode` choosing the formula:
  QUANTIZE    q = clamp(rint(x / s) + z, qmin, qmax)
  DEQUANTIZE  y = (q - z) · s
  REQUANTIZE  q = clamp(rint(acc · m) + z, qmin, qmax)   (acc an integer product, m = sa·sb/sy)
  FAKE        y = (clamp(rint(x / s) + z, qmin, qmax) - z) · s
  FAKE_GRAD   dx = dy where (qmin - z)·s ≤ x ≤ (qmax - z)·s, else 0
all in float32, as onnxruntime computes them (rint rounds half to even).

Integer products are float64 products of the operands with their zero points subtracted: every
product of 8-bit values, and every sum of them below 2^53, is exact in float64, so the int32
accumulator comes out exactly, at float64 BLAS speed: the products are the registered MatMul and Conv
bindings (kernels/linalg.py, kernels/conv/__init__.py, taken from the registry when a node is bound, so that this
family imports no other), run on float64 operands with float64 work memory. Their centred operands,
product and multipliers live in the node's arena scratch.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

from .registry import BINDINGS, ODTRAIN_DOMAIN, SCRATCH, binding
from .layout import promoted_shapes
from .number_formats import convert_call, converts

QUANTIZE, DEQUANTIZE, REQUANTIZE, FAKE, FAKE_GRAD = 0, 1, 2, 3, 4
ALIGNMENT = 64


@njit(cache=True, error_model="numpy", inline="always")
def _element(mode, v, w, s, z, qmin, qmax):
    """One element of `mode` (see the module docstring): v = x (or acc), w = dy, as float32."""
    if mode == DEQUANTIZE:
        return (v - z) * s
    if mode == FAKE_GRAD:
        return w if (qmin - z) * s <= v <= (qmax - z) * s else np.float32(0.0)
    q = np.rint(v * s if mode == REQUANTIZE else v / s) + z
    q = min(max(q, qmin), qmax)
    return (q - z) * s if mode == FAKE else q


@njit(cache=True, error_model="numpy", inline="always")
def _groups(x, other, scale, zero, block, qmin, qmax, mode, y):
    """y[o, a, i] = f_mode(x[o, a, i], other[o, a, i], s, z) with s, z = scale/zero[o?, a // block, i?]."""
    outer, length, inner = x.shape
    per_outer, per_inner = scale.shape[0] > 1, scale.shape[2] > 1
    for o in range(outer):
        so = o if per_outer else 0
        for a in range(length):
            g = a // block
            xs, ws, ys = x[o, a], other[o, a], y[o, a]
            if per_inner:
                for i in range(inner):
                    ys[i] = _element(mode, np.float32(xs[i]), np.float32(ws[i]), scale[so, g, i],
                                     np.float32(zero[so, g, i]), qmin, qmax)
            else:
                s, z = scale[so, g, 0], np.float32(zero[so, g, 0])
                for i in range(inner):
                    ys[i] = _element(mode, np.float32(xs[i]), np.float32(ws[i]), s, z, qmin, qmax)


@njit(cache=True, error_model="numpy")
def _affine(x, other, scale, zero, block, qmin, qmax, mode, y):
    """`_groups` into y, which shares no bytes with x or other."""
    _groups(x, other, scale, zero, block, qmin, qmax, mode, y)


@njit(cache=True, error_model="numpy")
def _affine_in_place(x, other, scale, zero, block, qmin, qmax, mode, over_x):
    """`_groups` writing over x (over_x: modes that read x alone) or over other (the gradient over dy). One
    name for the bytes read and written: two names for one buffer fail LLVM's run-time overlap check, and
    the loop would run scalar."""
    if over_x:
        _groups(x, x, scale, zero, block, qmin, qmax, mode, x)
    else:
        _groups(x, other, scale, zero, block, qmin, qmax, mode, other)


@njit(cache=True, error_model="numpy")
def _dynamic_quantize(x, y, scale_out, zero_out):
    """uint8 quantization of x with the range [min(0, min x), max(0, max x)] (onnxruntime's rule:
    s = (hi - lo) / 255, or 1 when hi = lo; z = rint(clamp(-lo / s, 0, 255)))."""
    lo, hi = np.float32(0.0), np.float32(0.0)
    for i in range(x.size):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
    s = np.float32(1.0) if hi == lo else (hi - lo) / np.float32(255.0)
    z = np.rint(min(max(-lo / s, np.float32(0.0)), np.float32(255.0)))
    scale_out[0] = s
    zero_out[0] = np.uint8(z)
    for i in range(x.size):
        y[i] = min(max(np.rint(x[i] / s) + z, np.float32(0.0)), np.float32(255.0))


@njit(cache=True, error_model="numpy")
def _convert(source, target):
    """target = source, converted to target's type (exact: int32 to float64, integral float64 to int32)."""
    for i in range(source.size):
        target[i] = source[i]


@njit(cache=True, error_model="numpy")
def _multipliers(left, right, output, out):
    """out[i, j] = left[i or 0] · right[j or 0] / output[0], in float32: the requantization multipliers."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = left[i if left.size > 1 else 0] * right[j if right.size > 1 else 0] / output[0]


# ---- bindings ---------------------------------------------------------------------------------------


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64))


def groups_view(x_shape: tuple, scale_size: int, scale_shape: tuple, axis: int, block_size: int):
    """(x as [O, A, I], scale as [so, sa, si], block) for ONNX's per-tensor, per-axis and blocked forms."""
    rank = len(x_shape)
    if scale_size == 1 or rank == 0:
        n = _prod(x_shape)
        return (1, 1, n), (1, 1, 1), max(n, 1)
    axis = int(axis) % rank
    outer, length, inner = _prod(x_shape[:axis]), int(x_shape[axis]), _prod(x_shape[axis + 1:])
    if not block_size:
        return (outer, length, inner), (1, length, 1), 1
    return (outer, length, inner), (outer, int(scale_shape[axis]), inner), int(block_size)


def _range_of(dtype) -> tuple:
    info = np.iinfo(dtype)
    return np.float32(info.min), np.float32(info.max)


def affine_call(mode: int, x, scale, zero, y, axis=1, block_size=0, other=None, qrange=(0.0, 0.0)):
    """The call of `_affine` for x and y with their scale and zero point (None: zero) grouped by ONNX's rules."""
    x3, s3, block = groups_view(x.shape, scale.size, scale.shape, axis, block_size)
    zero3 = zero.reshape(s3) if zero is not None else np.zeros(s3, np.int32)
    other = x if other is None else other
    arguments = (x.reshape(x3), other.reshape(x3), scale.reshape(s3), zero3, block, np.float32(qrange[0]),
                 np.float32(qrange[1]), mode)
    for index, operand in ((0, x), (1, other)):
        if operand.dtype == y.dtype and operand.ctypes.data == y.ctypes.data and y.size:  # planned in place
            return (_affine_in_place, arguments + (index == 0,))
    return (_affine, arguments + (y.reshape(x3),))


def _optional(inputs, i):
    return inputs[i] if len(inputs) > i and inputs[i] is not None else None


@binding("QuantizeLinear")
def QuantizeLinear(inputs, outputs, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    y = outputs[0]
    return [affine_call(QUANTIZE, inputs[0], inputs[1], _optional(inputs, 2), y, axis, block_size,
                        qrange=_range_of(y.dtype))]


@binding("DequantizeLinear")
def DequantizeLinear(inputs, outputs, axis=1, block_size=0, output_dtype=0):
    x, zero, y = inputs[0], _optional(inputs, 2), outputs[0]
    if hasattr(x, "packed"):  # a packed 4-bit weight no product reads in place: unpacked once, as the step binds
        x = np.asarray(x)
    if not converts(x.dtype):
        return [affine_call(DEQUANTIZE, x, inputs[1], zero, y, axis, block_size)]
    # float8, float4, int4, int2: converted to float32 into y (and the zero point into a buffer of its own, made
    # when the step is bound), then dequantized in place
    calls = [convert_call(x, y, 1)]
    if zero is not None:
        zero32 = np.zeros(zero.shape, np.float32)
        calls.append(convert_call(zero, zero32, 1))
        zero = zero32
    return calls + [affine_call(DEQUANTIZE, y, inputs[1], zero, y, axis, block_size)]


@binding("DynamicQuantizeLinear")
def DynamicQuantizeLinear(inputs, outputs):
    y, scale, zero = outputs
    return [(_dynamic_quantize, (inputs[0].reshape(-1), y.reshape(-1), scale.reshape(1), zero.reshape(1)))]


@binding("FakeQuantize", ODTRAIN_DOMAIN)
def FakeQuantize(inputs, outputs, axis=1, block_size=0, qmin=0, qmax=255):
    return [affine_call(FAKE, inputs[0], inputs[1], _optional(inputs, 2), outputs[0], axis, block_size,
                        qrange=(qmin, qmax))]


@binding("FakeQuantizeGrad", ODTRAIN_DOMAIN)
def FakeQuantizeGrad(inputs, outputs, axis=1, block_size=0, qmin=0, qmax=255):
    dy, x, scale = inputs[0], inputs[1], inputs[2]
    return [affine_call(FAKE_GRAD, x, scale, _optional(inputs, 3), outputs[0], axis, block_size, other=dy,
                        qrange=(qmin, qmax))]


@njit(cache=True, error_model="numpy")
def _symmetric_scales(w, qmax, scales):
    """scales[a] = max |w[o, a, i]| over o and i, / qmax (1 where the weights are all zero)."""
    scales[:] = 0
    for o in range(w.shape[0]):
        for a in range(w.shape[1]):
            row = w[o, a]
            largest = scales[a]
            for i in range(row.size):
                largest = max(largest, abs(row[i]))
            scales[a] = largest
    for a in range(scales.size):
        scales[a] = scales[a] / qmax if scales[a] > 0 else np.float32(1.0)


@njit(cache=True, error_model="numpy")
def _observe_range(x, stored, updated, averaging, training, qmin, qmax, scale, zero):
    """The activation range (updated in training: set by the first batch, then moved by `averaging` towards
    each batch's min and max), and the scale and zero point it gives (see FakeQuantizeRange)."""
    low, high = stored[0], stored[1]
    if training:
        batch_low, batch_high = x[0], x[0]
        for i in range(x.size):
            batch_low = min(batch_low, x[i])
            batch_high = max(batch_high, x[i])
        if low == 0 and high == 0:
            low, high = batch_low, batch_high
        else:
            low += averaging * (batch_low - low)
            high += averaging * (batch_high - high)
        updated[0], updated[1] = low, high
    low, high = min(low, np.float32(0.0)), max(high, np.float32(0.0))
    s = (high - low) / (qmax - qmin)
    s = s if s > 0 else np.float32(1.0)
    scale[0] = s
    zero[0] = np.rint(min(max(qmin - low / s, qmin), qmax))


@binding("FakeQuantizeWeight", ODTRAIN_DOMAIN, scratch=lambda specs_in, specs_out, axis=0, **attrs:
         4 * (1 if axis < 0 else int(specs_in[0][0][axis])))
def FakeQuantizeWeight(inputs, outputs, axis=0, qmax=127, scratch=None):
    w, y = inputs[0], outputs[0]
    axis = -1 if axis < 0 or w.ndim == 0 else axis  # -1: one scale for the tensor
    scales = scratch.view(np.float32)[:1 if axis < 0 else w.shape[axis]]
    w3, _, _ = groups_view(w.shape, scales.size, scales.shape, axis, 0)
    return [(_symmetric_scales, (w.reshape(w3), np.float32(qmax), scales)),
            affine_call(FAKE, w, scales, None, y, axis=axis, qrange=(-qmax - 1, qmax))]


@binding("FakeQuantizeRange", ODTRAIN_DOMAIN, scratch=lambda specs_in, specs_out, **attrs:
         0 if len(specs_out) > 2 and specs_out[2] else 2 * ALIGNMENT)
def FakeQuantizeRange(inputs, outputs, qmin=0, qmax=255, averaging=0.01, training_mode=1, scratch=None):
    x, stored, y = inputs[0], inputs[1], outputs[0]
    updated = outputs[1] if len(outputs) > 1 and outputs[1] is not None else stored
    if len(outputs) > 3 and outputs[2] is not None:
        scale, zero = outputs[2], outputs[3]
    else:  # the eval form: scale and zero point in the node's scratch
        scale, zero = scratch[:4].view(np.float32), scratch[ALIGNMENT:ALIGNMENT + 4].view(np.float32)
    return [(_observe_range, (x.reshape(-1), stored, updated, np.float32(averaging), bool(training_mode),
                              np.float32(qmin), np.float32(qmax), scale, zero)),
            affine_call(FAKE, x, scale, zero, y, qrange=(qmin, qmax))]


# ---- integer products ---------------------------------------------------------------------------------


class _Carve:
    """Aligned pieces of a node's scratch, taken in order; without a buffer it only counts the bytes."""

    def __init__(self, scratch=None):
        self.scratch, self.used = scratch, 0

    def take(self, shape, dtype) -> np.ndarray | None:
        nbytes = _prod(shape) * np.dtype(dtype).itemsize
        start, self.used = self.used, self.used + -(-nbytes // ALIGNMENT) * ALIGNMENT
        if self.scratch is None:
            return None
        return self.scratch[start:start + nbytes].view(dtype).reshape(shape)


def _centred(carve: _Carve, calls: list, x, zero, axis: int) -> np.ndarray | None:
    """x - zero (per tensor, or per index of `axis`) in float64 scratch; appends the call that fills it."""
    out = carve.take(x.shape, np.float64)
    if out is not None:
        unit = np.ones(1 if zero is None or zero.size == 1 else zero.shape, np.float32)
        calls.append(affine_call(DEQUANTIZE, x, unit, zero, out, axis))
    return out


def _requantized(carve: _Carve, calls: list, product, left_scale, right_scale, y_scale, zero, y) -> None:
    """y = clamp(rint(product · left·right / y_scale) + zero) for product and y seen as [O, A, I]: a left
    scale with several values goes along A, a right one along I (both: one multiplier per (A, I))."""
    rows, columns = left_scale.size, right_scale.size
    multipliers = carve.take((1, rows, columns), np.float32)
    if multipliers is None:
        return
    calls.append((_multipliers, (left_scale.reshape(-1), right_scale.reshape(-1), y_scale.reshape(-1),
                                 multipliers[0])))
    zero = np.zeros(1, y.dtype) if zero is None else zero
    zero3 = np.broadcast_to(zero.reshape(1, 1, 1), multipliers.shape)
    qmin, qmax = _range_of(y.dtype)
    block = max(product.shape[1], 1) if rows == 1 else 1
    calls.append((_affine, (product, product, multipliers, zero3, block, qmin, qmax, REQUANTIZE, y)))


def _matmul_integer(inputs, outputs, scratch, requantize: bool):
    """(calls, scratch bytes) of MatMulInteger (a, b, za, zb) or QLinearMatMul (a, sa, za, b, sb, zb, sy, zy)."""
    if requantize:
        a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = (list(inputs) + [None] * 8)[:8]
    else:
        a, b, a_zero, b_zero = (list(inputs) + [None] * 4)[:4]
    y = outputs[0]
    a2, b2, y2 = promoted_shapes(a.shape, b.shape, y.shape)
    carve, calls = _Carve(scratch), []
    a64 = _centred(carve, calls, a.reshape(a2), a_zero, len(a2) - 2)  # A's zero point: one per row
    b64 = _centred(carve, calls, b.reshape(b2), b_zero, len(b2) - 1)  # B's: one per column
    y64 = carve.take(y2, np.float64)
    if scratch is not None:
        calls += BINDINGS[("", "MatMul")]([a64, b64], [y64])  # the float64 operands are matrices already
        if not requantize:
            calls.append((_convert, (y64.reshape(-1), y.reshape(-1))))
    if requantize:
        rows, columns = y2[-2], y2[-1]
        view = (-1, rows, columns)
        _requantized(carve, calls, None if y64 is None else y64.reshape(view), a_scale, b_scale, y_scale, y_zero,
                     None if scratch is None else y.reshape(view))
    return calls, carve.used


def _conv_integer(inputs, outputs, scratch, attrs, requantize: bool):
    """(calls, scratch bytes) of ConvInteger (x, w, zx, zw) or QLinearConv (x, sx, zx, w, sw, zw, sy, zy, B)."""
    if requantize:
        x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias = (list(inputs) + [None] * 9)[:9]
    else:
        (x, w, x_zero, w_zero), bias = (list(inputs) + [None] * 4)[:4], None
    y = outputs[0]
    carve, calls = _Carve(scratch), []
    x64 = _centred(carve, calls, x, x_zero, 1)
    w64 = _centred(carve, calls, w, w_zero, 0)  # the weight's zero point: one per output channel
    b64 = None if bias is None else carve.take(bias.shape, np.float64)
    if b64 is not None:
        calls.append((_convert, (bias.reshape(-1), b64)))
    y64 = carve.take(y.shape, np.float64)
    specs = [(x.shape, np.float64), (w.shape, np.float64)]
    work = carve.take((SCRATCH[("", "Conv")](specs, [(y.shape, np.float64)], **attrs),), np.uint8)
    if scratch is not None:
        calls += BINDINGS[("", "Conv")]([x64, w64, b64], [y64], scratch=work, **attrs)
        if not requantize:
            calls.append((_convert, (y64.reshape(-1), y.reshape(-1))))
    if requantize:
        view = (y.shape[0], y.shape[1], _prod(y.shape[2:]))
        _requantized(carve, calls, None if y64 is None else y64.reshape(view), w_scale, x_scale, y_scale, y_zero,
                     None if scratch is None else y.reshape(view))
    return calls, carve.used


class _Spec:
    """The shape and dtype of an operand, standing in for its array while a binding's scratch is sized."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.size = _prod(self.shape)

    def reshape(self, shape):
        shape = tuple(shape)
        if -1 in shape:
            known = _prod([d for d in shape if d != -1])
            shape = tuple(self.size // max(known, 1) if d == -1 else d for d in shape)
        return _Spec(shape, self.dtype)


def _scratch_of(product):
    """The scratch-size rule of an integer product: its binding run on stand-ins, counting bytes."""
    def size(specs_in, specs_out, **attrs):
        def stand_ins(specs):
            return [None if spec is None else _Spec(*spec) for spec in specs]

        return product(stand_ins(specs_in), stand_ins(specs_out), None, attrs)[1]

    return size


def _matmul_product(requantize: bool):
    return lambda inputs, outputs, scratch, attrs: _matmul_integer(inputs, outputs, scratch, requantize)


def _conv_product(requantize: bool):
    return lambda inputs, outputs, scratch, attrs: _conv_integer(inputs, outputs, scratch, attrs, requantize)


@binding("MatMulInteger", scratch=_scratch_of(_matmul_product(False)))
def MatMulInteger(inputs, outputs, scratch=None):
    return _matmul_integer(inputs, outputs, scratch, False)[0]


@binding("QLinearMatMul", scratch=_scratch_of(_matmul_product(True)))
def QLinearMatMul(inputs, outputs, scratch=None):
    return _matmul_integer(inputs, outputs, scratch, True)[0]


@binding("ConvInteger", scratch=_scratch_of(_conv_product(False)))
def ConvInteger(inputs, outputs, scratch=None, **attrs):
    return _conv_integer(inputs, outputs, scratch, attrs, False)[0]


@binding("QLinearConv", scratch=_scratch_of(_conv_product(True)))
def QLinearConv(inputs, outputs, scratch=None, **attrs):
    return _conv_integer(inputs, outputs, scratch, attrs, True)[0]
