"""Layout and indexing kernels: Transpose (DepthToSpace, SpaceToDepth), Expand, Tile, Slice, Concat, Split, Gather*,
Scatter*, TensorScatter, Compress, OneHot, CenterCropPad, ReverseSequence, Cast, fills.

(Reshape, Flatten, Squeeze, Unsqueeze, BitCast and Identity are arena views; Shape, Constant, Range and
ConstantOfShape usually fold to constants before a step.)

Most ops here are one strided copy (kernels/copies.py's `copy_call`): a slice, a concatenation slot, a
broadcast or a tile is a stride pattern computed once when the graph is bound. Gathers check every index against the
axis length and raise ValueError (an InputError for the caller) instead of reading out of bounds.
With threads, a copy that writes each element once splits its rows into parallel parts (kernels/copies.py),
Gather its indices and its gradient (a scatter-add) its columns: every value as in one thread.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .copies import COPY_DIMS, copy_call
from .number_formats import convert_call, converts
from .layout import element_strides, flat
from .parallel_split import split, twin_of

SCATTER = {"none": 0, "add": 1, "mul": 2, "max": 3, "min": 4}


# ---- strided copies ---------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _fill(out, value):
    for i in range(out.size):
        out[i] = value


def fill_call(out, value=0):
    return (_fill, (flat(out), out.dtype.type(value)))


def _c_strides(shape):
    return element_strides(shape, shape)


@binding("Transpose", parallel=True)
def Transpose(inputs, outputs, perm=None, threads=1):
    x, out = inputs[0], outputs[0]
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    source_strides = element_strides(x.shape, x.shape)
    return [copy_call(x, 0, [source_strides[p] for p in perm], out, 0, element_strides(out.shape, out.shape),
                      out.shape, threads=threads)]


def _depth_space(inputs, outputs, blocksize, mode, to_space):
    """DepthToSpace and SpaceToDepth (modes DCR and CRD): a transpose of 6-D views of input and output."""
    x, out = inputs[0], outputs[0]
    b = int(blocksize)
    mode = mode.decode() if isinstance(mode, bytes) else mode
    n, c, h, w = x.shape
    if to_space:
        view, perm = ((n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)) if mode == "DCR" else \
            ((n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3))
    else:
        view = (n, c, h // b, b, w // b, b)
        perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    source = x.reshape(view)
    return Transpose([source], [out.reshape(tuple(view[p] for p in perm))], perm=perm)


binding("DepthToSpace")(lambda inputs, outputs, blocksize=0, mode="DCR": _depth_space(inputs, outputs, blocksize,
                                                                                        mode, True))
for _domain in ("", ODTRAIN_DOMAIN):  # odtrain's, DepthToSpace's gradient, has CRD in models of any opset
    binding("SpaceToDepth", _domain)(lambda inputs, outputs, blocksize=0, mode="DCR": _depth_space(
        inputs, outputs, blocksize, mode, False))


@binding("Expand", parallel=True)
def Expand(inputs, outputs, threads=1):
    x, out = inputs[0], outputs[0]
    return [copy_call(x, 0, element_strides(x.shape, out.shape), out, 0, _c_strides(out.shape), out.shape,
                      threads=threads)]


def _tile_layout(x_shape, repeats):
    """The output seen as [r0, d0, r1, d1, ...]: strides into x (0 along repeats) and into the output."""
    dims, sx, so = [], [], []
    x_strides, out_strides = _c_strides(x_shape), _c_strides(tuple(d * r for d, r in zip(x_shape, repeats)))
    for d, r, s, o in zip(x_shape, repeats, x_strides, out_strides):
        dims += [r, d]
        sx += [0, s]
        so += [o * d, o]
    return dims, sx, so


@binding("Tile", parallel=True)
def Tile(inputs, outputs, threads=1):
    x, out = inputs[0], outputs[0]
    dims, sx, so = _tile_layout(x.shape, [int(r) for r in inputs[1].reshape(-1)])
    return [copy_call(x, 0, sx, out, 0, so, dims, threads=threads)]


@binding("TileGrad", ODTRAIN_DOMAIN)
def TileGrad(inputs, outputs):
    dy, out = inputs[0], outputs[0]
    dims, sx, so = _tile_layout(out.shape, [int(r) for r in inputs[2].reshape(-1)])
    return [fill_call(out), copy_call(dy, 0, so, out, 0, sx, dims, accumulate=True)]


def _slice_layout(x_shape, starts, ends, axes, steps):
    """(start offset, element strides) of a Slice in x, as ONNX clamps it."""
    rank = len(x_shape)
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    strides = _c_strides(x_shape)
    offset, out_strides = 0, list(strides)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        first = slice(int(start), int(end), step).indices(x_shape[axis])[0]
        offset += first * strides[axis]
        out_strides[axis] = strides[axis] * step
    return offset, out_strides


def _slice_args(inputs, attrs):
    if "starts" in attrs:
        return attrs["starts"], attrs["ends"], attrs.get("axes"), None
    values = [None if i >= len(inputs) or inputs[i] is None else [int(v) for v in inputs[i].reshape(-1)]
              for i in range(1, 5)]
    return values


@binding("Slice", parallel=True)
def Slice(inputs, outputs, threads=1, **attrs):
    x, out = inputs[0], outputs[0]
    offset, strides = _slice_layout(x.shape, *_slice_args(inputs, attrs))
    return [copy_call(x, offset, strides, out, 0, _c_strides(out.shape), out.shape, threads=threads)]


@binding("SliceGrad", ODTRAIN_DOMAIN)
def SliceGrad(inputs, outputs, **attrs):
    dy, out = inputs[0], outputs[0]
    offset, strides = _slice_layout(out.shape, *_slice_args(inputs[1:], attrs))
    return [fill_call(out), copy_call(dy, 0, _c_strides(dy.shape), out, offset, strides, dy.shape)]


@binding("CenterCropPad")
def CenterCropPad(inputs, outputs, axes=None):
    """Zeros where the output is padded, then the centred overlap of input and output copied."""
    x, out = inputs[0], outputs[0]
    xs, os_ = _c_strides(x.shape), _c_strides(out.shape)
    x_start = sum(max(a - b, 0) // 2 * s for a, b, s in zip(x.shape, out.shape, xs))
    out_start = sum(max(b - a, 0) // 2 * s for a, b, s in zip(x.shape, out.shape, os_))
    overlap = tuple(min(a, b) for a, b in zip(x.shape, out.shape))
    fill = [fill_call(out)] if out.size > int(np.prod(overlap, dtype=np.int64)) else []
    return fill + [copy_call(x, x_start, xs, out, out_start, os_, overlap)]


def _axis_offsets(shapes, axis):
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += shape[axis]
    return offsets


@binding("Concat", parallel=True)
def Concat(inputs, outputs, axis=0, threads=1):
    out = outputs[0]
    axis = int(axis) % out.ndim
    present = [x for x in inputs if x is not None]
    strides = _c_strides(out.shape)
    return [copy_call(x, 0, _c_strides(x.shape), out, offset * strides[axis], strides, x.shape, threads=threads)
            for x, offset in zip(present, _axis_offsets([x.shape for x in present], axis)) if x.size]


@binding("ConcatGrad", ODTRAIN_DOMAIN, parallel=True)
def ConcatGrad(inputs, outputs, axis=0, index=0, threads=1):
    dy, out = inputs[0], outputs[0]
    axis = int(axis) % dy.ndim
    offset = _axis_offsets([x.shape for x in inputs[1:]], axis)[index]
    strides = _c_strides(dy.shape)
    return [copy_call(dy, offset * strides[axis], strides, out, 0, _c_strides(out.shape), out.shape,
                      threads=threads)]


@binding("Split", parallel=True)
def Split(inputs, outputs, axis=0, split=None, num_outputs=None, threads=1):
    x = inputs[0]
    axis = int(axis) % x.ndim
    strides = _c_strides(x.shape)
    if split is None and len(inputs) > 1 and inputs[1] is not None:
        split = [int(s) for s in inputs[1].reshape(-1)]
    if split is None:
        if any(o is None for o in outputs):
            chunk = -(-x.shape[axis] // len(outputs)) if num_outputs else x.shape[axis] // len(outputs)
            split = [min(chunk, max(x.shape[axis] - chunk * i, 0)) for i in range(len(outputs))]
        else:
            split = [o.shape[axis] for o in outputs]
    offsets = np.concatenate([[0], np.cumsum(split)[:-1]]).astype(int)
    return [copy_call(x, offset * strides[axis], strides, o, 0, _c_strides(o.shape), o.shape, threads=threads)
            for o, offset in zip(outputs, offsets) if o is not None and o.size]


# ---- gathers and scatters ---------------------------------------------------------------------


@njit(cache=True, inline="always")
def _axis_index(k, axis_len):
    """A gather index on an axis of axis_len (negative counts from the end), checked."""
    if k < 0:
        k += axis_len
    if k < 0 or k >= axis_len:
        raise ValueError("an index is outside the gathered axis")
    return k


@njit(cache=True, error_model="numpy")
def _gather(x, indices, out, outer, axis_len, inner, j0, j1):
    """out[o, j, :] = x[o, indices[j], :] for the indices j in [j0, j1) (x may be read-only)."""
    count = indices.size
    for o in range(outer):
        for j in range(j0, j1):
            k = _axis_index(indices[j], axis_len)
            src = (o * axis_len + k) * inner
            dst = (o * count + j) * inner
            for i in range(inner):
                out[dst + i] = x[src + i]


@njit(cache=True, error_model="numpy")
def _scatter_add(dy, indices, dx, outer, axis_len, inner, c0, c1):
    """dx = 0; dx[o, indices[j], c] += dy[o, j, c] for the columns c in [c0, c1) (Gather's gradient: repeated
    indices add up, in index order)."""
    count = indices.size
    for row in range(outer * axis_len):
        for i in range(row * inner + c0, row * inner + c1):
            dx[i] = 0
    for o in range(outer):
        for j in range(count):
            k = _axis_index(indices[j], axis_len)
            src = (o * count + j) * inner
            dst = (o * axis_len + k) * inner
            for i in range(c0, c1):
                dx[dst + i] += dy[src + i]


@njit(cache=True, error_model="numpy")
def _check_indices(indices, axis_len):
    """Raise ValueError for an index outside the axis: before a parallel region, which cannot raise."""
    for j in range(indices.size):
        _axis_index(indices[j], axis_len)


@twin_of(_gather, range=("j0", "j1"), because="every index is checked once, before the parts run")
@njit(cache=True, error_model="numpy", parallel=True)
def _gather_parts(x, indices, out, outer, axis_len, inner, bounds):
    """_gather on parts of the indices (bounds), in parallel."""
    _check_indices(indices, axis_len)
    for p in prange(bounds.size - 1):
        _gather(x, indices, out, outer, axis_len, inner, bounds[p], bounds[p + 1])


@twin_of(_scatter_add, range=("c0", "c1"), because="every index is checked once, before the parts run")
@njit(cache=True, error_model="numpy", parallel=True)
def _scatter_add_parts(dy, indices, dx, outer, axis_len, inner, bounds):
    """_scatter_add on parts of the columns (bounds), in parallel: each element adds up as in one thread."""
    _check_indices(indices, axis_len)
    for p in prange(bounds.size - 1):
        _scatter_add(dy, indices, dx, outer, axis_len, inner, bounds[p], bounds[p + 1])


def _outer_inner(shape, axis):
    return int(np.prod(shape[:axis], dtype=np.int64)), int(shape[axis]), int(np.prod(shape[axis + 1:], dtype=np.int64))


@binding("Gather", parallel=True)
def Gather(inputs, outputs, axis=0, threads=1):
    x, indices, out = inputs[0], inputs[1], outputs[0]
    outer, axis_len, inner = _outer_inner(x.shape, int(axis) % x.ndim)
    args = (flat(x), flat(indices), flat(out), outer, axis_len, inner)
    return [split((_gather, args + (0, indices.size)), indices.size, out.size, threads)]


@binding("GatherGrad", ODTRAIN_DOMAIN, parallel=True)
def GatherGrad(inputs, outputs, axis=0, threads=1):
    dy, indices, out = inputs[0], inputs[1], outputs[0]
    outer, axis_len, inner = _outer_inner(out.shape, int(axis) % out.ndim)
    args = (flat(dy), flat(indices), flat(out), outer, axis_len, inner)
    return [split((_scatter_add, args + (0, inner)), inner, out.size + dy.size, threads)]


def _compressed(x: np.ndarray, condition: np.ndarray, axis):
    """(x, or x flattened without an axis; the axis; the positions kept): Compress as a Gather."""
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = int(axis) % x.ndim
    return x, axis, np.flatnonzero(condition.reshape(-1)[:x.shape[axis]]).astype(np.int64)


@binding("Compress")
def Compress(inputs, outputs, axis=None):
    x, axis, kept = _compressed(inputs[0], inputs[1], axis)
    return Gather([x, kept], outputs, axis=axis)


@binding("CompressGrad", ODTRAIN_DOMAIN)
def CompressGrad(inputs, outputs, axis=None):
    dx, axis, kept = _compressed(outputs[0], inputs[1], axis)
    return GatherGrad([inputs[0], kept], [dx], axis=axis)  # zeros where nothing was kept


@njit(cache=True, inline="always")
def _element_offset(k, position, index_axis, axis_len, data_strides):
    if k < 0:
        k += axis_len
    if k < 0 or k >= axis_len:
        raise ValueError("an index is outside the indexed axis")
    at = 0
    for a in range(6):
        at += (k if a == index_axis else position[a]) * data_strides[a]
    return at


@njit(cache=True, error_model="numpy")
def _gather_elements(data, data_strides, indices, values, dims, index_axis, axis_len):
    """values[p] = data at position p with axis `index_axis` replaced by indices[p] (p over dims, C order)."""
    p = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                for i3 in range(dims[3]):
                    for i4 in range(dims[4]):
                        for i5 in range(dims[5]):
                            at = _element_offset(indices[p], (i0, i1, i2, i3, i4, i5), index_axis, axis_len,
                                                 data_strides)
                            values[p] = data[at]
                            p += 1


@njit(cache=True, error_model="numpy")
def _scatter_elements(data, data_strides, indices, values, dims, index_axis, axis_len, mode):
    """data at position p with axis `index_axis` replaced by indices[p] (=, +=, *=, max, min: mode 0..4) values[p];
    mode 5 first zeroes data and adds (GatherElements' gradient)."""
    if mode == 5:
        for i in range(data.size):
            data[i] = 0
    p = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                for i3 in range(dims[3]):
                    for i4 in range(dims[4]):
                        for i5 in range(dims[5]):
                            at = _element_offset(indices[p], (i0, i1, i2, i3, i4, i5), index_axis, axis_len,
                                                 data_strides)
                            if mode == 0:
                                data[at] = values[p]
                            elif mode == 1 or mode == 5:
                                data[at] += values[p]
                            elif mode == 2:
                                data[at] *= values[p]
                            elif mode == 3:
                                data[at] = max(data[at], values[p])
                            else:
                                data[at] = min(data[at], values[p])
                            p += 1


def _elements_args(data_shape, indices_shape, axis):
    rank = len(data_shape)
    if rank > COPY_DIMS:
        raise ValueError(f"rank {rank} exceeds {COPY_DIMS}")
    pad = COPY_DIMS - rank
    dims = np.array((1,) * pad + tuple(indices_shape), np.int64)
    strides = np.array((0,) * pad + tuple(_c_strides(data_shape)), np.int64)
    return strides, dims, pad + int(axis) % rank, int(data_shape[int(axis) % rank])


@binding("GatherElements")
def GatherElements(inputs, outputs, axis=0):
    data, indices, out = inputs[0], inputs[1], outputs[0]
    strides, dims, index_axis, axis_len = _elements_args(data.shape, indices.shape, axis)
    return [(_gather_elements, (flat(data), strides, flat(indices), flat(out), dims, index_axis, axis_len))]


@binding("GatherElementsGrad", ODTRAIN_DOMAIN)
def GatherElementsGrad(inputs, outputs, axis=0):
    dy, indices, out = inputs[0], inputs[1], outputs[0]
    strides, dims, index_axis, axis_len = _elements_args(out.shape, indices.shape, axis)
    return [(_scatter_elements, (flat(out), strides, flat(indices), flat(dy), dims, index_axis, axis_len, 5))]


@binding("Scatter")  # ScatterElements' name in opsets 9 and 10
@binding("ScatterElements")
def ScatterElements(inputs, outputs, axis=0, reduction="none"):
    data, indices, updates, out = inputs[0], inputs[1], inputs[2], outputs[0]
    strides, dims, index_axis, axis_len = _elements_args(data.shape, indices.shape, axis)
    calls = [] if np.shares_memory(data, out) else [copy_call(data, 0, [1], out, 0, [1], [data.size])]
    return calls + [(_scatter_elements, (flat(out), strides, flat(indices), flat(updates), dims, index_axis, axis_len,
                                         SCATTER[reduction]))]


@njit(cache=True, inline="always")
def _nd_offset(indices, t, depth, data_dims, data_strides):
    at = 0
    for q in range(depth):
        k = indices[t * depth + q]
        if k < 0:
            k += data_dims[q]
        if k < 0 or k >= data_dims[q]:
            raise ValueError("an index is outside the indexed axis")
        at += k * data_strides[q]
    return at


@njit(cache=True, error_model="numpy")
def _gather_nd(data, data_dims, data_strides, indices, tuples, depth, values, slice_size):
    """values[t] = the data slice named by index tuple t (indices viewed as [tuples, depth])."""
    for t in range(tuples):
        at = _nd_offset(indices, t, depth, data_dims, data_strides)
        for i in range(slice_size):
            values[t * slice_size + i] = data[at + i]


@njit(cache=True, error_model="numpy")
def _scatter_nd(data, data_dims, data_strides, indices, tuples, depth, values, slice_size, mode):
    """The data slice named by index tuple t (=, +=, *=, max, min: mode 0..4) values[t]."""
    for t in range(tuples):
        at = _nd_offset(indices, t, depth, data_dims, data_strides)
        base = t * slice_size
        for i in range(slice_size):
            if mode == 0:
                data[at + i] = values[base + i]
            elif mode == 1:
                data[at + i] += values[base + i]
            elif mode == 2:
                data[at + i] *= values[base + i]
            elif mode == 3:
                data[at + i] = max(data[at + i], values[base + i])
            else:
                data[at + i] = min(data[at + i], values[base + i])


def _nd_args(data_shape, indices_shape):
    depth = int(indices_shape[-1])
    tuples = int(np.prod(indices_shape[:-1], dtype=np.int64))
    slice_size = int(np.prod(data_shape[depth:], dtype=np.int64))
    return (np.array(data_shape, np.int64), np.array(_c_strides(data_shape), np.int64), tuples, depth, slice_size)


@binding("GatherND")
def GatherND(inputs, outputs, batch_dims=0):
    data, indices, out = inputs[0], inputs[1], outputs[0]
    dims, strides, tuples, depth, slice_size = _nd_args(data.shape, indices.shape)
    return [(_gather_nd, (flat(data), dims, strides, flat(indices), tuples, depth, flat(out), slice_size))]


@binding("ScatterND")
def ScatterND(inputs, outputs, reduction="none"):
    data, indices, updates, out = inputs[0], inputs[1], inputs[2], outputs[0]
    dims, strides, tuples, depth, slice_size = _nd_args(data.shape, indices.shape)
    calls = [] if np.shares_memory(data, out) else [copy_call(data, 0, [1], out, 0, [1], [data.size])]
    return calls + [(_scatter_nd, (flat(out), dims, strides, flat(indices), tuples, depth, flat(updates), slice_size,
                                   SCATTER[reduction]))]


@njit(cache=True, error_model="numpy")
def _reverse_sequence(x, lengths, out, steps, batch, time_stride, batch_stride, inner):
    """out[t, b] = x[lengths[b] - 1 - t, b] for t < lengths[b], else x[t, b]; each [t, b] a run of `inner`."""
    for b in range(batch):
        length = min(max(np.int64(lengths[b]), 0), steps)
        for t in range(steps):
            source = length - 1 - t if t < length else t
            src = source * time_stride + b * batch_stride
            dst = t * time_stride + b * batch_stride
            for i in range(inner):
                out[dst + i] = x[src + i]


@binding("ReverseSequence")
def ReverseSequence(inputs, outputs, time_axis=0, batch_axis=1):
    x, lengths = inputs
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    strides = (x.shape[1] * inner, inner)  # of axes 0 and 1
    time_stride, batch_stride = strides if int(time_axis) == 0 else strides[::-1]
    return [(_reverse_sequence, (flat(x), flat(lengths), flat(outputs[0]), int(x.shape[int(time_axis)]),
                                 int(x.shape[int(batch_axis)]), time_stride, batch_stride, inner))]


@njit(cache=True, error_model="numpy")
def _tensor_scatter(cache, update, indices, out, outer, per_batch, length, steps, inner, circular, backward):
    """Forward: out = cache, then update's rows [outer, steps, inner] written into out's [outer, length, inner] from
    row indices[outer // per_batch] (modulo length if circular). Backward (cache is dY, update is dUpdate,
    out is dCache): dCache = dY with those rows zeroed, dUpdate = dY's rows there."""
    for i in range(out.size):
        out[i] = cache[i]
    for o in range(outer):
        start = indices[o // per_batch] if indices.size else 0
        for s in range(steps):
            row = start + s
            if circular:
                row %= length
            target = (o * length + row) * inner
            source = (o * steps + s) * inner
            for i in range(inner):
                if backward:
                    update[source + i] = cache[target + i]
                    out[target + i] = 0
                else:
                    out[target + i] = update[source + i]


def _tensor_scatter_layout(cache_shape, update_shape, axis):
    axis = int(axis) % len(cache_shape)
    outer = int(np.prod(cache_shape[:axis], dtype=np.int64))
    return (outer, outer // int(cache_shape[0]), int(cache_shape[axis]), int(update_shape[axis]),
            int(np.prod(cache_shape[axis + 1:], dtype=np.int64)))


def _write_indices(inputs) -> np.ndarray:
    return flat(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros(0, np.int64)


@binding("TensorScatter")
def TensorScatter(inputs, outputs, axis=-2, mode="linear"):
    cache, update, out = inputs[0], inputs[1], outputs[0]
    layout = _tensor_scatter_layout(cache.shape, update.shape, axis)
    return [(_tensor_scatter, (flat(cache), flat(update), _write_indices(inputs), flat(out)) + layout
             + (mode == "circular", False))]


@binding("TensorScatterGrad", ODTRAIN_DOMAIN)
def TensorScatterGrad(inputs, outputs, axis=-2, mode="linear"):
    dy, update = inputs[0], inputs[1]
    d_cache, d_update = outputs
    layout = _tensor_scatter_layout(dy.shape, update.shape, axis)
    return [(_tensor_scatter, (flat(dy), flat(d_update), _write_indices(inputs), flat(d_cache)) + layout
             + (mode == "circular", True))]


@njit(cache=True, error_model="numpy")
def _one_hot(indices, values, out, outer, depth, inner):
    """out [outer, depth, inner] = values[1] where the index at (outer, inner) (negative: from the end) is the
    position along depth, values[0] elsewhere."""
    for o in range(outer):
        for i in range(inner):
            at = np.int64(indices[o * inner + i])
            if at < 0:
                at += depth
            for d in range(depth):
                out[(o * depth + d) * inner + i] = values[1] if d == at else values[0]


@binding("OneHot")
def OneHot(inputs, outputs, axis=-1):
    indices, _, values = inputs
    out = outputs[0]
    axis = int(axis) % out.ndim
    outer = int(np.prod(out.shape[:axis], dtype=np.int64))
    return [(_one_hot, (flat(indices), flat(values), flat(out), outer, int(out.shape[axis]),
                        int(np.prod(out.shape[axis + 1:], dtype=np.int64))))]


# ---- Cast and fills ---------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _cast(x, out):
    for i in range(out.size):
        out[i] = x[i]


@njit(cache=True, error_model="numpy")
def _to_bool(x, out):
    for i in range(out.size):
        out[i] = x[i] != 0


@binding("Cast")
def Cast(inputs, outputs, to=None, saturate=1, round_mode="up"):
    x, out = inputs[0], outputs[0]
    if converts(x.dtype) or converts(out.dtype):
        return [convert_call(x, out, saturate)]
    if out.dtype == np.bool_ and x.dtype != np.bool_:
        return [(_to_bool, (flat(x), flat(out)))]
    return [(_cast, (flat(x), flat(out)))]


binding("CastLike")(lambda inputs, outputs, saturate=1, round_mode="up": Cast(inputs[:1], outputs, saturate=saturate))


@njit(cache=True, error_model="numpy")
def _trilu(x, out, matrices, rows, cols, k, upper):
    """out = x where (j - i >= k if upper else j - i <= k) in each [rows, cols] matrix, else 0."""
    for m in range(matrices):
        for i in range(rows):
            base = (m * rows + i) * cols
            for j in range(cols):
                keep = j - i >= k if upper else j - i <= k
                out[base + j] = x[base + j] if keep else x[base + j] * 0


@binding("Trilu")
def Trilu(inputs, outputs, upper=1):
    x, out = inputs[0], outputs[0]
    k = int(inputs[1].reshape(())) if len(inputs) > 1 and inputs[1] is not None else 0
    rows, cols = x.shape[-2], x.shape[-1]
    return [(_trilu, (flat(x), flat(out), int(x.size // max(rows * cols, 1)), int(rows), int(cols), k, bool(upper)))]


@binding("ConstantOfShape")
def ConstantOfShape(inputs, outputs, value=None):
    fill = 0 if value is None else np.asarray(value).reshape(-1)[0]
    return [fill_call(outputs[0], fill)]


@njit(cache=True, error_model="numpy")
def _range(start, delta, out):
    for i in range(out.size):
        out[i] = start[0] + i * delta[0]


@binding("Range")
def Range(inputs, outputs):
    return [(_range, (flat(inputs[0]), flat(inputs[2]), flat(outputs[0])))]
