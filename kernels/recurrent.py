"""GRU and LSTM kernels: forward, and backpropagation through time.

One call per direction. Rows of X (and of every per-step buffer below) keep X's own order:
row(t, n) = t·N + n for layout 0, n·T + t for layout 1, so the input projection of every
step is one BLAS product X·Wᵀ over all T·N rows. Each step then multiplies the N states
by Rᵀ (one product) and applies the gates elementwise. With sequence_lens, sample n runs
steps 0..len-1 (reverse: len-1 down to 0); its later outputs are zero and its state stays.

The backward pass reads the forward's Y (every hidden state), so the recurrent products of
all steps are recomputed at once (H_prev·Rᵀ over T·N rows), then walks the steps backwards
with one product per step (dH_prev = dGates·R), and finishes with three large products:
dX = dGates·W, dW = dGatesᵀ·X, dR = dGatesᵀ·H_prev. Gate math (ONNX's, gate orders z r h
and i o f c):
  GRU   z = σ(..), r = σ(..), h̃ = tanh(X·Whᵀ + (r⊙H)·Rhᵀ + b)   (linear_before_reset=0)
                             h̃ = tanh(X·Whᵀ + r⊙(H·Rhᵀ + Rbh) + Wbh) (linear_before_reset=1)
        H' = (1-z)⊙h̃ + z⊙H
  LSTM  i = σ(.. + Pi⊙C), f = σ(.. + Pf⊙C), c̃ = tanh(..), C' = f⊙C + i⊙c̃,
        o = σ(.. + Po⊙C'), H' = o⊙tanh(C')
Working buffers (input projections, per-step gates, the replayed states) are the node's arena
scratch, placed by the memory planner for that one step.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

from .registry import ODTRAIN_DOMAIN, binding
from .blas import blas_gemm
from .layout import flat, float_buffers
from .scalar import fast_sigmoid, fast_tanh

ONE = np.float32(1.0)


@njit(cache=True, inline="always")
def _row(t, n, steps, batch, layout):
    return t * batch + n if layout == 0 else n * steps + t


@njit(cache=True, inline="always")
def _y_offset(t, d, n, steps, dirs, batch, hidden, layout):
    return ((t * dirs + d) * batch + n) * hidden if layout == 0 else ((n * steps + t) * dirs + d) * hidden


@njit(cache=True, inline="always")
def _state_offset(d, n, dirs, batch, hidden, layout):
    return (d * batch + n) * hidden if layout == 0 else (n * dirs + d) * hidden


@njit(cache=True, inline="always")
def _time(s, length, reverse):
    return length - 1 - s if reverse else s


@njit(cache=True, error_model="numpy")
def _check_lengths(lens, steps):
    for n in range(lens.size):
        if lens[n] < 0 or lens[n] > steps:
            raise ValueError("a sequence_lens entry is outside [0, sequence length]")


@njit(cache=True, error_model="numpy")
def _input_projection(x, w, b, xw, d, rows, inputs, gh, with_recurrent_bias):
    """xw = X·W_dᵀ + Wb_d (+ the first `with_recurrent_bias` entries of Rb_d)."""
    blas_gemm(0, 1, rows, gh, inputs, ONE, x, 0, inputs, w, d * gh * inputs, inputs, np.float32(0.0), xw, 0, gh)
    base = d * 2 * gh
    for row in range(rows):
        for j in range(gh):
            bias = b[base + j]
            if j < with_recurrent_bias:
                bias += b[base + gh + j]
            xw[row * gh + j] += bias


@njit(cache=True, error_model="numpy")
def _gru_forward(x, w, r, b, lens, h0, has_h0, y, has_y, yh, has_yh, d, reverse, steps, batch, inputs, hidden,
                 dirs, layout, linear_before_reset, xw, hr, h, rh):
    """One direction of a GRU: writes its slots of y and yh."""
    _check_lengths(lens, steps)
    hs = hidden
    gh = 3 * hs
    _input_projection(x, w, b, xw, d, steps * batch, inputs, gh, 3 * hs if linear_before_reset == 0 else 2 * hs)
    rbh = d * 2 * gh + gh + 2 * hs  # offset of Rb_h
    for n in range(batch):
        for j in range(hs):
            h[n * hs + j] = h0[_state_offset(d, n, dirs, batch, hs, layout) + j] if has_h0 else 0
    for s in range(steps):
        if linear_before_reset:
            blas_gemm(0, 1, batch, gh, hs, ONE, h, 0, hs, r, d * gh * hs, hs, np.float32(0.0), hr, 0, gh)
        else:
            blas_gemm(0, 1, batch, 2 * hs, hs, ONE, h, 0, hs, r, d * gh * hs, hs, np.float32(0.0), hr, 0, gh)
            for n in range(batch):
                if s >= lens[n]:
                    continue
                row = _row(_time(s, lens[n], reverse), n, steps, batch, layout) * gh
                for j in range(hs):
                    reset = fast_sigmoid(xw[row + hs + j] + hr[n * gh + hs + j])
                    rh[n * hs + j] = reset * h[n * hs + j]
            blas_gemm(0, 1, batch, hs, hs, ONE, rh, 0, hs, r, (d * gh + 2 * hs) * hs, hs, np.float32(0.0),
                       hr, 2 * hs, gh)
        for n in range(batch):
            if s >= lens[n]:
                continue
            t = _time(s, lens[n], reverse)
            row = _row(t, n, steps, batch, layout) * gh
            out = _y_offset(t, d, n, steps, dirs, batch, hs, layout)
            for j in range(hs):
                update = fast_sigmoid(xw[row + j] + hr[n * gh + j])
                if linear_before_reset:
                    reset = fast_sigmoid(xw[row + hs + j] + hr[n * gh + hs + j])
                    cand = fast_tanh(xw[row + 2 * hs + j] + reset * (hr[n * gh + 2 * hs + j] + b[rbh + j]))
                else:
                    cand = fast_tanh(xw[row + 2 * hs + j] + hr[n * gh + 2 * hs + j])
                value = (1 - update) * cand + update * h[n * hs + j]
                h[n * hs + j] = value
                if has_y:
                    y[out + j] = value
    if has_yh:
        for n in range(batch):
            for j in range(hs):
                yh[_state_offset(d, n, dirs, batch, hs, layout) + j] = h[n * hs + j]


@njit(cache=True, error_model="numpy")
def _previous_states(y, h0, has_h0, lens, hprev, d, reverse, steps, batch, hidden, dirs, layout):
    """hprev[row(t, n)] = the state step t of sample n started from (h0, or the previous step's y)."""
    for n in range(batch):
        for s in range(lens[n]):
            t = _time(s, lens[n], reverse)
            row = _row(t, n, steps, batch, layout) * hidden
            if s == 0:
                for j in range(hidden):
                    hprev[row + j] = h0[_state_offset(d, n, dirs, batch, hidden, layout) + j] if has_h0 else 0
            else:
                src = _y_offset(_time(s - 1, lens[n], reverse), d, n, steps, dirs, batch, hidden, layout)
                for j in range(hidden):
                    hprev[row + j] = y[src + j]


@njit(cache=True, error_model="numpy")
def _parameter_grads(x, w, dx, dw, db, dr, g, grec, hprev, d, rows, inputs, hidden, gh, rec_rows, accumulate_dx):
    """dX (+)= G·W_d, dW_d = Gᵀ·X, dWb_d = Σ G, dRb_d = Σ Grec, dR_d[:rec_rows] = Grec[:, :rec_rows]ᵀ·Hprev."""
    zero = np.float32(0.0)
    blas_gemm(0, 0, rows, inputs, gh, ONE, g, 0, gh, w, d * gh * inputs, inputs,
               ONE if accumulate_dx else zero, dx, 0, inputs)
    blas_gemm(1, 0, gh, inputs, rows, ONE, g, 0, gh, x, 0, inputs, zero, dw, d * gh * inputs, inputs)
    blas_gemm(1, 0, rec_rows, hidden, rows, ONE, grec, 0, gh, hprev, 0, hidden, zero, dr, d * gh * hidden, hidden)
    base = d * 2 * gh
    for j in range(2 * gh):
        db[base + j] = 0
    for row in range(rows):
        for j in range(gh):
            db[base + j] += g[row * gh + j]
            db[base + gh + j] += grec[row * gh + j]


@njit(cache=True, error_model="numpy")
def _gru_backward(x, w, r, b, lens, h0, has_h0, y, dy, has_dy, dyh, has_dyh, dx, dw, dr, db, dh0,
                  d, reverse, steps, batch, inputs, hidden, dirs, layout, linear_before_reset, accumulate_dx,
                  xw, hprev, hr, rh, g, grec, carry, dprev, step_g, step_rec):
    """Gradients of one GRU direction; dX accumulates over directions, the rest are per direction."""
    _check_lengths(lens, steps)
    hs = hidden
    gh = 3 * hs
    rows = steps * batch
    zero = np.float32(0.0)
    lbr = linear_before_reset
    _input_projection(x, w, b, xw, d, rows, inputs, gh, 3 * hs if lbr == 0 else 2 * hs)
    _previous_states(y, h0, has_h0, lens, hprev, d, reverse, steps, batch, hs, dirs, layout)
    rbh = d * 2 * gh + gh + 2 * hs
    if lbr:
        blas_gemm(0, 1, rows, gh, hs, ONE, hprev, 0, hs, r, d * gh * hs, hs, zero, hr, 0, gh)
    else:
        blas_gemm(0, 1, rows, 2 * hs, hs, ONE, hprev, 0, hs, r, d * gh * hs, hs, zero, hr, 0, gh)
        for row in range(rows):
            for j in range(hs):
                reset = fast_sigmoid(xw[row * gh + hs + j] + hr[row * gh + hs + j])
                rh[row * hs + j] = reset * hprev[row * hs + j]
        blas_gemm(0, 1, rows, hs, hs, ONE, rh, 0, hs, r, (d * gh + 2 * hs) * hs, hs, zero, hr, 2 * hs, gh)
    for i in range(g.size):
        g[i] = 0
        grec[i] = 0
    for n in range(batch):
        for j in range(hs):
            carry[n * hs + j] = dyh[_state_offset(d, n, dirs, batch, hs, layout) + j] if has_dyh else 0
    for s in range(steps - 1, -1, -1):
        for n in range(batch):
            if s >= lens[n]:
                for j in range(hs):
                    dprev[n * hs + j] = carry[n * hs + j]
                for j in range(gh):
                    step_g[n * gh + j] = 0
                    step_rec[n * gh + j] = 0
                continue
            t = _time(s, lens[n], reverse)
            row = _row(t, n, steps, batch, layout)
            out = _y_offset(t, d, n, steps, dirs, batch, hs, layout)
            a = row * gh
            for j in range(hs):
                update = fast_sigmoid(xw[a + j] + hr[a + j])
                reset = fast_sigmoid(xw[a + hs + j] + hr[a + hs + j])
                if lbr:
                    recurrent = hr[a + 2 * hs + j] + b[rbh + j]
                    cand = fast_tanh(xw[a + 2 * hs + j] + reset * recurrent)
                else:
                    cand = fast_tanh(xw[a + 2 * hs + j] + hr[a + 2 * hs + j])
                dh = carry[n * hs + j] + (dy[out + j] if has_dy else zero)
                previous = hprev[row * hs + j]
                dcand = dh * (1 - update) * (1 - cand * cand)
                dupdate = dh * (previous - cand) * update * (1 - update)
                dprev[n * hs + j] = dh * update
                step_g[n * gh + j] = dupdate
                step_g[n * gh + 2 * hs + j] = dcand
                step_rec[n * gh + j] = dupdate
                if lbr:
                    dreset = dcand * recurrent * reset * (1 - reset)
                    step_g[n * gh + hs + j] = dreset
                    step_rec[n * gh + hs + j] = dreset
                    step_rec[n * gh + 2 * hs + j] = dcand * reset
                else:
                    step_rec[n * gh + 2 * hs + j] = dcand
        if lbr:  # dH_prev += [dz, dr, dh̃⊙r] · R
            blas_gemm(0, 0, batch, hs, gh, ONE, step_rec, 0, gh, r, d * gh * hs, hs, ONE, dprev, 0, hs)
        else:
            # d(r⊙H) = dh̃ · Rh, then dr = d(r⊙H)⊙H and dH_prev += d(r⊙H)⊙r + [dz, dr] · R_zr
            blas_gemm(0, 0, batch, hs, hs, ONE, step_g, 2 * hs, gh, r, (d * gh + 2 * hs) * hs, hs, zero, carry, 0, hs)
            for n in range(batch):
                if s >= lens[n]:
                    continue
                row = _row(_time(s, lens[n], reverse), n, steps, batch, layout)
                a = row * gh
                for j in range(hs):
                    reset = fast_sigmoid(xw[a + hs + j] + hr[a + hs + j])
                    drh = carry[n * hs + j]
                    dreset = drh * hprev[row * hs + j] * reset * (1 - reset)
                    step_g[n * gh + hs + j] = dreset
                    step_rec[n * gh + hs + j] = dreset
                    dprev[n * hs + j] += drh * reset
            blas_gemm(0, 0, batch, hs, 2 * hs, ONE, step_rec, 0, gh, r, d * gh * hs, hs, ONE, dprev, 0, hs)
        for n in range(batch):
            for j in range(hs):
                carry[n * hs + j] = dprev[n * hs + j]
            if s < lens[n]:
                row = _row(_time(s, lens[n], reverse), n, steps, batch, layout) * gh
                for j in range(gh):
                    g[row + j] = step_g[n * gh + j]
                    grec[row + j] = step_rec[n * gh + j]
    for n in range(batch):
        for j in range(hs):
            dh0[_state_offset(d, n, dirs, batch, hs, layout) + j] = carry[n * hs + j]
    if lbr:
        _parameter_grads(x, w, dx, dw, db, dr, g, grec, hprev, d, rows, inputs, hs, gh, gh, accumulate_dx)
    else:
        _parameter_grads(x, w, dx, dw, db, dr, g, grec, hprev, d, rows, inputs, hs, gh, 2 * hs, accumulate_dx)
        # dRh = dh̃ᵀ · (r⊙H_prev)
        blas_gemm(1, 0, hs, hs, rows, ONE, grec, 2 * hs, gh, rh, 0, hs, zero, dr, (d * gh + 2 * hs) * hs, hs)


@njit(cache=True, error_model="numpy")
def _lstm_forward(x, w, r, b, lens, h0, has_h0, c0, has_c0, p, has_p, y, has_y, yh, has_yh, yc, has_yc, d,
                  reverse, steps, batch, inputs, hidden, dirs, layout, xw, hr, h, c):
    """One direction of an LSTM: writes its slots of y, yh and yc."""
    _check_lengths(lens, steps)
    hs = hidden
    gh = 4 * hs
    zero = np.float32(0.0)
    _input_projection(x, w, b, xw, d, steps * batch, inputs, gh, gh)
    pb = d * 3 * hs
    for n in range(batch):
        for j in range(hs):
            state = _state_offset(d, n, dirs, batch, hs, layout) + j
            h[n * hs + j] = h0[state] if has_h0 else 0
            c[n * hs + j] = c0[state] if has_c0 else 0
    for s in range(steps):
        blas_gemm(0, 1, batch, gh, hs, ONE, h, 0, hs, r, d * gh * hs, hs, zero, hr, 0, gh)
        for n in range(batch):
            if s >= lens[n]:
                continue
            t = _time(s, lens[n], reverse)
            a = _row(t, n, steps, batch, layout) * gh
            out = _y_offset(t, d, n, steps, dirs, batch, hs, layout)
            for j in range(hs):
                cell = c[n * hs + j]
                pi = p[pb + j] if has_p else zero
                po = p[pb + hs + j] if has_p else zero
                pf = p[pb + 2 * hs + j] if has_p else zero
                gate_i = fast_sigmoid(xw[a + j] + hr[n * gh + j] + pi * cell)
                gate_f = fast_sigmoid(xw[a + 2 * hs + j] + hr[n * gh + 2 * hs + j] + pf * cell)
                cand = fast_tanh(xw[a + 3 * hs + j] + hr[n * gh + 3 * hs + j])
                cell = gate_f * cell + gate_i * cand
                gate_o = fast_sigmoid(xw[a + hs + j] + hr[n * gh + hs + j] + po * cell)
                value = gate_o * fast_tanh(cell)
                c[n * hs + j] = cell
                h[n * hs + j] = value
                if has_y:
                    y[out + j] = value
    for n in range(batch):
        state = _state_offset(d, n, dirs, batch, hs, layout)
        for j in range(hs):
            if has_yh:
                yh[state + j] = h[n * hs + j]
            if has_yc:
                yc[state + j] = c[n * hs + j]


@njit(cache=True, error_model="numpy")
def _lstm_backward(x, w, r, b, lens, h0, has_h0, c0, has_c0, p, has_p, y, dy, has_dy, dyh, has_dyh, dyc, has_dyc,
                   dx, dw, dr, db, dh0, dc0, dp, d, reverse, steps, batch, inputs, hidden, dirs, layout,
                   accumulate_dx, xw, hprev, cells, cprev, carry, carry_c, dprev, step_g, g):
    """Gradients of one LSTM direction; dX accumulates over directions, the rest are per direction."""
    _check_lengths(lens, steps)
    hs = hidden
    gh = 4 * hs
    rows = steps * batch
    zero = np.float32(0.0)
    pb = d * 3 * hs
    _input_projection(x, w, b, xw, d, rows, inputs, gh, gh)
    _previous_states(y, h0, has_h0, lens, hprev, d, reverse, steps, batch, hs, dirs, layout)
    blas_gemm(0, 1, rows, gh, hs, ONE, hprev, 0, hs, r, d * gh * hs, hs, ONE, xw, 0, gh)  # all pre-activations
    for n in range(batch):  # replay the cell states: elementwise, cheap
        for j in range(hs):
            carry_c[n * hs + j] = c0[_state_offset(d, n, dirs, batch, hs, layout) + j] if has_c0 else 0
        for s in range(lens[n]):
            a = _row(_time(s, lens[n], reverse), n, steps, batch, layout)
            for j in range(hs):
                cell = carry_c[n * hs + j]
                pi = p[pb + j] if has_p else zero
                pf = p[pb + 2 * hs + j] if has_p else zero
                gate_i = fast_sigmoid(xw[a * gh + j] + pi * cell)
                gate_f = fast_sigmoid(xw[a * gh + 2 * hs + j] + pf * cell)
                cand = fast_tanh(xw[a * gh + 3 * hs + j])
                cprev[a * hs + j] = cell
                cell = gate_f * cell + gate_i * cand
                cells[a * hs + j] = cell
                carry_c[n * hs + j] = cell
    for i in range(g.size):
        g[i] = 0
    for i in range(dp.size // dirs):
        dp[pb + i] = 0
    for n in range(batch):
        state = _state_offset(d, n, dirs, batch, hs, layout)
        for j in range(hs):
            carry[n * hs + j] = dyh[state + j] if has_dyh else 0
            carry_c[n * hs + j] = dyc[state + j] if has_dyc else 0
    for s in range(steps - 1, -1, -1):
        for n in range(batch):
            if s >= lens[n]:
                for j in range(hs):
                    dprev[n * hs + j] = carry[n * hs + j]
                for j in range(gh):
                    step_g[n * gh + j] = 0
                continue
            t = _time(s, lens[n], reverse)
            row = _row(t, n, steps, batch, layout)
            a = row * gh
            out = _y_offset(t, d, n, steps, dirs, batch, hs, layout)
            for j in range(hs):
                cell = cells[row * hs + j]
                previous = cprev[row * hs + j]
                pi = p[pb + j] if has_p else zero
                po = p[pb + hs + j] if has_p else zero
                pf = p[pb + 2 * hs + j] if has_p else zero
                gate_i = fast_sigmoid(xw[a + j] + pi * previous)
                gate_f = fast_sigmoid(xw[a + 2 * hs + j] + pf * previous)
                cand = fast_tanh(xw[a + 3 * hs + j])
                gate_o = fast_sigmoid(xw[a + hs + j] + po * cell)
                tanh_cell = fast_tanh(cell)
                dh = carry[n * hs + j] + (dy[out + j] if has_dy else zero)
                do = dh * tanh_cell * gate_o * (1 - gate_o)
                dc = carry_c[n * hs + j] + dh * gate_o * (1 - tanh_cell * tanh_cell) + do * po
                di = dc * cand * gate_i * (1 - gate_i)
                df = dc * previous * gate_f * (1 - gate_f)
                dcand = dc * gate_i * (1 - cand * cand)
                carry_c[n * hs + j] = dc * gate_f + di * pi + df * pf
                if has_p:
                    dp[pb + j] += di * previous
                    dp[pb + hs + j] += do * cell
                    dp[pb + 2 * hs + j] += df * previous
                step_g[n * gh + j] = di
                step_g[n * gh + hs + j] = do
                step_g[n * gh + 2 * hs + j] = df
                step_g[n * gh + 3 * hs + j] = dcand
                dprev[n * hs + j] = 0
        blas_gemm(0, 0, batch, hs, gh, ONE, step_g, 0, gh, r, d * gh * hs, hs, ONE, dprev, 0, hs)
        for n in range(batch):
            for j in range(hs):
                carry[n * hs + j] = dprev[n * hs + j]
            if s < lens[n]:
                row = _row(_time(s, lens[n], reverse), n, steps, batch, layout) * gh
                for j in range(gh):
                    g[row + j] = step_g[n * gh + j]
    for n in range(batch):
        state = _state_offset(d, n, dirs, batch, hs, layout)
        for j in range(hs):
            dh0[state + j] = carry[n * hs + j]
            dc0[state + j] = carry_c[n * hs + j]
    _parameter_grads(x, w, dx, dw, db, dr, g, g, hprev, d, rows, inputs, hs, gh, gh, accumulate_dx)


# ---- bindings ---------------------------------------------------------------------------------


def _config(x, direction, hidden_size, layout):
    dirs = 2 if direction == "bidirectional" else 1
    steps, batch = (x.shape[0], x.shape[1]) if layout == 0 else (x.shape[1], x.shape[0])
    return dirs, int(steps), int(batch), int(x.shape[2]), int(hidden_size)


def _optional(arrays, index, size, dtype=np.float32):
    """(flat array, present) for an optional input or output; a small placeholder when absent."""
    value = arrays[index] if len(arrays) > index else None
    if value is None:
        return np.zeros(max(size, 1), dtype=dtype), False
    return flat(value), True


def _lengths(inputs, steps, batch):
    lens = inputs[4] if len(inputs) > 4 else None
    return flat(lens) if lens is not None else np.full(batch, steps, dtype=np.int32)


def _reversed(direction, d):
    return direction == "reverse" or (direction == "bidirectional" and d == 1)


def _shape_config(input_specs, attrs):
    x_shape = input_specs[0][0]
    dirs = 2 if attrs.get("direction", "forward") == "bidirectional" else 1
    layout = int(attrs.get("layout", 0))
    steps, batch = (x_shape[0], x_shape[1]) if layout == 0 else (x_shape[1], x_shape[0])
    return dirs, int(steps), int(batch), int(attrs["hidden_size"])


def _gru_sizes(steps, batch, hs):
    return steps * batch * 3 * hs, batch * 3 * hs, batch * hs, batch * hs


def _gru_grad_sizes(steps, batch, hs):
    rows, gh = steps * batch, 3 * hs
    return rows * gh, rows * hs, rows * gh, rows * hs, rows * gh, rows * gh, batch * hs, batch * hs, batch * gh, batch * gh


def _lstm_sizes(steps, batch, hs):
    return steps * batch * 4 * hs, batch * 4 * hs, batch * hs, batch * hs


def _lstm_grad_sizes(steps, batch, hs):
    rows, gh = steps * batch, 4 * hs
    return rows * gh, rows * hs, rows * hs, rows * hs, batch * hs, batch * hs, batch * hs, batch * gh, rows * gh


def _scratch_bytes(sizes):
    def size_of(input_specs, output_specs, **attrs):
        _, steps, batch, hs = _shape_config(input_specs, attrs)
        return 4 * sum(sizes(steps, batch, hs))

    return size_of


@binding("GRU", scratch=_scratch_bytes(_gru_sizes))
def GRU(inputs, outputs, hidden_size=None, direction="forward", layout=0, linear_before_reset=0, scratch=None,
        **unused):
    x, w, r = inputs[0], inputs[1], inputs[2]
    dirs, steps, batch, features, hs = _config(x, direction, hidden_size, layout)
    b, _ = _optional(inputs, 3, dirs * 6 * hs, x.dtype)
    h0, has_h0 = _optional(inputs, 5, 0, x.dtype)
    y, has_y = _optional(outputs, 0, 0, x.dtype)
    yh, has_yh = _optional(outputs, 1, 0, x.dtype)
    lens = _lengths(inputs, steps, batch)
    calls = [(_fill_zero, (y,))] if has_y and len(inputs) > 4 and inputs[4] is not None else []
    work = float_buffers(scratch, *_gru_sizes(steps, batch, hs))
    for d in range(dirs):
        calls.append((_gru_forward, (flat(x), flat(w), flat(r), b, lens, h0, has_h0, y, has_y, yh, has_yh, d,
                                     _reversed(direction, d), steps, batch, features, hs, dirs, int(layout),
                                     int(linear_before_reset), *work)))
    return calls


@binding("GRUGrad", ODTRAIN_DOMAIN, scratch=_scratch_bytes(_gru_grad_sizes))
def GRUGrad(inputs, outputs, hidden_size=None, direction="forward", layout=0, linear_before_reset=0, scratch=None):
    x, w, r = inputs[0], inputs[1], inputs[2]
    dirs, steps, batch, features, hs = _config(x, direction, hidden_size, layout)
    b, _ = _optional(inputs, 3, dirs * 6 * hs, x.dtype)
    h0, has_h0 = _optional(inputs, 5, 0, x.dtype)
    y = flat(inputs[6])
    dy, has_dy = _optional(inputs, 7, 0, x.dtype)
    dyh, has_dyh = _optional(inputs, 8, 0, x.dtype)
    lens = _lengths(inputs, steps, batch)
    dx, dw, dr, db, dh0 = (flat(outputs[i]) for i in (0, 1, 2, 3, 5))
    work = float_buffers(scratch, *_gru_grad_sizes(steps, batch, hs))
    return [(_gru_backward, (flat(x), flat(w), flat(r), b, lens, h0, has_h0, y, dy, has_dy, dyh, has_dyh, dx, dw, dr,
                             db, dh0, d, _reversed(direction, d), steps, batch, features, hs, dirs, int(layout),
                             int(linear_before_reset), d > 0, *work)) for d in range(dirs)]


@binding("LSTM", scratch=_scratch_bytes(_lstm_sizes))
def LSTM(inputs, outputs, hidden_size=None, direction="forward", layout=0, scratch=None, **unused):
    x, w, r = inputs[0], inputs[1], inputs[2]
    dirs, steps, batch, features, hs = _config(x, direction, hidden_size, layout)
    b, _ = _optional(inputs, 3, dirs * 8 * hs, x.dtype)
    h0, has_h0 = _optional(inputs, 5, 0, x.dtype)
    c0, has_c0 = _optional(inputs, 6, 0, x.dtype)
    p, has_p = _optional(inputs, 7, 0, x.dtype)
    y, has_y = _optional(outputs, 0, 0, x.dtype)
    yh, has_yh = _optional(outputs, 1, 0, x.dtype)
    yc, has_yc = _optional(outputs, 2, 0, x.dtype)
    lens = _lengths(inputs, steps, batch)
    calls = [(_fill_zero, (y,))] if has_y and len(inputs) > 4 and inputs[4] is not None else []
    work = float_buffers(scratch, *_lstm_sizes(steps, batch, hs))
    for d in range(dirs):
        calls.append((_lstm_forward, (flat(x), flat(w), flat(r), b, lens, h0, has_h0, c0, has_c0, p, has_p, y, has_y,
                                      yh, has_yh, yc, has_yc, d, _reversed(direction, d), steps, batch, features, hs,
                                      dirs, int(layout), *work)))
    return calls


@binding("LSTMGrad", ODTRAIN_DOMAIN, scratch=_scratch_bytes(_lstm_grad_sizes))
def LSTMGrad(inputs, outputs, hidden_size=None, direction="forward", layout=0, scratch=None):
    x, w, r = inputs[0], inputs[1], inputs[2]
    dirs, steps, batch, features, hs = _config(x, direction, hidden_size, layout)
    b, _ = _optional(inputs, 3, dirs * 8 * hs, x.dtype)
    h0, has_h0 = _optional(inputs, 5, 0, x.dtype)
    c0, has_c0 = _optional(inputs, 6, 0, x.dtype)
    p, has_p = _optional(inputs, 7, 0, x.dtype)
    y = flat(inputs[8])
    dy, has_dy = _optional(inputs, 9, 0, x.dtype)
    dyh, has_dyh = _optional(inputs, 10, 0, x.dtype)
    dyc, has_dyc = _optional(inputs, 11, 0, x.dtype)
    lens = _lengths(inputs, steps, batch)
    dx, dw, dr, db, dh0, dc0, dp = (flat(outputs[i]) for i in (0, 1, 2, 3, 5, 6, 7))
    work = float_buffers(scratch, *_lstm_grad_sizes(steps, batch, hs))
    return [(_lstm_backward, (flat(x), flat(w), flat(r), b, lens, h0, has_h0, c0, has_c0, p, has_p, y, dy, has_dy,
                              dyh, has_dyh, dyc, has_dyc, dx, dw, dr, db, dh0, dc0, dp, d, _reversed(direction, d),
                              steps, batch, features, hs, dirs, int(layout), d > 0, *work)) for d in range(dirs)]


@njit(cache=True, error_model="numpy")
def _fill_zero(out):
    for i in range(out.size):
        out[i] = 0
