"""Geometry of the windowed kernels (convolution, depthwise convolution, pooling), computed at bind time.

Every windowed op sees 3 spatial axes (1-D and 2-D ops get leading axes of size 1), so one
compiled kernel serves every rank. `geom` holds, as int64: kernel (3), strides (3), dilations (3),
begin pads (3), output dims (3).

Loops index with range variables into slices (never `i + offset`), so Numba's negative-index
wraparound does not block vectorisation; `valid_range` gives the bounds of such a slice.

`text` reads a string attribute (ONNX gives bytes), for every image family. FORWARD, INPUT_GRADIENT and
WEIGHT_GRADIENT name the three ops of a convolution strategy (kernels/conv/taps.py, pointwise.py,
depthwise.py, and im2col in kernels/conv/__init__.py), each strategy's KERNELS keyed by them; `Convolution` is
the one description of a convolution that every strategy's plan is built from.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT = 0, 1, 2


def text(value) -> str:
    """A string attribute as str (ONNX gives bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def window_geometry(x_spatial, out_spatial, kernel, auto_pad, pads, strides, dilations):
    """(geom int64[15], end pads) with everything padded to 3 spatial axes in front."""
    rank = len(x_spatial)
    strides = list(strides) if strides else [1] * rank
    dilations = list(dilations) if dilations else [1] * rank
    pads = list(pads) if pads else [0] * (2 * rank)
    auto_pad = text(auto_pad)
    begin, end = [], []
    for axis in range(rank):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, (out_spatial[axis] - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] + 1
                        - x_spatial[axis])
            low = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            begin.append(low)
            end.append(total - low)
        elif auto_pad == "VALID":
            begin.append(0)
            end.append(0)
        else:
            begin.append(int(pads[axis]))
            end.append(int(pads[rank + axis]))
    fill = 3 - rank
    geom = ([1] * fill + [int(k) for k in kernel] + [1] * fill + [int(s) for s in strides]
            + [1] * fill + [int(d) for d in dilations] + [0] * fill + begin
            + [1] * fill + [int(o) for o in out_spatial])
    return np.array(geom, dtype=np.int64), [0] * fill + end


class Convolution:
    """One convolution of X by W into Y, as every strategy reads it: with G groups, X is [N, G, C/G, D, H, W]
    (`x6`), W is [G, M/G, K] (`w3`, K = C/G·kd·kh·kw) and Y is [N, G, M/G, P] (`y4`, P = `cells`, the output
    cells); `geom` as window_geometry gives it; `multiply_adds` the work of its forward (and of each
    gradient), which decides how many parts it splits into."""

    def __init__(self, x_shape, w_shape, y_shape, group=1, auto_pad="NOTSET", dilations=None, kernel_shape=None,
                 pads=None, strides=None):
        group = int(group)
        self.batch, self.groups = int(x_shape[0]), group
        self.in_per_group, self.out_per_group = int(x_shape[1]) // group, int(w_shape[0]) // group
        kernel = [int(k) for k in w_shape[2:]]
        self.geom, _ = window_geometry(x_shape[2:], y_shape[2:], kernel, auto_pad, pads, strides, dilations)
        self.x3, self.y3 = as_3d(x_shape[2:]), as_3d(y_shape[2:])
        self.cells = int(np.prod(y_shape[2:], dtype=np.int64))
        self.k = self.in_per_group * int(np.prod(kernel, dtype=np.int64))
        self.x6 = (self.batch, group, self.in_per_group) + self.x3
        self.y4 = (self.batch, group, self.out_per_group, self.cells)
        self.w3 = (group, self.out_per_group, self.k)
        self.multiply_adds = self.batch * self.cells * self.k * int(w_shape[0])
        self.depthwise = self.in_per_group == 1 and self.k > 1
        geom = self.geom  # 1x1, stride 1, no padding: Y[n] = W · X[n], no window to gather
        self.pointwise = bool((geom[0:6] == 1).all() and (geom[9:12] == 0).all()
                              and tuple(x_shape[2:]) == tuple(y_shape[2:]))


def as_3d(shape) -> tuple:
    """Spatial dims padded to 3 in front."""
    spatial = tuple(shape)
    return (1,) * (3 - len(spatial)) + spatial


@njit(cache=True, inline="always")
def valid_range(offset, stride, size, count):
    """Output positions o in [lo, hi) with 0 <= o·stride + offset < size."""
    lo = -(offset // stride)
    hi = (size - 1 - offset) // stride + 1
    lo = min(max(lo, 0), count)
    hi = min(max(hi, lo), count)
    return lo, hi
