"""numpy's own OpenBLAS, found without Numba: the library behind the kernels' products when numpy carries one.

numpy's wheels bundle OpenBLAS with 64-bit integers (`scipy_openblas64_`, or an older `openblas64_` build);
its CBLAS products and thread controls are found in the libraries numpy's core extension links. Used by
kernels/blas.py (which hands the products to Numba's code) and by the kernel library's loader
(odtrain/kernel_library/, which hands them to the library's code).

`hold_one_thread()` / `release_thread()` keep it at one thread while steps run (their parts are the
threads), giving the program its own count back afterwards.

Imports numpy and ctypes only.
"""
from __future__ import annotations

import ctypes
import os
import threading

# name prefixes and suffixes of OpenBLAS's 64-bit-integer interface, as numpy's wheels (and older
# openblas64_ builds) export it
ROUTE_VARIABLE = "ODTRAIN_GEMM"  # "numba": the products call scipy's BLAS through Numba
_OPENBLAS64 = (("scipy_cblas_", "scipy_openblas_", "64_"), ("cblas_", "openblas_", "64_"))


def numpy_openblas():
    """(library, CBLAS prefix, control prefix, suffix) of the 64-bit-integer OpenBLAS that numpy's
    extension links, or None."""
    try:
        from numpy._core import _multiarray_umath as extension
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as extension
    try:
        library = ctypes.CDLL(extension.__file__)  # lookups see the libraries it links too
    except (OSError, AttributeError):
        return None
    for cblas, control, suffix in _OPENBLAS64:
        names = [cblas + "sgemm" + suffix, cblas + "dgemm" + suffix, control + "set_num_threads" + suffix,
                 control + "get_num_threads" + suffix]
        if all(hasattr(library, name) for name in names):
            return library, cblas, control, suffix
    return None


class ProductThreads:
    """numpy's OpenBLAS (when it is the kernels' BLAS) held at one thread while steps run: steps nest and
    overlap, and the program's own count comes back when the last one releases."""

    def __init__(self, found):
        self.lock = threading.Lock()
        self.holders = 0
        self.program_threads = 1
        self.set_threads = self.get_threads = None
        self.core = ""  # OpenBLAS's name of the kernels it chose for this CPU, where it tells
        self.name = ""
        if found is None:
            return
        library, _, control, suffix = found
        self.set_threads = getattr(library, control + "set_num_threads" + suffix)
        self.set_threads.argtypes = [ctypes.c_int]
        self.get_threads = getattr(library, control + "get_num_threads" + suffix)
        self.get_threads.restype = ctypes.c_int
        corename = getattr(library, control + "get_corename" + suffix, None)
        if corename is not None:
            corename.restype = ctypes.c_char_p
            self.core = corename().decode(errors="replace")
        config = getattr(library, control + "get_config" + suffix, None)
        if config is not None:
            config.restype = ctypes.c_char_p
        described = config().decode(errors="replace").split("  ")[0] if config is not None else "OpenBLAS"
        self.name = f"numpy's {described}"

    def hold(self) -> None:
        if self.set_threads is None:
            return
        with self.lock:
            if self.holders == 0:
                self.program_threads = self.get_threads()
                if self.program_threads != 1:
                    self.set_threads(1)
            self.holders += 1

    def release(self) -> None:
        if self.set_threads is None:
            return
        with self.lock:
            self.holders -= 1
            if self.holders == 0 and self.program_threads != 1:
                self.set_threads(self.program_threads)


def gemm_addresses(found) -> tuple[int, int]:
    """The addresses of the float32 and float64 CBLAS products of `found` (numpy_openblas())."""
    library, cblas, _, suffix = found
    return tuple(ctypes.cast(getattr(library, cblas + k + "gemm" + suffix), ctypes.c_void_p).value for k in "sd")


_found = None
_searched = False
_threads = None


def found_openblas():
    """numpy_openblas(), searched once per process, unless ODTRAIN_GEMM=numba chose scipy's BLAS."""
    global _found, _searched
    if not _searched:
        _searched = True
        _found = None if os.environ.get(ROUTE_VARIABLE, "").strip().lower() == "numba" else numpy_openblas()
    return _found


def product_threads() -> ProductThreads:
    global _threads
    if _threads is None:
        _threads = ProductThreads(found_openblas())
    return _threads


def hold_one_thread() -> None:
    """Run the products' BLAS on one thread until the matching release_thread()."""
    product_threads().hold()


def release_thread() -> None:
    product_threads().release()
