"""Conversions between number formats, through their bits: float16, bfloat16, the float8 and float4 formats
and the integers of fewer than 8 bits, which numpy lacks or Numba cannot compute with.

`convert_call(x, out, saturate)` is the one call that converts between any two of these and the native
types (Cast, and the integer products of kernels/quantize.py): `_convert` reads x natively, through a table
of its codes' values, or as small signed/unsigned integers, and writes natively, as the nearest minifloat
code (ties to even, saturating or overflowing as ONNX says for the format), or as a small integer.
`converts(dtype)` says whether a dtype goes through it. Imports numpy and the base modules jit and layout.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

from .layout import flat


# Element types Numba cannot compute with, held as their bit patterns: dtype name -> (exponent bits, mantissa
# bits, exponent bias, specials). Specials: "ieee" (all-ones exponent: infinities and NaNs), "fn" (only the
# all-ones code is NaN), "fnuz" (the negative-zero code is the one NaN), "finite" (neither).
MINIFLOATS = {"float16": (5, 10, 15, "ieee"), "bfloat16": (8, 7, 127, "ieee"), "float8_e4m3fn": (4, 3, 7, "fn"),
              "float8_e4m3fnuz": (4, 3, 8, "fnuz"), "float8_e5m2": (5, 2, 15, "ieee"),
              "float8_e5m2fnuz": (5, 2, 16, "fnuz"), "float4_e2m1fn": (2, 1, 1, "finite")}
# Integers of fewer than 8 bits, one a byte: dtype name -> (bits, signed).
SMALL_INTEGERS = {"int4": (4, True), "uint4": (4, False), "int2": (2, True), "uint2": (2, False)}
READ_NATIVE, READ_TABLE, READ_SIGNED, READ_UNSIGNED = range(4)
WRITE_NATIVE, WRITE_MINIFLOAT, WRITE_SMALL_INTEGER = range(3)


def minifloat_values(name: str) -> np.ndarray:
    """The value of every code of a MINIFLOATS format, in float64 (NaN for its NaN codes)."""
    exponent_bits, mantissa_bits, bias, specials = MINIFLOATS[name]
    codes = np.arange(1 << (1 + exponent_bits + mantissa_bits), dtype=np.int64)
    sign_bit = 1 << (exponent_bits + mantissa_bits)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (codes & ((1 << mantissa_bits) - 1)).astype(np.float64)
    normal = exponent > 0
    values = np.ldexp(np.where(normal, mantissa + (1 << mantissa_bits), mantissa),
                      np.where(normal, exponent, 1) - bias - mantissa_bits)
    values = np.where(codes & sign_bit, -values, values)
    top = exponent == (1 << exponent_bits) - 1
    if specials == "ieee":
        values = np.where(top, np.where(mantissa == 0, np.copysign(np.inf, values), np.nan), values)
    elif specials == "fn":
        values[(codes & (sign_bit - 1)) == sign_bit - 1] = np.nan
    elif specials == "fnuz":
        values[sign_bit] = np.nan
    return values


def _encoding(name: str, saturate: bool):
    """The arguments of _convert's minifloat writer: the ascending finite magnitudes (the codes 0, 1, ...),
    the sign bit, the codes of overflow and NaN, whether it saturates and has a negative zero."""
    exponent_bits, mantissa_bits, _, specials = MINIFLOATS[name]
    values = minifloat_values(name)
    sign_bit = 1 << (exponent_bits + mantissa_bits)
    positive = values[:sign_bit]
    finite = int(np.argmax(~np.isfinite(positive))) if not np.isfinite(positive).all() else sign_bit
    if specials == "ieee":  # overflow to infinity; only the float8 types saturate
        overflow, nan = finite, finite | (1 << (mantissa_bits - 1))
        saturate = saturate and exponent_bits + mantissa_bits < 8
    elif specials == "fn":
        overflow = nan = sign_bit - 1
    elif specials == "fnuz":
        overflow = nan = sign_bit
    else:  # no infinity, no NaN: always saturates, NaN becomes negative zero (as ml_dtypes does)
        overflow, nan, saturate = finite - 1, sign_bit, True
    return (np.ascontiguousarray(positive[:finite]), sign_bit, overflow, nan, bool(saturate), specials != "fnuz")


@njit(cache=True, error_model="numpy")
def _convert(x, out, read, table, bits, write, magnitudes, sign_bit, overflow, nan, saturate, negative_zero):
    """out = x converted through float64: x read natively, through a table of its codes' values, or as a small
    signed/unsigned integer of `bits` bits; out written natively, as the code of the nearest of the
    ascending `magnitudes` (ties to the even code; beyond the largest: the largest if saturating, else
    `overflow`; NaN: `nan`; a sign bit unless the result is a zero without `negative_zero`), or as a
    small integer (truncated, wrapped to `bits` bits)."""
    count = magnitudes.size
    mask = (1 << bits) - 1
    for i in range(out.size):
        if read == READ_NATIVE:
            v = np.float64(x[i])
        elif read == READ_TABLE:
            v = table[np.int64(x[i])]
        else:
            c = np.int64(x[i]) & mask
            v = np.float64(c - (1 << bits) if read == READ_SIGNED and c >> (bits - 1) else c)
        if write == WRITE_NATIVE:
            out[i] = v
        elif write == WRITE_SMALL_INTEGER:
            c = (np.int64(v) if np.isfinite(v) else 0) & mask
            out[i] = c - (1 << bits) if sign_bit and c >> (bits - 1) else c
        elif v != v:
            out[i] = nan
        else:
            a = abs(v)
            if a == np.inf:
                code = count - 1 if saturate else overflow
            else:
                low, high = 0, count - 1  # the largest k with magnitudes[k] <= a
                while low < high:
                    middle = (low + high + 1) // 2
                    if magnitudes[middle] <= a:
                        low = middle
                    else:
                        high = middle - 1
                above = magnitudes[low + 1] if low + 1 < count else 2 * magnitudes[count - 1] - magnitudes[count - 2]
                below = magnitudes[low]
                code = low
                if a - below > above - a or (a - below == above - a and low % 2 == 1):
                    code = low + 1
                if code == count:
                    code = count - 1 if saturate else overflow
            negative = v < 0 or (v == 0 and np.copysign(1.0, v) < 0)
            if negative and (code != 0 or negative_zero) and not (code == nan and sign_bit == nan):
                code |= sign_bit  # a negative overflow keeps its sign, even as NaN, unless NaN is the sign bit
            out[i] = code


def _minifloat_table(name: str) -> np.ndarray:
    return minifloat_values(name)


def converts(dtype) -> bool:
    """Whether a dtype is one _convert reads or writes through its bits (float16 and the types numpy lacks)."""
    return dtype.name in MINIFLOATS or dtype.name in SMALL_INTEGERS


def _bits_view(a: np.ndarray) -> np.ndarray:
    """A storage-type array as its unsigned codes (numpy views)."""
    return flat(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def convert_call(x: np.ndarray, out: np.ndarray, saturate: int):
    none = np.zeros(2, np.float64)
    read, table, bits, source = READ_NATIVE, none, 8, flat(x)
    if x.dtype.name in MINIFLOATS:
        read, table, source = READ_TABLE, _minifloat_table(x.dtype.name), _bits_view(x)
    elif x.dtype.name in SMALL_INTEGERS:
        bits, signed = SMALL_INTEGERS[x.dtype.name]
        read, source = READ_SIGNED if signed else READ_UNSIGNED, _bits_view(x)
    target, encoding = flat(out), (none, 0, 0, 0, False, True)
    write = WRITE_NATIVE
    if out.dtype.name in MINIFLOATS:
        write, target, encoding = WRITE_MINIFLOAT, _bits_view(out), _encoding(out.dtype.name, bool(saturate))
    elif out.dtype.name in SMALL_INTEGERS:
        bits, signed = SMALL_INTEGERS[out.dtype.name]
        write, target = WRITE_SMALL_INTEGER, flat(out).view(np.int8)
        encoding = (none, int(signed), 0, 0, False, True)
    return (_convert, (source, target, read, table, bits, write) + encoding)


