"""Signal ops: DFT, STFT, the Hann, Hamming and Blackman windows, MelWeightMatrix.

A complex tensor is a real one with a last axis of 2 (real, imaginary); a real signal has a last axis
of 1. DFT runs along `axis` (to opset 19 an attribute, default 1, which the loader writes out; from
opset 20 input 2, default -2) with N = dft_length (default: the axis's length; 2·(length - 1) for an
inverse one-sided transform):
- forward: X[k] = Σ_{n<N} x[n]·e^(-2πi·kn/N), the input cut or zero-padded to N; `onesided` keeps
  k <= N/2 (a real input's spectrum is symmetric);
- inverse: x[n] = (1/N)·Σ_k X[k]·e^(+2πi·kn/N); with `onesided` the input holds k <= N/2 of a
  symmetric spectrum and the output is the real signal of length N (numpy's irfft).
STFT(signal [B, L, 1|2] or, real, [B, L] as torch.onnx exports it; frame_step, window?, frame_length?)
takes T = 1 + (L - N) // frame_step frames of N samples (N = frame_length, else the window's length),
weighs each by the window and transforms it: output [B, T, N//2 + 1 if onesided else N, 2].

The windows and MelWeightMatrix depend only on their scalar inputs, which must be constants (or inputs
bound as constants): they fold when shapes bind and never run in a step. Their formulas are ONNX's
(Hamming with α = 25/46; MelWeightMatrix with ONNX's bin rounding, which is not torchaudio's).

Gradients: the windows and MelWeightMatrix have none (their inputs are sizes and frequencies that set
shapes). DFT and STFT are linear in their signal: dX is the adjoint transform of dY (`DFTGrad`,
`STFTGrad`), so a learned layer may sit before a spectral front end. STFT gives no gradient to its
window.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..onnx_wire import numpy_dtype
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, no_grad, op, upgrade

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# Why the windows and the mel matrix never reach a kernel (their registration's `no_kernel`).
CONSTANT_OUTPUT = "its inputs are constants: its output folds to a constant when shapes bind"


def _scalar(node, consts, index: int, what: str, default=None):
    """The value of a scalar input that must be known when shapes bind (None: the default)."""
    if index >= len(node.inputs) or not node.inputs[index]:
        return default
    value = consts[index]
    if value is None:
        raise UnsupportedOpError(f"{node.describe()}: its {what} input '{node.inputs[index]}' must be a constant "
                                 "(an initializer, a Constant, or a model input fed as a constant)")
    value = np.asarray(value)
    if value.size != 1:
        raise ModelError(f"{node.describe()}: its {what} input must hold one value, not shape {list(value.shape)}")
    return value.reshape(())[()]


def _signal_type(node, t: TensorType, what: str = "input") -> None:
    if t.dtype not in FLOATS:
        raise UnsupportedOpError(f"{node.describe()}: its {what} is {t}; odtrain runs {node.op_type} on float32 "
                                 "and float64")
    if t.shape is None or not t.is_static:
        raise UnsupportedOpError(f"{node.describe()}: its {what} {t} needs a static shape")
    if len(t.shape) < 2 or t.shape[-1] not in (1, 2):
        raise ModelError(f"{node.describe()}: its {what} {t} must end in an axis of 1 (real) or 2 (complex)")


def dft_settings(node, types, consts) -> dict:
    """DFT's axis (>= 0), length N, inverse and onesided flags, with ONNX's defaults made explicit."""
    x = types[0]
    _signal_type(node, x)
    rank = len(x.shape)
    axis = int(_scalar(node, consts, 2, "axis", node.attrs.get("axis", -2)))
    if not -rank <= axis < rank or axis % rank == rank - 1:
        raise ModelError(f"{node.describe()}: axis {axis} is not a signal axis of {x} (its last axis holds real "
                         "and imaginary parts)")
    axis %= rank
    inverse, onesided = bool(node.attrs.get("inverse", 0)), bool(node.attrs.get("onesided", 0))
    length = x.shape[axis]
    default = 2 * (length - 1) if inverse and onesided else length
    size = int(_scalar(node, consts, 1, "dft_length", default))
    if size < 1:
        raise ModelError(f"{node.describe()}: dft_length {size} must be positive")
    if onesided and not inverse and x.shape[-1] != 1:
        raise ModelError(f"{node.describe()}: a one-sided DFT takes a real input (last axis 1), not {x}")
    return {"axis": axis, "length": size, "inverse": inverse, "onesided": onesided}


def dft_output_shape(input_shape: tuple, axis: int, length: int, inverse: bool, onesided: bool) -> tuple:
    bins = length // 2 + 1 if onesided and not inverse else length
    parts = 1 if inverse and onesided else 2
    return input_shape[:axis] + (bins,) + input_shape[axis + 1:-1] + (parts,)


@op("DFT", constant_inputs=(1, 2), passes=2)
def _dft_rule(node, types, consts):
    s = dft_settings(node, types, consts)
    return [TensorType(types[0].dtype, dft_output_shape(types[0].shape, s["axis"], s["length"], s["inverse"],
                                                        s["onesided"]))]


@upgrade("DFT", before=20)
def _dft_axis_attribute(node, opset, value_types, source):
    """Before opset 20, DFT's axis was an attribute with default 1; from 20 it is input 2 with default -2.
    Write the old default out, so that the DFT rule reads one meaning."""
    node.attrs.setdefault("axis", 1)


def stft_settings(node, types, consts) -> dict:
    """STFT's frame step, frame length N, frame count T and onesided flag."""
    signal = types[0]
    if signal.shape is not None and len(signal.shape) == 2:  # [batch, samples]: real, as PyTorch exports it
        signal = TensorType(signal.dtype, tuple(signal.shape) + (1,))
    _signal_type(node, signal, "signal")
    if len(signal.shape) != 3:
        raise ModelError(f"{node.describe()}: its signal {signal} must be [batch, samples, 1 or 2] or [batch, samples]")
    step = int(_scalar(node, consts, 1, "frame_step"))
    window = types[2] if len(types) > 2 else None
    if window is not None and (window.shape is None or len(window.shape) != 1 or window.dtype != signal.dtype):
        raise ModelError(f"{node.describe()}: its window {window} must be one axis of {signal.dtype.name}")
    length = _scalar(node, consts, 3, "frame_length")
    length = int(length) if length is not None else window.shape[0] if window is not None else signal.shape[1]
    if window is not None and window.shape[0] != length:
        raise ModelError(f"{node.describe()}: its window has {window.shape[0]} samples, its frame_length {length}")
    if step < 1 or not 1 <= length <= signal.shape[1]:
        raise ModelError(f"{node.describe()}: frame_step {step} and frame_length {length} must be positive, the "
                         f"frame no longer than the signal ({signal.shape[1]} samples)")
    onesided = bool(node.attrs.get("onesided", 1))
    if onesided and signal.shape[-1] != 1:
        raise ModelError(f"{node.describe()}: a one-sided STFT takes a real signal (last axis 1), not {signal}")
    return {"step": step, "length": length, "frames": 1 + (signal.shape[1] - length) // step, "onesided": onesided}


@op("STFT", constant_inputs=(1, 3), passes=2)
def _stft_rule(node, types, consts):
    s = stft_settings(node, types, consts)
    bins = s["length"] // 2 + 1 if s["onesided"] else s["length"]
    return [TensorType(types[0].dtype, (types[0].shape[0], s["frames"], bins, 2))]


def _forward_input_type(node, types, consts):
    return [types[1]]


# (dY, X, dft_length, axis) -> dX; (dY, signal, frame_step, window, frame_length) -> dSignal
op("DFTGrad", ODTRAIN_DOMAIN, shape_only=(1,), constant_inputs=(2, 3), passes=2)(_forward_input_type)
op("STFTGrad", ODTRAIN_DOMAIN, shape_only=(1,), constant_inputs=(2, 4), passes=2)(_forward_input_type)


@grad("DFT")
def _dft_grad(ctx):
    # DFT is linear in X: dX = Fᵀ·dY, the adjoint of the same transform
    ctx.set_grad(0, ctx.odtrain("DFTGrad", [ctx.GO(0), ctx.I(0), ctx.I(1), ctx.I(2)], dict(ctx.node.attrs)))


@grad("STFT")
def _stft_grad(ctx):
    # each frame's samples get Fᵀ·dY[frame] times the window, summed where frames overlap
    ctx.set_grad(0, ctx.odtrain("STFTGrad", [ctx.GO(0), ctx.I(0), ctx.I(1), ctx.I(2), ctx.I(3)],
                                dict(ctx.node.attrs)))


# ---- constants: windows and the mel matrix ---------------------------------------------------------


def _output_dtype(node) -> np.dtype:
    code = int(node.attrs.get("output_datatype", 1))
    dtype = numpy_dtype(code)
    if dtype is None:
        raise ModelError(f"{node.describe()}: output_datatype {code} is not an ONNX tensor type odtrain holds")
    return dtype


def _window_rule(coefficients: tuple):
    """w[n] = Σ_j (-1)^j·a_j·cos(2πjn/D), D = size (periodic) or size - 1 (symmetric)."""

    def rule(node, types, consts):
        size = int(_scalar(node, consts, 0, "size"))
        if size < 1:
            raise ModelError(f"{node.describe()}: size {size} must be positive")
        span = size if int(node.attrs.get("periodic", 1)) else size - 1
        n = np.arange(size, dtype=np.float64)
        w = np.zeros(size)
        for j, a in enumerate(coefficients):
            w += (-1) ** j * a * np.cos(2 * np.pi * j * n / span) if span else (a if j == 0 else 0.0)
        value = w.astype(_output_dtype(node))
        return [TensorType(value.dtype, value.shape)], [value]

    return rule


WINDOWS = {"HannWindow": (0.5, 0.5), "HammingWindow": (25 / 46, 21 / 46), "BlackmanWindow": (0.42, 0.5, 0.08)}
for _name, _coefficients in WINDOWS.items():
    op(_name, constant_inputs=(0,), no_kernel=CONSTANT_OUTPUT)(_window_rule(_coefficients))
    no_grad(_name, "its output depends only on its size")


def mel_weight_matrix(bins: int, dft_length: int, sample_rate: float, low_hz: float, high_hz: float) -> np.ndarray:
    """ONNX's [dft_length//2 + 1, bins] triangles on HTK mel points, each rounded down to a DFT bin."""
    mel = lambda hz: 2595 * np.log10(1 + hz / 700)  # noqa: E731
    points = mel(low_hz) + np.arange(bins + 2) * (mel(high_hz) - mel(low_hz)) / (bins + 2)
    edges = (((dft_length + 1) * (700 * (10 ** (points / 2595) - 1))) // sample_rate).astype(np.int64)
    out = np.zeros((dft_length // 2 + 1, bins))
    for i in range(bins):
        low, centre, high = edges[i:i + 3]
        if centre == low:
            out[centre, i] = 1
        else:
            out[low:centre + 1, i] = (np.arange(low, centre + 1) - low) / (centre - low)
        if high > centre:
            out[centre:high, i] = (high - np.arange(centre, high)) / (high - centre)
    return out


@op("MelWeightMatrix", constant_inputs=(0, 1, 2, 3, 4), no_kernel=CONSTANT_OUTPUT)
def _mel_rule(node, types, consts):
    names = ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz")
    bins, length, rate, low, high = (_scalar(node, consts, i, name) for i, name in enumerate(names))
    if not (int(bins) >= 1 and int(length) >= 2 and rate > 0 and 0 <= low < high <= rate / 2):
        raise ModelError(f"{node.describe()}: num_mel_bins {bins}, dft_length {length}, sample_rate {rate}, "
                         f"edges {low}-{high} Hz: need positive sizes and 0 <= low < high <= sample_rate / 2")
    value = mel_weight_matrix(int(bins), int(length), float(rate), float(low), float(high)).astype(_output_dtype(node))
    return [TensorType(value.dtype, value.shape)], [value]


no_grad("MelWeightMatrix", "its output depends only on sizes and frequencies")
