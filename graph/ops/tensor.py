"""Shape, layout and indexing ops: Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Tile, Slice,
Concat, Split, Gather, GatherElements, GatherND, ScatterElements, ScatterND, Where, Cast, CastLike,
Trilu, Shape, Size, Constant, ConstantOfShape, Range, BitCast, EyeLike, OneHot, DepthToSpace, SpaceToDepth,
CenterCropPad, Compress, ReverseSequence, TensorScatter, Unique, NonZero, NonMaxSuppression.

Cast and CastLike alone also take and give the element types numpy lacks (bfloat16, float8, float4,
int4, int2: STORAGE_OPS), which a model converts to a computing type before any other op.

Reshape, Flatten, Squeeze, Unsqueeze and BitCast are views: their output shares the input's bytes.
Every op here folds to a constant when all of its inputs are constants, so the shape
subgraphs that exporters emit (Shape → Gather → Unsqueeze → Concat → Reshape) cost nothing
per step once input shapes are bound. Inputs that give shapes, axes, starts or repeats must
be such constants.

Gradients are copies back into place: Gather's is a scatter-add (`GatherGrad`, exact for
repeated indices), Slice's writes dY into a zeroed input (`SliceGrad`), Concat's slices dY
(`ConcatGrad`), Split's concatenates, Tile's and Expand's sum the copies.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from ..onnx_wire import element_type, is_storage_dtype, numpy_dtype
from .registry import broadcast_shapes, grad, no_grad, op

# Why an op of this family never reaches a kernel (its registration's `no_kernel`).
VIEW = "a view: its output shares its input's bytes"
SHAPE_CONSTANT = "its output follows from the input's shape: a constant once shapes bind"
FOLDED = "its input must be a constant: it runs when shapes bind, and folds"


def _static_size(dims) -> int | None:
    return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None


def _all_known(node, consts) -> bool:
    return all(consts[i] is not None for i, name in enumerate(node.inputs) if name)


def _folded(values):
    values = [np.asarray(v, order="C") for v in values]
    return [TensorType(v.dtype, tuple(v.shape)) for v in values], values


def _ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _const_input(node, consts, index: int, what: str):
    """The value of input `index`, which must be a constant when shapes are bound."""
    if index >= len(node.inputs) or not node.inputs[index]:
        return None
    if consts[index] is None:
        raise ModelError(f"{node.describe()}: its {what} input '{node.inputs[index]}' must be a constant "
                         "(an initializer, or computed from shapes); odtrain plans memory for static shapes")
    return consts[index]


def _int_input(node, consts, index: int, what: str) -> list[int] | None:
    """An optional constant input of ints, as a list (None when omitted)."""
    value = _const_input(node, consts, index, what)
    return None if value is None else _ints(value)


def _attr_or_input(node, consts, attr: str, index: int, what: str):
    """A list of ints given as an attribute (older opsets) or as a constant input (newer ones)."""
    if attr in node.attrs:
        return [int(v) for v in node.attrs[attr]]
    return _int_input(node, consts, index, what)


def dtype_of(ctx, name: str):
    """The element type of a forward value, when shape inference knew it."""
    return ctx.dtype(name)


# ---- Reshape, Flatten, Squeeze, Unsqueeze: views ----------------------------------------------


def reshape_target(node, in_shape: tuple, target) -> tuple:
    """ONNX Reshape's output shape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    target = [int(d) for d in np.asarray(target).reshape(-1)]
    allowzero = node.attrs.get("allowzero", 0)
    out = [in_shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if out.count(-1) > 1:
        raise ModelError(f"{node.describe()}: more than one -1 in the target shape {target}")
    if -1 in out:
        known = _static_size([d for d in out if d != -1])
        total = _static_size(in_shape)
        if known is None or total is None:
            out[out.index(-1)] = f"{node.name or 'reshape'}_dim"
        else:
            if known == 0 or total % known:
                raise ModelError(f"{node.describe()}: cannot reshape {in_shape} into {target}")
            out[out.index(-1)] = total // known
    total, new_total = _static_size(in_shape), _static_size(out)
    if total is not None and new_total is not None and total != new_total:
        raise ModelError(f"{node.describe()}: cannot reshape {in_shape} ({total} elements) into {tuple(out)}")
    return tuple(out)


@op("Reshape", view=True, constant_inputs=(1,), no_kernel=VIEW)
def _reshape_rule(node, types, consts):
    x = types[0]
    if consts[1] is None:
        if types[1].shape is not None and all(isinstance(d, int) for d in types[1].shape):
            return [TensorType(x.dtype, tuple(f"{node.name}_{i}" for i in range(types[1].shape[0])))]
        return [TensorType(x.dtype, None)]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    shape = reshape_target(node, x.shape, consts[1])
    if consts[0] is not None:
        return _folded([consts[0].reshape(shape)])
    return [TensorType(x.dtype, shape)]


def _reshape_back(ctx):  # dX = reshape(dY, shape(X))
    ctx.set_grad(0, ctx.emit("Reshape", [ctx.GO(0), ctx.emit("Shape", [ctx.I(0)])]))


grad("Reshape")(_reshape_back)


@op("Flatten", view=True, no_kernel=VIEW)
def _flatten_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    axis = int(node.attrs.get("axis", 1))
    axis = axis + len(x.shape) if axis < 0 else axis
    outer, inner = _static_size(x.shape[:axis]), _static_size(x.shape[axis:])
    shape = (outer if outer is not None else f"{node.name}_outer", inner if inner is not None else f"{node.name}_inner")
    if consts[0] is not None:
        return _folded([consts[0].reshape(shape)])
    return [TensorType(x.dtype, shape)]


grad("Flatten")(_reshape_back)


def squeeze_shape(node, shape: tuple, axes) -> tuple:
    rank = len(shape)
    if axes is None:
        if not all(isinstance(d, int) for d in shape):
            raise ModelError(f"{node.describe()}: Squeeze without axes needs a static input shape, got {shape}")
        return tuple(d for d in shape if d != 1)
    axes = {a % rank for a in axes}
    for a in axes:
        if isinstance(shape[a], int) and shape[a] != 1:
            raise ModelError(f"{node.describe()}: cannot squeeze axis {a} of size {shape[a]}")
    return tuple(d for i, d in enumerate(shape) if i not in axes)


@op("Squeeze", view=True, constant_inputs=(1,), no_kernel=VIEW)
def _squeeze_rule(node, types, consts):
    x = types[0]
    axes = _attr_or_input(node, consts, "axes", 1, "axes")
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    shape = squeeze_shape(node, x.shape, axes)
    if consts[0] is not None:
        return _folded([consts[0].reshape(shape)])
    return [TensorType(x.dtype, shape)]


def unsqueeze_shape(node, shape: tuple, axes) -> tuple:
    if axes is None:
        raise ModelError(f"{node.describe()}: Unsqueeze needs axes")
    rank = len(shape) + len(axes)
    axes = sorted(a % rank for a in axes)
    if len(set(axes)) != len(axes):
        raise ModelError(f"{node.describe()}: repeated axes {axes}")
    dims = iter(shape)
    return tuple(1 if i in axes else next(dims) for i in range(rank))


@op("Unsqueeze", view=True, constant_inputs=(1,), no_kernel=VIEW)
def _unsqueeze_rule(node, types, consts):
    x = types[0]
    axes = _attr_or_input(node, consts, "axes", 1, "axes")
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    shape = unsqueeze_shape(node, x.shape, axes)
    if consts[0] is not None:
        return _folded([consts[0].reshape(shape)])
    return [TensorType(x.dtype, shape)]


grad("Squeeze")(_reshape_back)
grad("Unsqueeze")(_reshape_back)


# ---- Transpose, Expand, Tile ------------------------------------------------------------------


@op("Transpose")
def _transpose_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    perm = node.attrs.get("perm", list(range(len(x.shape)))[::-1])
    if consts[0] is not None:
        return _folded([np.transpose(consts[0], perm)])
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@grad("Transpose")
def _transpose_grad(ctx):  # dX = transpose(dY, inverse(perm))
    rank = ctx.rank(ctx.I(0))
    perm = ctx.attr("perm", list(range(rank))[::-1])
    ctx.set_grad(0, ctx.emit("Transpose", [ctx.GO(0)], {"perm": [int(p) for p in np.argsort(perm)]}))


@op("Expand", shape_only=(1,), constant_inputs=(1,))
def _expand_rule(node, types, consts):
    x = types[0]
    target = tuple(_ints(_const_input(node, consts, 1, "shape")))
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    try:
        shape = broadcast_shapes(x.shape, target)
    except ValueError as error:
        raise ModelError(f"{node.describe()}: cannot expand {x} to {list(target)} ({error})") from None
    if consts[0] is not None:
        return _folded([np.broadcast_to(consts[0], shape)])
    return [TensorType(x.dtype, shape)]


@grad("Expand")
def _expand_grad(ctx):  # dX = dY summed over the broadcast axes
    ctx.set_grad(0, ctx.sum_to_input(ctx.GO(0), 0))


@op("Tile", shape_only=(1,), constant_inputs=(1,))
def _tile_rule(node, types, consts):
    x = types[0]
    repeats = _ints(_const_input(node, consts, 1, "repeats"))
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    if len(repeats) != len(x.shape) or any(r < 0 for r in repeats):
        raise ModelError(f"{node.describe()}: repeats {repeats} do not match the rank of {x}")
    if consts[0] is not None:
        return _folded([np.tile(consts[0], repeats)])
    return [TensorType(x.dtype, tuple(d * r if isinstance(d, int) else (d if r == 1 else f"{node.name}_{i}")
                                      for i, (d, r) in enumerate(zip(x.shape, repeats))))]


@grad("Tile")
def _tile_grad(ctx):  # dX = Σ over the copies of dY
    ctx.set_grad(0, ctx.odtrain("TileGrad", [ctx.GO(0), ctx.I(0), ctx.I(1)]))


@op("TileGrad", ODTRAIN_DOMAIN, shape_only=(1, 2))
def _tile_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]


# ---- Slice, Concat, Split ---------------------------------------------------------------------


def slice_ranges(node, shape: tuple, consts) -> list[tuple[int, int, int]]:
    """Per axis of `shape` (static), the Python range (start, stop, step) that Slice keeps."""
    if "starts" in node.attrs:  # opset 1: attributes
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes"), None
    else:
        starts = _ints(_const_input(node, consts, 1, "starts"))
        ends = _ints(_const_input(node, consts, 2, "ends"))
        axes = _int_input(node, consts, 3, "axes")
        steps = _int_input(node, consts, 4, "steps")
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [a % rank for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if not (len(starts) == len(ends) == len(axes) == len(steps)):
        raise ModelError(f"{node.describe()}: starts, ends, axes and steps differ in length")
    ranges = [(0, d, 1) for d in shape]
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if step == 0:
            raise ModelError(f"{node.describe()}: a step of 0")
        ranges[axis] = slice(start, end, step).indices(shape[axis])
    return ranges


def _slice_shape(ranges) -> tuple:
    return tuple(len(range(*r)) for r in ranges)


@op("Slice", shape_only=(1, 2, 3, 4), constant_inputs=(1, 2, 3, 4))
def _slice_rule(node, types, consts):
    x = types[0]
    if x.shape is None or not x.is_static:
        return [TensorType(x.dtype, None)]
    ranges = slice_ranges(node, x.shape, consts)
    if consts[0] is not None:
        # a range's stop of -1 (a reversed slice down to index 0) means the last index to numpy: None
        return _folded([consts[0][tuple(slice(start, None if stop < 0 else stop, step) for start, stop, step in ranges)]])
    return [TensorType(x.dtype, _slice_shape(ranges))]


@grad("Slice")
def _slice_grad(ctx):  # dX = zeros with dY written where the slice came from
    inputs = [ctx.GO(0)] + [ctx.I(i) for i in range(len(ctx.node.inputs))]
    ctx.set_grad(0, ctx.odtrain("SliceGrad", inputs, {k: v for k, v in ctx.node.attrs.items()}))


@op("SliceGrad", ODTRAIN_DOMAIN, shape_only=(1, 2, 3, 4, 5))
def _slice_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]


def _axis(node, rank: int, default: int = 0) -> int:
    axis = int(node.attrs.get("axis", default))
    if not -rank <= axis < max(rank, 1):
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


@op("Concat")
def _concat_rule(node, types, consts):
    present = [t for name, t in zip(node.inputs, types) if name]
    if any(t.shape is None for t in present):
        return [TensorType(present[0].dtype, None)]
    rank = len(present[0].shape)
    axis = _axis(node, rank)
    if _all_known(node, consts):
        return _folded([np.concatenate([c for c in consts if c is not None], axis=axis)])
    total = 0
    for t in present:
        if len(t.shape) != rank:
            raise ModelError(f"{node.describe()}: inputs of different ranks {[str(t) for t in present]}")
        d = t.shape[axis]
        total = total + d if isinstance(total, int) and isinstance(d, int) else f"{node.name}_concat"
    shape = list(present[0].shape)
    shape[axis] = total
    return [TensorType(present[0].dtype, tuple(shape))]


@grad("Concat")
def _concat_grad(ctx):  # dX_i = dY[..., offset_i : offset_i + n_i, ...]
    for i in range(len(ctx.node.inputs)):
        if ctx.needs(i):
            inputs = [ctx.GO(0)] + list(ctx.node.inputs)
            ctx.set_grad(i, ctx.odtrain("ConcatGrad", inputs, {"axis": ctx.attr("axis"), "index": i}))


# Inputs 1.. of ConcatGrad are the forward inputs, read for their shapes only.
@op("ConcatGrad", ODTRAIN_DOMAIN, shape_only=range(1, 1024))
def _concat_grad_rule(node, types, consts):
    return [types[1 + node.attrs["index"]]]


def split_sizes(node, dim: int, consts, outputs: int) -> list[int]:
    sizes = _attr_or_input(node, consts, "split", 1, "split")
    if sizes is None:
        parts = int(node.attrs.get("num_outputs", outputs))
        if "num_outputs" in node.attrs:  # opset 18: the last part may be smaller
            chunk = -(-dim // parts)
            sizes = [min(chunk, max(dim - chunk * i, 0)) for i in range(parts)]
        else:
            if dim % parts:
                raise ModelError(f"{node.describe()}: axis of size {dim} does not split into {parts} equal parts")
            sizes = [dim // parts] * parts
    if sum(sizes) != dim or len(sizes) != outputs:
        raise ModelError(f"{node.describe()}: split sizes {sizes} do not fit an axis of {dim} into {outputs} outputs")
    return sizes


@op("Split", shape_only=(1,), constant_inputs=(1,))
def _split_rule(node, types, consts):
    x = types[0]
    if x.shape is None or not isinstance(x.shape[_axis(node, len(x.shape))], int):
        return [TensorType(x.dtype, None)] * len(node.outputs)
    axis = _axis(node, len(x.shape))
    sizes = split_sizes(node, x.shape[axis], consts, len(node.outputs))
    if consts[0] is not None:
        return _folded(np.split(consts[0], np.cumsum(sizes)[:-1], axis=axis))
    return [TensorType(x.dtype, x.shape[:axis] + (s,) + x.shape[axis + 1:]) for s in sizes]


@grad("Split")
def _split_grad(ctx):  # dX = concat(dY_i), zeros for outputs without a gradient
    parts = []
    for i, out in enumerate(ctx.node.outputs):
        g = ctx.GO(i)
        if not g:
            g = ctx.emit("ConstantOfShape", [ctx.emit("Shape", [out])])
        parts.append(g)
    ctx.set_grad(0, ctx.emit("Concat", parts, {"axis": ctx.attr("axis", 0)}))


# ---- Gather and scatter -----------------------------------------------------------------------


def _normalised_indices(node, indices: np.ndarray, dim: int) -> np.ndarray:
    indices = np.asarray(indices, dtype=np.int64)
    if ((indices < -dim) | (indices >= dim)).any():
        raise ModelError(f"{node.describe()}: an index is outside [-{dim}, {dim})")
    return np.where(indices < 0, indices + dim, indices)


@op("Gather")
def _gather_rule(node, types, consts):
    data, indices = types[0], types[1]
    if data.shape is None or indices.shape is None:
        return [TensorType(data.dtype, None)]
    axis = _axis(node, len(data.shape))
    if consts[0] is not None and consts[1] is not None:
        idx = _normalised_indices(node, consts[1], consts[0].shape[axis])
        return _folded([np.take(consts[0], idx, axis=axis)])
    return [TensorType(data.dtype, data.shape[:axis] + indices.shape + data.shape[axis + 1:])]


@grad("Gather")
def _gather_grad(ctx):  # dData = zeros; dData[..., indices[j], ...] += dY[..., j, ...]
    ctx.set_grad(0, ctx.odtrain("GatherGrad", [ctx.GO(0), ctx.I(1), ctx.I(0)], {"axis": ctx.attr("axis", 0)}))


@op("GatherGrad", ODTRAIN_DOMAIN, shape_only=(2,))
def _gather_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[2].shape)]


@op("GatherElements")
def _gather_elements_rule(node, types, consts):
    data, indices = types[0], types[1]
    if consts[0] is not None and consts[1] is not None:
        axis = _axis(node, consts[0].ndim)
        idx = _normalised_indices(node, consts[1], consts[0].shape[axis])
        return _folded([np.take_along_axis(consts[0], idx, axis=axis)])
    return [TensorType(data.dtype, indices.shape)]


@grad("GatherElements")
def _gather_elements_grad(ctx):  # dData = zeros; dData[index with axis → indices[p]] += dY[p]
    ctx.set_grad(0, ctx.odtrain("GatherElementsGrad", [ctx.GO(0), ctx.I(1), ctx.I(0)], {"axis": ctx.attr("axis", 0)}))


@op("GatherElementsGrad", ODTRAIN_DOMAIN, shape_only=(2,))
def _gather_elements_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[2].shape)]


@op("GatherND")
def _gather_nd_rule(node, types, consts):
    data, indices = types[0], types[1]
    if node.attrs.get("batch_dims", 0):
        raise ModelError(f"{node.describe()}: GatherND with batch_dims={node.attrs['batch_dims']} is not supported")
    if data.shape is None or indices.shape is None or not isinstance(indices.shape[-1], int):
        return [TensorType(data.dtype, None)]
    q = indices.shape[-1]
    if q > len(data.shape):
        raise ModelError(f"{node.describe()}: index tuples of length {q} for data of rank {len(data.shape)}")
    return [TensorType(data.dtype, tuple(indices.shape[:-1]) + tuple(data.shape[q:]))]


@grad("GatherND")
def _gather_nd_grad(ctx):  # dData = ScatterND(zeros, indices, dY, reduction=add)
    zeros = ctx.emit("ConstantOfShape", [ctx.emit("Shape", [ctx.I(0)])])
    ctx.set_grad(0, ctx.emit("ScatterND", [zeros, ctx.I(1), ctx.GO(0)], {"reduction": "add"}))


def _scatter_rule(node, types, consts):
    reduction = node.attrs.get("reduction", "none")
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise ModelError(f"{node.describe()}: unknown reduction '{reduction}'")
    return [types[0]]


op("ScatterElements")(_scatter_rule)
op("Scatter")(_scatter_rule)  # ScatterElements' name in opsets 9 and 10
op("ScatterND")(_scatter_rule)


def _scatter_grad(ctx, gather: str):
    # reduction none: dData = dY with the scattered places zeroed, dUpdates = dY gathered there;
    # reduction add: dData = dY, dUpdates = dY gathered.
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add"):
        from ..errors import UnsupportedOpError

        raise UnsupportedOpError(f"{ctx.node.describe()}: no gradient for reduction '{reduction}'")
    attrs = {"axis": ctx.attr("axis", 0)} if gather == "GatherElements" else {}
    if ctx.needs(0):
        if reduction == "add":
            ctx.set_grad(0, ctx.GO(0))
        else:
            zeros = ctx.emit("ConstantOfShape", [ctx.emit("Shape", [ctx.I(2)])])
            ctx.set_grad(0, ctx.emit(ctx.node.op_type, [ctx.GO(0), ctx.I(1), zeros], dict(attrs)))
    if ctx.needs(2):
        ctx.set_grad(2, ctx.emit(gather, [ctx.GO(0), ctx.I(1)], attrs))


grad("ScatterElements")(lambda ctx: _scatter_grad(ctx, "GatherElements"))
grad("Scatter")(lambda ctx: _scatter_grad(ctx, "GatherElements"))
grad("ScatterND")(lambda ctx: _scatter_grad(ctx, "GatherND"))


# ---- Where, Cast ------------------------------------------------------------------------------


@op("Where")
def _where_rule(node, types, consts):
    cond, a, b = types
    if any(t.shape is None for t in types):
        return [TensorType(a.dtype, None)]
    if _all_known(node, consts):
        return _folded([np.where(consts[0], consts[1], consts[2])])
    try:
        return [TensorType(a.dtype, broadcast_shapes(cond.shape, a.shape, b.shape))]
    except ValueError as error:
        raise ModelError(f"{node.describe()}: inputs {[str(t) for t in types]} cannot broadcast ({error})") from None


@grad("Where")
def _where_grad(ctx):  # dA = where(C, dY, 0), dB = where(C, 0, dY), each summed to its input's shape
    zero = ctx.constant(np.zeros((), np.float32), "zero")
    if ctx.needs(1):
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("Where", [ctx.I(0), ctx.GO(0), zero]), 1))
    if ctx.needs(2):
        ctx.set_grad(2, ctx.sum_to_input(ctx.emit("Where", [ctx.I(0), zero, ctx.GO(0)]), 2))


def onnx_dtype(node, code, storage: bool = False) -> np.dtype:
    """The numpy dtype of an element type attribute; with `storage`, also the types only Cast holds."""
    try:
        dtype = numpy_dtype(int(code))
    except Exception:
        dtype = None
    if dtype is not None and storage and is_storage_dtype(dtype):
        return dtype
    if dtype is None or dtype.kind not in "fiub" or dtype.itemsize > 8:
        raise ModelError(f"{node.describe()}: element type {code} is not supported (float, int and bool are)")
    return dtype


# The ops that take or give the element types numpy lacks (bfloat16, float8, float4, int4, int2): a model
# converts them to a computing type first (graph/schedule.py refuses them at any other op).
STORAGE_OPS = frozenset({"Cast", "CastLike", "DequantizeLinear"})


def _same_dtype(input_types, output_types) -> bool:
    return np.dtype(input_types[0].dtype) == np.dtype(output_types[0].dtype)


def _cast_to(node, types, consts, dtype):
    """Cast's type, folded by numpy between numpy's own types (the others run Cast's kernel: their rounding
    and saturation are odtrain's, not numpy's)."""
    source = np.dtype(types[0].dtype)
    if source.kind not in "fiub" and not is_storage_dtype(source):
        raise ModelError(f"{node.describe()}: cannot cast from {types[0]}")
    if consts[0] is not None and not is_storage_dtype(source) and not is_storage_dtype(dtype):
        return _folded([np.asarray(consts[0]).astype(dtype)])
    return [TensorType(dtype, types[0].shape)]


@op("Cast", view=_same_dtype)
def _cast_rule(node, types, consts):
    return _cast_to(node, types, consts, onnx_dtype(node, node.attrs.get("to"), storage=True))


def _computes_gradients(dtype) -> bool:
    return dtype is not None and dtype.kind == "f" and not is_storage_dtype(dtype)


@grad("Cast")
def _cast_grad(ctx):  # dX = cast(dY, type of X); no gradient through a cast to an integer or storage type
    source = dtype_of(ctx, ctx.I(0)) or np.dtype(np.float32)
    target = onnx_dtype(ctx.node, ctx.attr("to"), storage=True)
    if not (_computes_gradients(target) and _computes_gradients(source)):
        return
    ctx.set_grad(0, ctx.GO(0) if source == target else
                 ctx.emit("Cast", [ctx.GO(0)], {"to": element_type(source)}))


@op("CastLike", view=_same_dtype, shape_only=(1,))
def _cast_like_rule(node, types, consts):
    return _cast_to(node, types, consts, np.dtype(types[1].dtype))


@grad("CastLike")
def _cast_like_grad(ctx):  # dX = cast(dY, type of X)
    source, target = dtype_of(ctx, ctx.I(0)), dtype_of(ctx, ctx.I(1))
    if (source is not None and not _computes_gradients(source)) or (
            target is not None and not _computes_gradients(target)):
        return
    ctx.set_grad(0, ctx.emit("CastLike", [ctx.GO(0), ctx.I(0)]))


@op("BitCast", view=True, no_kernel="a view: its output is its input's bytes read as another type")
def _bit_cast_rule(node, types, consts):
    """The input's bytes read as another element type of the same size (a view)."""
    dtype = onnx_dtype(node, node.attrs.get("to"))
    source = np.dtype(types[0].dtype)
    if source.kind not in "fiub" or source.itemsize != dtype.itemsize:
        raise ModelError(f"{node.describe()}: cannot reinterpret {types[0]} as {dtype}: odtrain reinterprets "
                         "between float, int and bool types of one size")
    if consts[0] is not None:
        return _folded([np.ascontiguousarray(consts[0]).view(dtype)])
    return [TensorType(dtype, types[0].shape)]


no_grad("BitCast", "its output is the input's bits read as another type")


@op("EyeLike", shape_only=(0,), no_kernel=SHAPE_CONSTANT)
def _eye_like_rule(node, types, consts):
    """Ones on the k-th diagonal of a matrix shaped as the input: a constant once shapes are bound."""
    x = types[0]
    if x.shape is None or len(x.shape) != 2:
        raise ModelError(f"{node.describe()}: EyeLike takes a matrix, got {x}")
    code = node.attrs.get("dtype")
    dtype = onnx_dtype(node, code) if code is not None else np.dtype(x.dtype)
    return _folded([np.eye(x.shape[0], x.shape[1], int(node.attrs.get("k", 0)), dtype=dtype)])


no_grad("EyeLike", "its output depends on the input's shape only")


@op("OneHot", constant_inputs=(1,))
def _one_hot_rule(node, types, consts):
    """values[1] where an index (negative ones from the end) meets its position along the new axis of `depth`
    positions, values[0] elsewhere; an index out of range marks nothing."""
    indices, _, values = types
    if consts[1] is None:
        raise UnsupportedOpError(f"{node.describe()}: its depth input '{node.inputs[1]}' must be a constant")
    depth = int(np.asarray(consts[1]).reshape(-1)[0])
    rank = len(indices.shape) + 1
    axis = int(node.attrs.get("axis", -1))
    if not -rank <= axis < rank:
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for an output of rank {rank}")
    shape = list(indices.shape)
    shape.insert(axis % rank, depth)
    return [TensorType(values.dtype, tuple(shape))]


no_grad("OneHot", "its output places the two given values by integer indices")


def _depth_space_rule(node, types, consts):
    """DepthToSpace moves blocks of channels into b×b pixel blocks ([N, C, H, W] → [N, C/b², H·b, W·b]), channels
    taken depth-column-row (mode DCR) or column-row-depth (CRD); SpaceToDepth is its inverse in the same mode
    (ONNX's has a mode in recent opsets only; odtrain's, DepthToSpace's gradient, in any)."""
    x = types[0]
    b = int(node.attrs.get("blocksize", 0))
    if x.shape is None or len(x.shape) != 4 or b < 1:
        raise ModelError(f"{node.describe()}: takes a 4-D [N, C, H, W] tensor and a blocksize >= 1, got {x} and {b}")
    if node.attrs.get("mode", "DCR") not in ("DCR", "CRD"):
        raise ModelError(f"{node.describe()}: mode must be 'DCR' or 'CRD', got {node.attrs['mode']!r}")
    n, c, h, w = x.shape
    if node.op_type == "DepthToSpace":
        if c % (b * b):
            raise ModelError(f"{node.describe()}: {c} channels do not split into blocks of {b}×{b}")
        return [TensorType(x.dtype, (n, c // (b * b), h * b, w * b))]
    if h % b or w % b:
        raise ModelError(f"{node.describe()}: {h}×{w} pixels do not split into blocks of {b}×{b}")
    return [TensorType(x.dtype, (n, c * b * b, h // b, w // b))]


op("DepthToSpace")(_depth_space_rule)
op("SpaceToDepth")(_depth_space_rule)
op("SpaceToDepth", ODTRAIN_DOMAIN)(_depth_space_rule)


@grad("DepthToSpace")
def _depth_to_space_grad(ctx):  # dX = the inverse rearrangement of dY
    attrs = {"blocksize": ctx.attr("blocksize"), "mode": ctx.attr("mode", "DCR")}
    ctx.set_grad(0, ctx.odtrain("SpaceToDepth", [ctx.GO(0)], attrs))


@grad("SpaceToDepth")
def _space_to_depth_grad(ctx):  # dX = DepthToSpace(dY), the same mode
    ctx.set_grad(0, ctx.emit("DepthToSpace", [ctx.GO(0)], {"blocksize": ctx.attr("blocksize"),
                                                         "mode": ctx.attr("mode", "DCR")}))


grad("SpaceToDepth", ODTRAIN_DOMAIN)(_space_to_depth_grad)


@op("CenterCropPad", shape_only=(), constant_inputs=(1,))
def _center_crop_pad_rule(node, types, consts):
    """Each of `axes` (default all) cropped or zero-padded to its size in `shape`, centred (the extra element of an
    odd difference at the end)."""
    x = types[0]
    if consts[1] is None:
        raise UnsupportedOpError(f"{node.describe()}: its shape input '{node.inputs[1]}' must be a constant")
    sizes = _ints(consts[1])
    rank = len(x.shape)
    axes = [int(a) % rank for a in node.attrs.get("axes", range(rank))]
    if len(axes) != len(sizes) or any(size < 0 for size in sizes):
        raise ModelError(f"{node.describe()}: shape {sizes} must give one size >= 0 for each of the axes {axes}")
    shape = list(x.shape)
    for axis, size in zip(axes, sizes):
        shape[axis] = size
    return [TensorType(x.dtype, tuple(shape))]


@grad("CenterCropPad")
def _center_crop_pad_grad(ctx):  # dX = dY cropped or padded back to X's shape: the same centring undoes it
    ctx.set_grad(0, ctx.emit("CenterCropPad", [ctx.GO(0), ctx.emit("Shape", [ctx.I(0)])]))


@op("Compress", constant_inputs=(1,))
def _compress_rule(node, types, consts):
    """The slices along `axis` (of the flattened input without one) where the condition is true; a condition
    shorter than the axis is false beyond its end."""
    x = types[0]
    if consts[1] is None:
        raise UnsupportedOpError(f"{node.describe()}: its condition input '{node.inputs[1]}' must be a constant "
                                 "(its count of true values is the output's size)")
    condition = np.asarray(consts[1]).reshape(-1)
    if "axis" not in node.attrs:
        return [TensorType(x.dtype, (int(np.count_nonzero(condition[:_static_size(x.shape)])),))]
    rank = len(x.shape)
    axis = int(node.attrs["axis"])
    if not -rank <= axis < rank:
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for {x}")
    axis %= rank
    shape = list(x.shape)
    shape[axis] = int(np.count_nonzero(condition[:x.shape[axis]]))
    return [TensorType(x.dtype, tuple(shape))]


@grad("Compress")
def _compress_grad(ctx):  # dX = zeros; dY's slices put back where the condition is true
    attrs = {"axis": ctx.attr("axis")} if ctx.attr("axis") is not None else {}
    ctx.set_grad(0, ctx.odtrain("CompressGrad", [ctx.GO(0), ctx.I(1), ctx.I(0)], attrs))


@op("CompressGrad", ODTRAIN_DOMAIN, shape_only=(2,), constant_inputs=(1,))
def _compress_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[2].shape)]


@op("ReverseSequence")
def _reverse_sequence_rule(node, types, consts):
    """Each batch entry's first sequence_lens[b] steps along time_axis reversed, the rest as they are."""
    x = types[0]
    axes = {int(node.attrs.get("time_axis", 0)), int(node.attrs.get("batch_axis", 1))}
    if x.shape is None or len(x.shape) < 2 or axes != {0, 1}:
        raise ModelError(f"{node.describe()}: time_axis and batch_axis must be 0 and 1 (in either order) of a "
                         f"tensor of rank >= 2, got {sorted(axes)} for {x}")
    return [x]


@grad("ReverseSequence")
def _reverse_sequence_grad(ctx):  # dX = ReverseSequence(dY): reversing is its own inverse
    attrs = {k: ctx.attr(k) for k in ("time_axis", "batch_axis") if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.emit("ReverseSequence", [ctx.GO(0), ctx.I(1)], attrs))


@op("TensorScatter", inplace=((0, 0),))
def _tensor_scatter_rule(node, types, consts):
    """A cache [B, ..., max, ...] with an update [B, ..., seq, ...] written along `axis` (default -2) from each
    batch entry's write index (0 without the input), wrapping around in mode circular."""
    cache, update = types[0], types[1]
    rank = len(cache.shape)
    axis = int(node.attrs.get("axis", -2))
    if not -rank < axis < rank or axis % rank == 0 or len(update.shape) != rank:
        raise ModelError(f"{node.describe()}: axis {axis} must name a non-batch axis of {cache}, and {update} "
                         "must have its rank")
    axis %= rank
    if any(u != c for a, (u, c) in enumerate(zip(update.shape, cache.shape)) if a != axis) \
            or update.shape[axis] > cache.shape[axis]:
        raise ModelError(f"{node.describe()}: the update {update} does not fit the cache {cache} along axis {axis}")
    if node.attrs.get("mode", "linear") not in ("linear", "circular"):
        raise ModelError(f"{node.describe()}: mode must be 'linear' or 'circular', got {node.attrs['mode']!r}")
    return [cache]


@grad("TensorScatter")
def _tensor_scatter_grad(ctx):  # dCache = dY with the written places zeroed, dUpdate = dY at those places
    attrs = {k: ctx.attr(k) for k in ("axis", "mode") if ctx.attr(k) is not None}
    indices = ctx.I(2) if len(ctx.node.inputs) > 2 and ctx.node.inputs[2] else ""
    cache_grad, update_grad = ctx.odtrain("TensorScatterGrad", [ctx.GO(0), ctx.I(1), indices], attrs, outputs=2)
    if ctx.needs(0):
        ctx.set_grad(0, cache_grad)
    if ctx.needs(1):
        ctx.set_grad(1, update_grad)


@op("TensorScatterGrad", ODTRAIN_DOMAIN, shape_only=(1,))
def _tensor_scatter_grad_rule(node, types, consts):
    return [types[0], types[1]]


# Ops whose output shape depends on the input's values: they run where that input is a constant (an initializer,
# or a feed bound as one, one plan per value) and fold there.


def _value_input(node, consts, index: int = 0) -> np.ndarray:
    if consts[index] is None:
        raise UnsupportedOpError(f"{node.describe()}: its input '{node.inputs[index]}' must be a constant: the "
                                 "output's shape depends on its values")
    return np.asarray(consts[index])


@op("Unique", constant_inputs=(0,), no_kernel=FOLDED)
def _unique_rule(node, types, consts):
    """The distinct values (or slices along `axis`), sorted or in order of first appearance, with the first
    index of each, the index of each input element's value, and the counts."""
    x = _value_input(node, consts)
    axis = node.attrs.get("axis")
    values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                               axis=None if axis is None else int(axis))
    inverse = inverse.reshape(-1)
    if not node.attrs.get("sorted", 1):  # in order of first appearance
        order = np.argsort(first, kind="stable")
        values = np.take(values, order, axis=0 if axis is None else int(axis))
        first, counts = first[order], counts[order]
        inverse = np.argsort(order)[inverse]
    return _folded([values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)])


@op("NonZero", constant_inputs=(0,), no_kernel=FOLDED)
def _non_zero_rule(node, types, consts):
    """The indices of the nonzero elements, one row per axis."""
    x = _value_input(node, consts)
    return _folded([np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)])


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """[y1, x1, y2, x2] with y1 <= y2, x1 <= x2, from corners in either order or from [x_c, y_c, w, h]."""
    if center_point_box:
        xc, yc, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=1)
    return np.stack([np.minimum(boxes[:, 0], boxes[:, 2]), np.minimum(boxes[:, 1], boxes[:, 3]),
                     np.maximum(boxes[:, 0], boxes[:, 2]), np.maximum(boxes[:, 1], boxes[:, 3])], axis=1)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    height = np.clip(np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0]), 0, None)
    width = np.clip(np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1]), 0, None)
    inter = height * width
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = (box[2] - box[0]) * (box[3] - box[1]) + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0)


@op("NonMaxSuppression", constant_inputs=(0, 1, 2, 3, 4), no_kernel=FOLDED)
def _non_max_suppression_rule(node, types, consts):
    """[batch, class, box] of the boxes kept: per batch and class, by descending score (above score_threshold),
    each box whose IoU with every box kept before it is at most iou_threshold, at most
    max_output_boxes_per_class of them."""
    boxes, scores = _value_input(node, consts, 0), _value_input(node, consts, 1)
    limits = [np.asarray(consts[i]).reshape(-1)[0] if len(node.inputs) > i and node.inputs[i] else None
              for i in (2, 3, 4)]
    if any(len(node.inputs) > i and node.inputs[i] and consts[i] is None for i in (2, 3, 4)):
        raise UnsupportedOpError(f"{node.describe()}: its limits and thresholds must be constants")
    most = int(limits[0]) if limits[0] is not None else 0
    iou_threshold = float(limits[1]) if limits[1] is not None else 0.0
    kept = []
    for b in range(scores.shape[0]):
        corners = _corners(boxes[b].astype(np.float64), int(node.attrs.get("center_point_box", 0)))
        for c in range(scores.shape[1]):
            score = scores[b, c]
            order = [i for i in np.argsort(-score, kind="stable") if limits[2] is None or score[i] > limits[2]]
            chosen: list[int] = []
            for i in order:
                if len(chosen) >= most:
                    break
                if not chosen or np.all(_iou(corners[i], corners[chosen]) <= iou_threshold):
                    chosen.append(int(i))
            kept += [(b, c, i) for i in chosen]
    return _folded([np.array(kept, dtype=np.int64).reshape(-1, 3)])


no_grad("NonMaxSuppression", "its output is integer positions")
no_grad("Unique", "its outputs are values picked from a constant, and integer positions")
no_grad("NonZero", "its output is integer positions")


def trilu_mask(shape: tuple, k: int, upper: bool) -> np.ndarray:
    """Which elements of the last two axes Trilu keeps: j - i >= k (upper) or j - i <= k (lower)."""
    rows, cols = np.indices(shape[-2:])
    return (cols - rows >= k) if upper else (cols - rows <= k)


@op("Trilu", shape_only=(1,), constant_inputs=(1,))
def _trilu_rule(node, types, consts):
    x = types[0]
    k = int(np.asarray(_const_input(node, consts, 1, "k")).reshape(())) if len(node.inputs) > 1 and node.inputs[1] else 0
    if x.shape is not None and len(x.shape) < 2:
        raise ModelError(f"{node.describe()}: Trilu needs a rank of 2 or more, got {x}")
    if consts[0] is not None:
        keep = trilu_mask(consts[0].shape, k, bool(node.attrs.get("upper", 1)))
        return _folded([np.where(keep, consts[0], np.zeros((), consts[0].dtype))])
    return [x]


@grad("Trilu")
def _trilu_grad(ctx):  # dX = trilu(dY): the same elements pass
    ctx.set_grad(0, ctx.emit("Trilu", [ctx.GO(0)] + ([ctx.I(1)] if ctx.I(1) else []), {"upper": ctx.attr("upper", 1)}))


# ---- Shape, Size, Constant, ConstantOfShape, Range: constants once shapes are bound -----------------


@op("Shape", shape_only=(0,), no_kernel=SHAPE_CONSTANT)
def _shape_rule(node, types, consts):
    x = types[0]
    rank = None if x.shape is None else len(x.shape)
    if x.is_static:
        start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
        dims = np.array(x.shape[start:end], dtype=np.int64)
        return [TensorType(np.dtype(np.int64), dims.shape)], [dims]
    return [TensorType(np.dtype(np.int64), None if rank is None else (rank,))]


@op("Size", shape_only=(0,), no_kernel=SHAPE_CONSTANT)
def _size_rule(node, types, consts):
    x = types[0]
    if x.is_static:
        return _folded([np.array(x.size, dtype=np.int64)])
    return [TensorType(np.dtype(np.int64), ())]


@op("Constant", no_kernel="a constant of the model: its value is folded when shapes bind")
def _constant_rule(node, types, consts):
    value = constant_value(node)
    return [TensorType(value.dtype, value.shape)], [value]


def constant_value(node) -> np.ndarray:
    """The tensor a Constant node holds, from whichever value_* attribute it uses."""
    attrs = node.attrs
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64),
                       ("value_floats", np.float32), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise ModelError(f"{node.describe()}: Constant without a supported value attribute ({sorted(attrs)})")


def constant_of_shape_fill(node) -> np.ndarray:
    value = node.attrs.get("value")
    return np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)[:1]


@op("ConstantOfShape", shape_only=(0,), constant_inputs=(0,))
def _constant_of_shape_rule(node, types, consts):
    fill = constant_of_shape_fill(node)
    if consts[0] is None:
        return [TensorType(fill.dtype, None)]
    shape = tuple(_ints(consts[0]))
    if any(d < 0 for d in shape):
        raise ModelError(f"{node.describe()}: negative dimension in {list(shape)}")
    return _folded([np.full(shape, fill[0], dtype=fill.dtype)])


@op("Range", constant_inputs=(0, 1, 2))
def _range_rule(node, types, consts):
    if not _all_known(node, consts):
        return [TensorType(types[0].dtype, None)]
    start, limit, delta = (np.asarray(c).reshape(()) for c in consts)
    if delta == 0:
        raise ModelError(f"{node.describe()}: a delta of 0")
    count = max(int(np.ceil((limit - start) / delta)), 0)
    return _folded([(start + np.arange(count) * delta).astype(start.dtype)])


no_grad("Shape", "its output is an integer shape")
no_grad("Size", "its output is an integer count")
no_grad("Constant", "it has no inputs")
no_grad("ConstantOfShape", "its output depends only on a shape")
no_grad("Range", "its output depends only on its scalar bounds, which set a shape")
