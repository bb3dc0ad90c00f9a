"""Rotary position embeddings and attention (opset 23), forward and backward.

RotaryEmbedding rotates pairs of a head's elements by per-position angles: for each pair
(lo, hi) — (i, i + rot/2), or (2i, 2i + 1) interleaved — with c = cos and s = sin of its angle,
    y_lo = x_lo·c - x_hi·s,   y_hi = x_hi·c + x_lo·s        (elements past `rot` pass through)
and the gradient applies the transposed rotation. Heads are walked as [batch, heads, seq, head]
through element strides, so a 3-D input [batch, seq, heads·head] is read in place. The caches
are rows of rot/2 values, picked by position_ids or by (batch, seq).

odtrain's fused form (graph/fusion.py) computes what exporters write for it,
    y = x·cos + r(x)·sin,   r(x) = Concat(-x[..., split:], x[..., :split])
with caches of the full head width broadcast to x (nothing assumed of their halves, nor of the
split, which is read when the step is bound); its transpose gives dx.

Attention, per (batch, head), with kv head = head // (q heads / kv heads) (grouped-query):
    T = scale·Q·Kᵀ;  T ← softcap·tanh(T/softcap) if softcap > 0;  P = softmax(T + bias);  Y = P·V
where bias is 0 or -inf from the boolean mask, the additive float mask, causality (key j
after query i + offset), the sliding window and nonpad_kv_seqlen; a row every key of which
is masked gives P = 0. Each softmax row is three vectorised loops with the Softmax kernel's exp (a
row seen only up to its causal limit when nothing else masks it); products are BLAS calls on the heads
in place (3-D inputs through their row stride); one [seq, kv_seq] score matrix at a time lives in the
node's scratch. The
backward recomputes T and P instead of keeping them (three score matrices of scratch):
    dV += Pᵀ·dY;  dP = dY·Vᵀ;  dT = P ⊙ (dP - Σ_j dP⊙P) (· (1 - tanh²) under softcap)
    dQ = scale·dT·K;  dK += scale·dTᵀ·Q     (kv heads sum over their query heads)
With threads, the (batch, kv head) units split into parallel parts (kernels/parallel_split.py), each with
its own score matrices in the scratch: a unit's query heads, and its dK and dV blocks, belong to
one part, so every value is summed in the serial order and a run gives the serial bits.
RotaryEmbedding and its fused form split their rows into parts likewise (not the caches' gradients,
whose rows several parts would share).
"""
from __future__ import annotations

import math

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .blas import gemm_blocks
from .layout import element_strides, flat, float_buffers
from .parallel_split import on_parts, parallel_twin, part_count, split, twin_of
from .scalar import fast_exp

# ---- rotary embeddings ----------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _rotate_pairs(x, cos, sin, positions, y, batch, heads, seq, xb, xh, xs, cb, ch, cs, row_width, half, head_size,
                  rot, interleaved, inverse, first, last):
    """y ← ONNX's rotation of x (its transpose when `inverse`), see the module docstring, for the (batch,
    head) units [first, last)."""
    for unit in range(first, last):
        b, h = unit // heads, unit % heads
        for s in range(seq):
            xo = b * xb + h * xh + s * xs
            if positions.size > 0:
                p = positions[b * seq + s]
                if p < 0 or p * row_width >= cos.size:
                    raise ValueError("a position id is outside the rotary cache")
                co = p * row_width
            else:
                co = b * cb + h * ch + s * cs
            if not interleaved:  # the halves as slices indexed from 0: the loop vectorises
                c, t = cos[co:co + half], sin[co:co + half]
                x_lo, x_hi = x[xo:xo + half], x[xo + half:xo + rot]
                y_lo, y_hi = y[xo:xo + half], y[xo + half:xo + rot]
                if inverse:
                    for i in range(half):
                        y_lo[i] = x_lo[i] * c[i] + x_hi[i] * t[i]
                        y_hi[i] = x_hi[i] * c[i] - x_lo[i] * t[i]
                else:
                    for i in range(half):
                        y_lo[i] = x_lo[i] * c[i] - x_hi[i] * t[i]
                        y_hi[i] = x_hi[i] * c[i] + x_lo[i] * t[i]
            for i in range(half if interleaved else 0):
                c = cos[co + i]
                t = sin[co + i]
                a = x[xo + 2 * i]
                e = x[xo + 2 * i + 1]
                if inverse:
                    y[xo + 2 * i] = a * c + e * t
                    y[xo + 2 * i + 1] = e * c - a * t
                else:
                    y[xo + 2 * i] = a * c - e * t
                    y[xo + 2 * i + 1] = e * c + a * t
            for d in range(rot, head_size):
                y[xo + d] = x[xo + d]


_rotate_pairs_parts = parallel_twin(_rotate_pairs, range=("first", "last"))


@njit(cache=True, error_model="numpy")
def _rotate_pairs_cache_grad(dy, x, positions, dcos, dsin, batch, heads, seq, xb, xh, xs, cb, ch, cs, row_width,
                             half, interleaved):
    """dcos, dsin of ONNX's rotation (cache rows read several times sum their contributions)."""
    for i in range(dcos.size):
        dcos[i] = 0
        dsin[i] = 0
    for b in range(batch):
        for h in range(heads):
            for s in range(seq):
                xo = b * xb + h * xh + s * xs
                co = positions[b * seq + s] * row_width if positions.size > 0 else b * cb + h * ch + s * cs
                for i in range(half):
                    lo = 2 * i if interleaved else i
                    hi = lo + 1 if interleaved else i + half
                    a, e, g_lo, g_hi = x[xo + lo], x[xo + hi], dy[xo + lo], dy[xo + hi]
                    dcos[co + i] += g_lo * a + g_hi * e
                    dsin[co + i] += g_hi * a - g_lo * e


@njit(cache=True, inline="always", error_model="numpy")
def _rolled(x, row, d, split, keep):
    """r(x)[d] of one row: -x[d + split] for the first `keep` elements, then x[d - keep]."""
    return -x[row + d + split] if d < keep else x[row + d - keep]


@njit(cache=True, inline="always", error_model="numpy")
def _turn(y, x, c, z, t, negate):
    """y[e] = x[e]·c[e] + z[e]·t[e] (or - z[e]·t[e]) over slices of one length: every operand indexed from 0,
    so LLVM vectorises the loop (indexing one row at two offsets, d and d + split, it does not; bench_ops
    DecoderLayoutOps times the rotary embedding)."""
    if negate:
        for e in range(y.size):
            y[e] = x[e] * c[e] + -z[e] * t[e]
    else:
        for e in range(y.size):
            y[e] = x[e] * c[e] + z[e] * t[e]


@njit(cache=True, error_model="numpy")
def _rotate_half(x, cos, sin, y, batch, heads, seq, cb, ch, cs, width, split, inverse, first, last):
    """y ← x·cos + r(x)·sin per row of `width` with r(x) = [-x[split:], x[:split]] (its transpose when
    `inverse`), rows [first, last); x and y are contiguous [batch, heads, seq, width], the caches broadcast
    through strides."""
    keep = width - split
    for row in range(first, last):
        s, bh = row % seq, row // seq
        xo, co = row * width, (bh // heads) * cb + (bh % heads) * ch + s * cs
        xr, yr, c, t = x[xo:xo + width], y[xo:xo + width], cos[co:co + width], sin[co:co + width]
        if inverse:  # dx[d] = dy[d]·c[d] + the term of the output that reads x[d] through r
            _turn(yr[:split], xr[:split], c[:split], xr[keep:], t[keep:], False)
            _turn(yr[split:], xr[split:], c[split:], xr[:keep], t[:keep], True)
        else:
            _turn(yr[:keep], xr[:keep], c[:keep], xr[split:], t[:keep], True)
            _turn(yr[keep:], xr[keep:], c[keep:], xr[:split], t[keep:], False)


_rotate_half_parts = parallel_twin(_rotate_half, range=("first", "last"))


@njit(cache=True, error_model="numpy")
def _rotate_half_cache_grad(dy, x, dcos, dsin, batch, heads, seq, cb, ch, cs, width, split):
    """dcos += dy·x, dsin += dy·r(x), summed over the axes the caches broadcast along."""
    dcos[:] = 0
    dsin[:] = 0
    keep = width - split
    for b in range(batch):
        for h in range(heads):
            for s in range(seq):
                xo = ((b * heads + h) * seq + s) * width
                co = b * cb + h * ch + s * cs
                for d in range(width):
                    dcos[co + d] += dy[xo + d] * x[xo + d]
                    dsin[co + d] += dy[xo + d] * _rolled(x, xo, d, split, keep)


class _RotaryLayout:
    """ONNX RotaryEmbedding's walk of x [batch, heads, seq, head] (4-D, or 3-D [batch, seq, heads·head])
    and of its caches ([positions, rot/2] rows by position id, or [batch, seq, rot/2])."""

    def __init__(self, x_shape, cache_shape, has_positions, num_heads, rotary_embedding_dim):
        if len(x_shape) == 4:
            self.batch, self.heads, self.seq, self.head_size = (int(d) for d in x_shape)
            self.x_strides = (self.heads * self.seq * self.head_size, self.seq * self.head_size, self.head_size)
        else:
            self.batch, self.seq, hidden = (int(d) for d in x_shape)
            self.heads = int(num_heads)
            self.head_size = hidden // self.heads
            self.x_strides = (self.seq * hidden, self.head_size, hidden)
        self.rot = int(rotary_embedding_dim) or self.head_size
        self.row_width = int(cache_shape[-1])
        if has_positions:
            self.cache_strides = (0, 0, 0)
        else:  # the same row for every head
            batch_stride, seq_stride, _ = element_strides(tuple(cache_shape), (self.batch, self.seq, self.row_width))
            self.cache_strides = (batch_stride, 0, seq_stride)

    def walk(self):
        return (self.batch, self.heads, self.seq, *self.x_strides, *self.cache_strides, self.row_width, self.rot // 2)


def _half_rotation_walk(x, cos, split):
    """(batch, heads, seq, cache strides..., width, split) of odtrain's fused form; split as Slice reads it."""
    batch, heads, seq, width = (int(d) for d in x.shape)
    cb, ch, cs, _ = element_strides(tuple(cos.shape), (batch, heads, seq, width))
    point = int(split.reshape(-1)[0])
    point = min(max(point + width if point < 0 else point, 0), width)
    return batch, heads, seq, cb, ch, cs, width, point


def _positions(inputs):
    return flat(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else np.zeros(0, np.int64)


def _pairs_call(x, cos, sin, positions, y, layout, interleaved, inverse, threads):
    args = (flat(x), flat(cos), flat(sin), positions, flat(y), *layout.walk(), layout.head_size, layout.rot,
            bool(interleaved), inverse)
    units = layout.batch * layout.heads
    return split((_rotate_pairs, args + (0, units)), units, x.size, threads)


def _half_call(x, cos, sin, y, walk, inverse, threads):
    rows = walk[0] * walk[1] * walk[2]
    return split((_rotate_half, (flat(x), flat(cos), flat(sin), flat(y), *walk, inverse, 0, rows)), rows, x.size,
                 threads)


@binding("RotaryEmbedding", parallel=True)
def RotaryEmbedding(inputs, outputs, interleaved=0, num_heads=0, rotary_embedding_dim=0, threads=1):
    x, cos, sin = inputs[:3]
    positions = _positions(inputs)
    layout = _RotaryLayout(x.shape, cos.shape, positions.size > 0, num_heads, rotary_embedding_dim)
    return [_pairs_call(x, cos, sin, positions, outputs[0], layout, interleaved, False, threads)]


@binding("RotaryEmbedding", ODTRAIN_DOMAIN, parallel=True)
def RotateHalf(inputs, outputs, threads=1):
    """odtrain's fused `x·cos + rotate_half(x)·sin`: x [batch, heads, seq, head], caches of the full head
    width broadcast to x, the halves split where the exported Slices split them (input 3)."""
    x, cos, sin, split = inputs
    return [_half_call(x, cos, sin, outputs[0], _half_rotation_walk(x, cos, split), False, threads)]


@binding("RotaryEmbeddingGrad", ODTRAIN_DOMAIN, parallel=True)
def RotaryEmbeddingGrad(inputs, outputs, interleaved=0, num_heads=0, rotary_embedding_dim=0, full_width=0,
                        threads=1):
    """(dY, cos, sin, position_ids? or the split (full_width), X?) -> dX?, dcos?, dsin? (the caches' need X)."""
    dy, cos, sin = inputs[:3]
    x = inputs[4] if len(inputs) > 4 else None
    dx = outputs[0]
    dcos, dsin = (outputs[i] if len(outputs) > i and outputs[i] is not None else np.zeros_like(cos) for i in (1, 2))
    caches = len(outputs) > 1 and any(o is not None for o in outputs[1:])
    calls = []
    if full_width:
        walk = _half_rotation_walk(dy, cos, inputs[3])
        if dx is not None:
            calls.append(_half_call(dy, cos, sin, dx, walk, True, threads))
        if caches:
            calls.append((_rotate_half_cache_grad, (flat(dy), flat(x), flat(dcos), flat(dsin), *walk)))
        return calls
    positions = _positions(inputs)
    layout = _RotaryLayout(dy.shape, cos.shape, positions.size > 0, num_heads, rotary_embedding_dim)
    if dx is not None:
        calls.append(_pairs_call(dy, cos, sin, positions, dx, layout, interleaved, True, threads))
    if caches:
        calls.append((_rotate_pairs_cache_grad, (flat(dy), flat(x), positions, flat(dcos), flat(dsin), *layout.walk(),
                                                 bool(interleaved))))
    return calls


# ---- attention --------------------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _softmax_row(row):
    """row ← softmax(row) in place: three loops over a contiguous slice that LLVM vectorises (the max and the
    sum reassociated), exp as the Softmax kernel computes it (fast_exp). Not inlined: an inlined body takes
    its caller's fastmath flags, and without them these loops stay scalar (4x slower)."""
    top = row[0]
    for j in range(1, row.size):
        top = max(top, row[j])
    total = np.float32(0.0)
    for j in range(row.size):
        e = fast_exp(row[j] - top)
        row[j] = e
        total += e
    inverse = np.float32(1.0) / total
    for j in range(row.size):
        row[j] *= inverse


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _softmax_grad_row(grad, probs):
    """grad ← probs ⊙ (grad - Σ grad⊙probs) in place (vectorised, as softmax_row)."""
    total = np.float32(0.0)
    for j in range(grad.size):
        total += grad[j] * probs[j]
    for j in range(grad.size):
        grad[j] = probs[j] * (grad[j] - total)


NO_MASK, ADDITIVE_MASK, BOOLEAN_MASK = 0, 1, 2


@njit(cache=True, inline="always", error_model="numpy")
def _bias(mask, mask_kind, mask_base, ms_i, ms_j, mask_width, i, j, causal_offset, causal, left, right, valid_keys):
    """The additive bias of score (i, j): 0, the float mask's value, or -inf where the key is masked."""
    bias = np.float32(0.0)
    if mask_kind != NO_MASK:
        if j >= mask_width:
            return -np.inf
        value = mask[mask_base + i * ms_i + j * ms_j]
        if mask_kind == BOOLEAN_MASK:
            if not value:
                return -np.inf
        else:
            bias = np.float32(value)
    if causal and j > i + causal_offset:
        return -np.inf
    if left >= 0 and i + causal_offset - j > left:
        return -np.inf
    if right >= 0 and j - (i + causal_offset) > right:
        return -np.inf
    if j >= valid_keys:
        return -np.inf
    return bias


@njit(cache=True, error_model="numpy")
def _scores(q, k, mask, mask_kind, mask_strides, mask_width, nonpad, past, q_off, k_off, q_ld, k_ld, b, h,
            seq, keys, head_size, scale, softcap, causal, left, right, raw, probs, qk_out, qk_mode, qk_off):
    """raw ← scale·Q·Kᵀ (softcapped) and probs ← the masked softmax of one (batch, head); qk_out per qk_mode."""
    if mask_kind == NO_MASK and left < 0 and right < 0 and nonpad.size == 0 and softcap <= 0 and qk_out.size == 0:
        # nothing masked but causality, nothing written out: the scores straight into probs, each row's softmax
        # over the keys it sees (the prefix up to i + past), the rest 0, as the bias of -inf gives
        gemm_blocks(0, 1, seq, keys, head_size, scale, q, q_off, q_ld, k, k_off, k_ld, 0.0, probs, 0, keys)
        for i in range(seq):
            row = probs[i * keys:(i + 1) * keys]
            seen = max(0, min(keys, i + past + 1)) if causal else keys
            if seen > 0:
                _softmax_row(row[:seen])
            for j in range(seen, keys):
                row[j] = 0.0
        return
    gemm_blocks(0, 1, seq, keys, head_size, scale, q, q_off, q_ld, k, k_off, k_ld, 0.0, raw, 0, keys)
    if nonpad.size > 0:
        valid = nonpad[b]
        offset = valid - seq if past == 0 else past
    else:
        valid = keys
        offset = past
    mask_base = b * mask_strides[0] + h * mask_strides[1]
    for i in range(seq):
        row = i * keys
        top = -np.inf
        for j in range(keys):
            t = raw[row + j]
            if softcap > 0:
                t = softcap * math.tanh(t / softcap)
                raw[row + j] = t
            if qk_mode <= 1 and qk_out.size > 0:
                qk_out[qk_off + row + j] = t
            bias = _bias(mask, mask_kind, mask_base, mask_strides[2], mask_strides[3], mask_width, i, j, offset,
                         causal, left, right, valid)
            if bias == -np.inf:
                probs[row + j] = -np.inf
                if qk_mode == 2 and qk_out.size > 0:
                    qk_out[qk_off + row + j] = -np.inf
                continue
            value = t + bias
            probs[row + j] = value
            if qk_mode == 2 and qk_out.size > 0:
                qk_out[qk_off + row + j] = value
            top = max(top, value)
        if top == -np.inf:  # every key masked: the row attends to nothing
            for j in range(keys):
                probs[row + j] = 0.0
        else:  # a masked key's -inf gives exp 0
            _softmax_row(probs[row:row + keys])
        if qk_mode == 3 and qk_out.size > 0:
            for j in range(keys):
                qk_out[qk_off + row + j] = probs[row + j]


@njit(cache=True, error_model="numpy")
def _attention(q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, past, y, qk_out, qk_mode, q_offs, k_offs,
               v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size, v_head_size,
               scale, softcap, causal, left, right, raw, probs, first, last):
    """Y of the key/value units [first, last): unit (batch b, kv head) with its group of query heads."""
    group = q_heads // kv_heads
    for kh in range(first, last):
        b = kh // kv_heads
        for h in range((kh % kv_heads) * group, (kh % kv_heads + 1) * group):
            _scores(q, k, mask, mask_kind, mask_strides, mask_width, nonpad, past, q_offs[b * q_heads + h],
                    k_offs[kh], q_ld, k_ld, b, h, seq, keys, head_size, scale, softcap, causal, left, right, raw,
                    probs, qk_out, qk_mode, (b * q_heads + h) * seq * keys)
            gemm_blocks(0, 0, seq, v_head_size, keys, 1.0, probs, 0, keys, v, v_offs[kh], v_ld, 0.0, y,
                        y_offs[b * q_heads + h], y_ld)


@twin_of(_attention, range=("first", "last"),
         because="each part runs on its own score matrices (raw and probs cut by part, not by unit)")
@njit(cache=True, error_model="numpy", parallel=True)
def _attention_parts(q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, past, y, qk_out, qk_mode, q_offs,
                     k_offs, v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                     v_head_size, scale, softcap, causal, left, right, raw, probs, bounds):
    """_attention on parts of the units (bounds) in parallel, part p on its own score matrices."""
    size = seq * keys
    for p in prange(bounds.size - 1):
        _attention(q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, past, y, qk_out, qk_mode, q_offs,
                   k_offs, v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                   v_head_size, scale, softcap, causal, left, right, raw[p * size:(p + 1) * size],
                   probs[p * size:(p + 1) * size], bounds[p], bounds[p + 1])


@njit(cache=True, error_model="numpy")
def _attention_grad_units(dy, q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, dq, dk, dv, q_offs, k_offs,
                          v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                          v_head_size, scale, softcap, causal, left, right, raw, probs, dprobs, want_q, want_k, want_v,
                          no_scores, first, last):
    """dQ, and dK, dV added into, of the units [first, last) (see _attention), recomputing the scores per head;
    `no_scores` is an empty array (the scores are not written out)."""
    group = q_heads // kv_heads
    for kh in range(first, last):
        b = kh // kv_heads
        for h in range((kh % kv_heads) * group, (kh % kv_heads + 1) * group):
            qo, yo = q_offs[b * q_heads + h], y_offs[b * q_heads + h]
            _scores(q, k, mask, mask_kind, mask_strides, mask_width, nonpad, 0, qo, k_offs[kh], q_ld, k_ld, b, h,
                    seq, keys, head_size, scale, softcap, causal, left, right, raw, probs, no_scores, 0, 0)
            if want_v:
                gemm_blocks(1, 0, keys, v_head_size, seq, 1.0, probs, 0, keys, dy, yo, y_ld, 1.0, dv, v_offs[kh], v_ld)
            if not (want_q or want_k):
                continue
            gemm_blocks(0, 1, seq, keys, v_head_size, 1.0, dy, yo, y_ld, v, v_offs[kh], v_ld, 0.0, dprobs, 0, keys)
            for i in range(seq):
                row = i * keys
                _softmax_grad_row(dprobs[row:row + keys], probs[row:row + keys])
                if softcap > 0:
                    for j in range(keys):
                        capped = raw[row + j] / softcap
                        dprobs[row + j] *= 1 - capped * capped
            if want_q:
                gemm_blocks(0, 0, seq, head_size, keys, scale, dprobs, 0, keys, k, k_offs[kh], k_ld, 0.0, dq, qo, q_ld)
            if want_k:
                gemm_blocks(1, 0, keys, head_size, seq, scale, dprobs, 0, keys, q, qo, q_ld, 1.0, dk, k_offs[kh], k_ld)


@njit(cache=True, error_model="numpy")
def _zero(out):
    for i in range(out.size):
        out[i] = 0


@njit(cache=True, error_model="numpy")
def _attention_grad(dy, q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, dq, dk, dv, q_offs, k_offs,
                    v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                    v_head_size, scale, softcap, causal, left, right, raw, probs, dprobs, want_q, want_k, want_v,
                    no_scores):
    """dQ, dK, dV of the attention above (no key/value cache)."""
    _zero(dk)
    _zero(dv)
    _attention_grad_units(dy, q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, dq, dk, dv, q_offs, k_offs,
                          v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                          v_head_size, scale, softcap, causal, left, right, raw, probs, dprobs, want_q, want_k, want_v,
                          no_scores, 0, batch * kv_heads)


@twin_of(_attention_grad, because="each part runs on its own score and score-gradient matrices")
@njit(cache=True, error_model="numpy", parallel=True)
def _attention_grad_parts(dy, q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, dq, dk, dv, q_offs, k_offs,
                          v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys, head_size,
                          v_head_size, scale, softcap, causal, left, right, raw, probs, dprobs, want_q, want_k, want_v,
                          no_scores, bounds):
    """_attention_grad on parts of the units in parallel: a unit's dK and dV blocks are its part's alone, and
    its query heads add into them in the serial order."""
    _zero(dk)
    _zero(dv)
    size = seq * keys
    for p in prange(bounds.size - 1):
        _attention_grad_units(dy, q, k, v, mask, mask_kind, mask_strides, mask_width, nonpad, dq, dk, dv, q_offs,
                              k_offs, v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, batch, q_heads, kv_heads, seq, keys,
                              head_size, v_head_size, scale, softcap, causal, left, right,
                              raw[p * size:(p + 1) * size], probs[p * size:(p + 1) * size],
                              dprobs[p * size:(p + 1) * size], want_q, want_k, want_v, no_scores, bounds[p],
                              bounds[p + 1])


@njit(cache=True, error_model="numpy")
def _append_heads(past, new, present, offs, ld, batch, heads, past_len, new_len, head_size):
    """present [batch, heads, past_len + new_len, head] ← past, then the new rows (a 3-D or 4-D input)."""
    total = past_len + new_len
    for b in range(batch):
        for h in range(heads):
            base = (b * heads + h) * total * head_size
            for t in range(past_len):
                for d in range(head_size):
                    present[base + t * head_size + d] = past[((b * heads + h) * past_len + t) * head_size + d]
            source = offs[b * heads + h]
            for t in range(new_len):
                for d in range(head_size):
                    present[base + (past_len + t) * head_size + d] = new[source + t * ld + d]


class _AttentionLayout:
    """Shapes, per-(batch, head) offsets and row strides of Q, K, V and Y, 3-D or 4-D, GQA."""

    def __init__(self, q_shape, k_shape, v_shape, past_len=0, q_num_heads=0, kv_num_heads=0):
        if len(q_shape) == 4:
            self.batch, self.q_heads, self.seq, self.head_size = (int(d) for d in q_shape)
            self.kv_heads, self.new_keys = int(k_shape[1]), int(k_shape[2])
            self.v_head_size = int(v_shape[3])
        else:
            self.batch, self.seq = int(q_shape[0]), int(q_shape[1])
            self.q_heads, self.kv_heads = int(q_num_heads), int(kv_num_heads)
            self.head_size = int(q_shape[2]) // self.q_heads
            self.new_keys = int(k_shape[1])
            self.v_head_size = int(v_shape[2]) // self.kv_heads
        self.rank = len(q_shape)
        self.past = int(past_len)
        self.keys = self.past + self.new_keys

    def parts(self, threads: int) -> int:
        """Parallel parts of the (batch, kv head) units at `threads` threads (kernels/parallel_split.py)."""
        work = self.batch * self.q_heads * self.seq * self.keys * (self.head_size + self.v_head_size)
        return part_count(threads, self.batch * self.kv_heads, work)

    def heads(self, heads, length, width, rank=None):
        """(offset of each (batch, head) block, row stride) of a [batch, heads, length, width] tensor."""
        index = np.arange(self.batch * heads, dtype=np.int64)
        if (rank or self.rank) == 4:
            return index * length * width, width
        b, h = index // heads, index % heads
        return b * length * heads * width + h * width, heads * width


def _mask_layout(mask, layout):
    """(flat mask, kind, strides over [batch, q heads, seq, width], width) of the optional mask."""
    if mask is None:
        return np.zeros(1, np.float32), NO_MASK, np.zeros(4, np.int64), 0
    width = int(mask.shape[-1])
    full = (layout.batch, layout.q_heads, layout.seq, width)
    strides = np.array(element_strides(tuple(mask.shape), full), dtype=np.int64)
    kind = BOOLEAN_MASK if mask.dtype == np.bool_ else ADDITIVE_MASK
    return flat(mask), kind, strides, width


def _options(scale, softcap, is_causal, left_window_size, right_window_size, head_size):
    return (float(scale) if scale is not None else 1.0 / math.sqrt(head_size), float(softcap or 0.0),
            bool(is_causal), int(left_window_size), int(right_window_size))


def _forward_scratch(specs_in, specs_out, q_num_heads=0, kv_num_heads=0, threads=1, **attrs):
    past = specs_in[4] if len(specs_in) > 4 else None
    layout = _AttentionLayout(specs_in[0][0], specs_in[1][0], specs_in[2][0], past[0][2] if past else 0,
                              q_num_heads, kv_num_heads)
    floats = layout.parts(threads) * 2 * layout.seq * layout.keys
    if past is not None:
        for index, width in ((1, layout.head_size), (2, layout.v_head_size)):
            if len(specs_out) <= index or specs_out[index] is None:
                floats += layout.batch * layout.kv_heads * layout.keys * width
    return 4 * floats


def _grad_scratch(specs_in, specs_out, q_num_heads=0, kv_num_heads=0, threads=1, **attrs):
    layout = _AttentionLayout(specs_in[1][0], specs_in[2][0], specs_in[3][0], 0, q_num_heads, kv_num_heads)
    return 4 * layout.parts(threads) * 3 * layout.seq * layout.keys


@binding("Attention", scratch=_forward_scratch, parallel=True)
def Attention(inputs, outputs, scratch=None, scale=None, is_causal=0, q_num_heads=0, kv_num_heads=0, softcap=0.0,
              qk_matmul_output_mode=0, softmax_precision=None, left_window_size=-1, right_window_size=-1, threads=1):
    q, k, v = inputs[:3]
    mask, past_key, past_value, nonpad = (inputs[i] if len(inputs) > i else None for i in range(3, 7))
    layout = _AttentionLayout(q.shape, k.shape, v.shape, past_key.shape[2] if past_key is not None else 0,
                              q_num_heads, kv_num_heads)
    parts = layout.parts(threads)
    pieces = [parts * layout.seq * layout.keys, parts * layout.seq * layout.keys]
    present = [outputs[i] if len(outputs) > i else None for i in (1, 2)]
    if past_key is not None:
        pieces += [0 if present[0] is not None else layout.batch * layout.kv_heads * layout.keys * layout.head_size,
                   0 if present[1] is not None else layout.batch * layout.kv_heads * layout.keys * layout.v_head_size]
    raw, probs, *caches = float_buffers(scratch, *pieces)
    calls = []
    k_offs, k_ld = layout.heads(layout.kv_heads, layout.new_keys, layout.head_size)
    v_offs, v_ld = layout.heads(layout.kv_heads, layout.new_keys, layout.v_head_size)
    keys_values = []
    for index, (new, past, offs, ld, width) in enumerate(((k, past_key, k_offs, k_ld, layout.head_size),
                                                          (v, past_value, v_offs, v_ld, layout.v_head_size))):
        target = present[index]
        if past is None and target is not None:  # present = the new keys (values) as [batch, heads, len, head]
            calls.append((_append_heads, (np.zeros(0, new.dtype), flat(new), flat(target), offs, ld, layout.batch,
                                          layout.kv_heads, 0, layout.new_keys, width)))
        if past is None:
            keys_values.append((flat(new), offs, ld))
            continue
        target = flat(target) if target is not None else caches[index]
        calls.append((_append_heads, (flat(past), flat(new), target, offs, ld, layout.batch, layout.kv_heads,
                                      layout.past, layout.new_keys, width)))
        keys_values.append((target, *layout.heads(layout.kv_heads, layout.keys, width, rank=4)))
    (k_flat, k_offs, k_ld), (v_flat, v_offs, v_ld) = keys_values
    q_offs, q_ld = layout.heads(layout.q_heads, layout.seq, layout.head_size)
    y_offs, y_ld = layout.heads(layout.q_heads, layout.seq, layout.v_head_size)
    mask_flat, kind, mask_strides, width = _mask_layout(mask, layout)
    qk_out = outputs[3] if len(outputs) > 3 and outputs[3] is not None else None
    options = _options(scale, softcap, is_causal, left_window_size, right_window_size, layout.head_size)
    args = (flat(q), k_flat, v_flat, mask_flat, kind, mask_strides, width,
            flat(nonpad) if nonpad is not None else np.zeros(0, np.int64), layout.past, flat(outputs[0]),
            flat(qk_out) if qk_out is not None else np.zeros(0, np.float32), int(qk_matmul_output_mode), q_offs, k_offs,
            v_offs, y_offs, q_ld, k_ld, v_ld, y_ld, layout.batch, layout.q_heads, layout.kv_heads, layout.seq,
            layout.keys, layout.head_size, layout.v_head_size, *options, raw, probs)
    units = layout.batch * layout.kv_heads
    return calls + [on_parts((_attention, args + (0, units)), units, parts)]


@binding("AttentionGrad", ODTRAIN_DOMAIN, scratch=_grad_scratch, parallel=True)
def AttentionGrad(inputs, outputs, scratch=None, scale=None, is_causal=0, q_num_heads=0, kv_num_heads=0, softcap=0.0,
                  left_window_size=-1, right_window_size=-1, threads=1):
    """(dY, Q, K, V, attn_mask?, nonpad_kv_seqlen?) -> dQ, dK, dV (each optional)."""
    dy, q, k, v = inputs[:4]
    mask, nonpad = (inputs[i] if len(inputs) > i else None for i in (4, 5))
    layout = _AttentionLayout(q.shape, k.shape, v.shape, 0, q_num_heads, kv_num_heads)
    parts = layout.parts(threads)
    raw, probs, dprobs = float_buffers(scratch, *[parts * layout.seq * layout.keys] * 3)
    wanted = [outputs[i] if len(outputs) > i else None for i in range(3)]
    dq, dk, dv = (flat(o) if o is not None else np.zeros(0, np.float32) for o in wanted)
    q_offs, q_ld = layout.heads(layout.q_heads, layout.seq, layout.head_size)
    k_offs, k_ld = layout.heads(layout.kv_heads, layout.keys, layout.head_size)
    v_offs, v_ld = layout.heads(layout.kv_heads, layout.keys, layout.v_head_size)
    y_offs, y_ld = layout.heads(layout.q_heads, layout.seq, layout.v_head_size)
    mask_flat, kind, mask_strides, width = _mask_layout(mask, layout)
    options = _options(scale, softcap, is_causal, left_window_size, right_window_size, layout.head_size)
    args = (flat(dy), flat(q), flat(k), flat(v), mask_flat, kind, mask_strides, width,
            flat(nonpad) if nonpad is not None else np.zeros(0, np.int64), dq, dk, dv, q_offs, k_offs, v_offs, y_offs,
            q_ld, k_ld, v_ld, y_ld, layout.batch, layout.q_heads, layout.kv_heads, layout.seq, layout.keys,
            layout.head_size, layout.v_head_size, *options, raw, probs, dprobs, wanted[0] is not None,
            wanted[1] is not None, wanted[2] is not None, np.zeros(0, np.float32))
    return [on_parts((_attention_grad, args), layout.batch * layout.kv_heads, parts)]

