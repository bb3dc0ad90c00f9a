"""Signal kernels: DFT and STFT (and their gradients) as matrix products with a transform basis.

A transform of `rows` complex or real samples into `bins` outputs is one product with a basis of
[rows·C_in, bins·C_out] (C = 1 for real, 2 for real and imaginary parts interleaved), built once when
the step is bound, in float64 and then cast:
- sample j, output k, angle θ = ±2π·jk/N (minus forward, plus inverse, which also divides by N):
  (xr + i·xi)·(cos θ + i·sin θ) gives rows (cos, sin) for xr and (-sin, cos) for xi;
- the inverse one-sided transform (numpy's irfft) reads bins k <= N/2 of a symmetric spectrum: output
  t = Σ_k w_k·(Xr_k·cos θ - Xi_k·sin θ)/N with w_k = 2 but for the zero and Nyquist bins (1).
A forward input longer than N is cut (the basis has N rows); a shorter one counts as zero-padded (the
basis has only the input's rows). The adjoint (a gradient) is the product with the basis transposed.

DFT gathers each line along its axis into scratch rows, multiplies, and scatters; STFT gathers its
frames, each weighed by the window, and writes the product straight into the output.

Imports numpy and numba only.
"""
from __future__ import annotations

import numpy as np

from .registry import ODTRAIN_DOMAIN, binding
from .blas import product
from .jit import njit


def dft_basis(rows: int, c_in: int, length: int, bins: int, c_out: int, inverse: bool, dtype) -> np.ndarray:
    """[rows·c_in, bins·c_out]: the map from `rows` samples to `bins` outputs of a length-N transform."""
    j = np.arange(rows)[:, None]
    k = np.arange(bins)[None, :]
    if inverse and c_out == 1:  # one-sided inverse: real output t = k here, the spectrum's bins j
        theta = 2 * np.pi * ((j * k) % length) / length
        weight = np.where((j == 0) | (2 * j == length), 1.0, 2.0) / length
        parts = [weight * np.cos(theta), -weight * np.sin(theta)][:c_in]
        return np.stack(parts, axis=1).reshape(rows * c_in, bins).astype(dtype)
    theta = (1 if inverse else -1) * 2 * np.pi * ((j * k) % length) / length
    cos, sin = np.cos(theta), np.sin(theta)
    basis = np.empty((rows, c_in, bins, 2))
    basis[:, 0, :, 0], basis[:, 0, :, 1] = cos, sin
    if c_in == 2:
        basis[:, 1, :, 0], basis[:, 1, :, 1] = -sin, cos
    if inverse:
        basis /= length
    return basis.reshape(rows * c_in, bins * 2).astype(dtype)


@njit(cache=True, error_model="numpy")
def _transform_lines(x, basis, out, lines, products, rows_in, rows_out):
    """out[o, :rows_out, i, :] = x[o, :rows_in, i, :] · basis for every line (o, i); rows past rows_out
    are zero. x [outer, ≥rows_in, inner, C_in], out [outer, ≥rows_out, inner, C_out]."""
    inner, c_in, c_out = x.shape[2], x.shape[3], out.shape[3]
    for o in range(x.shape[0]):
        for i in range(inner):
            for j in range(rows_in):
                for c in range(c_in):
                    lines[i, j * c_in + c] = x[o, j, i, c]
        product(lines, basis, products)
        out[o] = 0
        for k in range(rows_out):
            for i in range(inner):
                for d in range(c_out):
                    out[o, k, i, d] = products[i, k * c_out + d]


@njit(cache=True, error_model="numpy")
def _stft(signal, window, basis, out, frames, step):
    """out[b, t] = Σ_n signal[b, t·step + n]·window[n]·basis[n]: frames gathered, then one product."""
    length, channels = window.size, signal.shape[2]
    for b in range(signal.shape[0]):
        for t in range(frames.shape[0]):
            for n in range(length):
                for c in range(channels):
                    frames[t, n * channels + c] = signal[b, t * step + n, c] * window[n]
        product(frames, basis, out[b])


@njit(cache=True, error_model="numpy")
def _stft_grad(grad_out, window, basis_t, grad_signal, frames, step):
    """dSignal[b, t·step + n] += window[n]·(dY[b, t] · basisᵀ)[n], over the frames that hold each sample."""
    length, channels = window.size, grad_signal.shape[2]
    grad_signal[:] = 0
    for b in range(grad_signal.shape[0]):
        product(grad_out[b], basis_t, frames)
        for t in range(frames.shape[0]):
            for n in range(length):
                for c in range(channels):
                    grad_signal[b, t * step + n, c] += frames[t, n * channels + c] * window[n]


def _value(inputs, index, default):
    return default if len(inputs) <= index or inputs[index] is None else int(np.asarray(inputs[index]).reshape(-1)[0])


def _dft_geometry(x_shape, inputs, axis, inverse, onesided):
    """(axis >= 0, N, input rows used, bins, C_out) of a DFT of input shape x_shape."""
    axis = _value(inputs, 2, axis) % len(x_shape)
    length = _value(inputs, 1, 2 * (x_shape[axis] - 1) if inverse and onesided else x_shape[axis])
    if inverse and onesided:
        return axis, length, min(x_shape[axis], length // 2 + 1), length, 1
    return axis, length, min(x_shape[axis], length), length // 2 + 1 if onesided else length, 2


def _lines(shape, axis):
    """shape as [outer, along axis, inner, parts]."""
    return (int(np.prod(shape[:axis], dtype=np.int64)), shape[axis],
            int(np.prod(shape[axis + 1:-1], dtype=np.int64)), shape[-1])


def _dft_scratch(specs_in, specs_out, **attrs):
    """At most one gathered copy of the input and one product of the output's size."""
    (x_shape, dtype), (y_shape, _) = specs_in[0], specs_out[0]
    return np.dtype(dtype).itemsize * int(np.prod(x_shape, dtype=np.int64) + np.prod(y_shape, dtype=np.int64))


def _split(scratch, dtype, first: tuple, second: tuple):
    item = np.dtype(dtype).itemsize
    count = first[0] * first[1]
    a = scratch[:count * item].view(dtype).reshape(first)
    b = scratch[count * item:(count + second[0] * second[1]) * item].view(dtype).reshape(second)
    return a, b


def _dft_calls(x, y, inputs, axis, inverse, onesided, scratch, adjoint):
    """Calls of a DFT from `x` to `y` or (adjoint) of its gradient from dY `x` to dX `y`."""
    forward_x = y if adjoint else x
    axis, length, rows, bins, c_out = _dft_geometry(forward_x.shape, inputs, axis, bool(inverse), bool(onesided))
    c_in = forward_x.shape[-1]
    basis = dft_basis(rows, c_in, length, bins, c_out, bool(inverse), x.dtype)
    if adjoint:
        basis, rows, bins, c_in, c_out = np.ascontiguousarray(basis.T), bins, rows, c_out, c_in
    x4, y4 = x.reshape(_lines(x.shape, axis)), y.reshape(_lines(y.shape, axis))
    lines, products = _split(scratch, x.dtype, (x4.shape[2], rows * c_in), (x4.shape[2], bins * c_out))
    return [(_transform_lines, (x4, basis, y4, lines, products, rows, bins))]


@binding("DFT", scratch=_dft_scratch)
def DFT(inputs, outputs, axis=-2, inverse=0, onesided=0, scratch=None):
    return _dft_calls(inputs[0], outputs[0], inputs, axis, inverse, onesided, scratch, adjoint=False)


@binding("DFTGrad", ODTRAIN_DOMAIN, scratch=_dft_scratch)
def DFTGrad(inputs, outputs, axis=-2, inverse=0, onesided=0, scratch=None):
    return _dft_calls(inputs[0], outputs[0], [inputs[1]] + list(inputs[2:]), axis, inverse, onesided, scratch,
                      adjoint=True)


def _channels(signal):
    """A signal as [batch, samples, 1 or 2]: [batch, samples] is real."""
    return signal.reshape(signal.shape + (1,)) if signal.ndim == 2 else signal


def _stft_setup(signal, spectrum, inputs, onesided):
    """(window, basis [N·C, bins·2], frame step) of an STFT from `signal` to `spectrum`."""
    step = _value(inputs, 1, 1)
    window = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    length = _value(inputs, 3, window.size if window is not None else signal.shape[1])
    if window is None:
        window = np.ones(length, dtype=signal.dtype)
    bins = spectrum.shape[2]
    return window, dft_basis(length, signal.shape[2], length, bins, 2, False, signal.dtype), step


def _stft_scratch(specs_in, specs_out, **attrs):
    """The frames: [T, N·C] with N <= 2·bins - 1 (bins = N//2 + 1 one-sided, N otherwise)."""
    (signal_shape, dtype), (out_shape, _) = specs_in[0], specs_out[0]
    if len(signal_shape) == 4:  # STFTGrad: dY is input 0, the signal's gradient its output
        signal_shape, out_shape = out_shape, signal_shape
    channels = signal_shape[2] if len(signal_shape) == 3 else 1
    return np.dtype(dtype).itemsize * out_shape[1] * (2 * out_shape[2] - 1) * channels


@binding("STFT", scratch=_stft_scratch)
def STFT(inputs, outputs, onesided=1, scratch=None):
    signal, out = _channels(inputs[0]), outputs[0]
    window, basis, step = _stft_setup(signal, out, inputs, onesided)
    frames = scratch[:out.shape[1] * basis.shape[0] * signal.itemsize].view(signal.dtype).reshape(
        out.shape[1], basis.shape[0])
    return [(_stft, (signal, window, basis, out.reshape(out.shape[0], out.shape[1], -1), frames, step))]


@binding("STFTGrad", ODTRAIN_DOMAIN, scratch=_stft_scratch)
def STFTGrad(inputs, outputs, onesided=1, scratch=None):
    grad_out, signal, grad_signal = inputs[0], _channels(inputs[1]), _channels(outputs[0])
    window, basis, step = _stft_setup(signal, grad_out, inputs[1:], onesided)
    frames = scratch[:grad_out.shape[1] * basis.shape[0] * signal.itemsize].view(signal.dtype).reshape(
        grad_out.shape[1], basis.shape[0])
    return [(_stft_grad, (grad_out.reshape(grad_out.shape[0], grad_out.shape[1], -1), window,
                          np.ascontiguousarray(basis.T), grad_signal, frames, step))]
