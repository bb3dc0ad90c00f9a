"""Layout kernels: Transpose as a strided gather. (Reshape, Flatten and Identity are arena views.)"""
from __future__ import annotations

from . import binding
from .elementwise import gather_call
from .layout import coalesce, element_strides


@binding("Transpose")
def Transpose(inputs, outputs, perm=None):
    x, out = inputs[0], outputs[0]
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    source_strides = element_strides(x.shape, x.shape)
    dims, strides = coalesce(out.shape, [source_strides[p] for p in perm])
    return [gather_call(x, out, dims, strides)]
