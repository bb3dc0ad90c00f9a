"""What the image op families (conv, pool, nn, resize) share: the geometry of sliding windows, the
float32 check, and the type rule of a gradient op whose output has its input 1's type (the forward's input).

Windowed ops (Conv, MaxPool, AveragePool) share one geometry: for each spatial
axis, out = floor((in + pad_begin + pad_end - ((k - 1)·dilation + 1)) / stride) + 1
(ceil for pools with ceil_mode, dropping a last window that would start in the end
padding); auto_pad SAME_* gives out = ceil(in / stride) and splits the needed
padding with the extra cell at the end (UPPER) or the beginning (LOWER).
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import TensorType

FLOAT32 = np.dtype(np.float32)


def _require_float32(node, t: TensorType, what: str = "input") -> None:
    if t.dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its {what} is {t}; odtrain runs {node.op_type} on float32 only")


def _ints(node, name: str, count: int, default: int) -> list[int]:
    values = node.attrs.get(name)
    if values is None or len(values) == 0:
        return [default] * count
    if len(values) != count:
        raise ModelError(f"{node.describe()}: attribute {name}={list(values)} needs {count} values")
    return [int(v) for v in values]


def _auto_pad(node) -> str:
    value = node.attrs.get("auto_pad", "NOTSET")
    value = value.decode() if isinstance(value, bytes) else value
    if value not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ModelError(f"{node.describe()}: auto_pad={value!r} is not an ONNX value")
    return value


def window_output_shape(node, spatial: tuple, kernel: list[int], ceil_mode: bool = False) -> tuple:
    """Output spatial dims of a sliding window op (Conv, MaxPool, AveragePool); symbolic dims stay symbolic."""
    rank = len(spatial)
    strides = _ints(node, "strides", rank, 1)
    dilations = _ints(node, "dilations", rank, 1)
    pads = _ints(node, "pads", 2 * rank, 0)
    auto_pad = _auto_pad(node)
    out = []
    for axis, size in enumerate(spatial):
        if not isinstance(size, int):
            out.append(f"{node.name or node.op_type}_out{axis}")
            continue
        span = (kernel[axis] - 1) * dilations[axis] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-size // strides[axis]))
            continue
        begin, end = (0, 0) if auto_pad == "VALID" else (pads[axis], pads[rank + axis])
        if begin >= span or end >= span:
            raise ModelError(f"{node.describe()}: pads {pads} must be smaller than the window ({span}) on axis {axis}")
        extent = size + begin + end - span
        if extent < 0:
            raise ModelError(f"{node.describe()}: the window ({span}) is larger than the padded input "
                             f"({size + begin + end})")
        count = (-(-extent // strides[axis]) if ceil_mode else extent // strides[axis]) + 1
        if ceil_mode and (count - 1) * strides[axis] >= size + begin:
            count -= 1  # the last window would start inside the end padding
        out.append(count)
    return tuple(out)


def _spatial_rank(node, x: TensorType) -> int:
    rank = len(x.shape) - 2
    if not 1 <= rank <= 3:
        raise UnsupportedOpError(f"{node.describe()}: input {x} has {rank} spatial dims; odtrain supports 1 to 3")
    return rank


def _input_shaped(node, types, consts):
    return [types[1]]
