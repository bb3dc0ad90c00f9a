"""The BLAS that odtrain's matrix products call: scipy's OpenBLAS, loaded lean, and its thread count.

Numba's CPU target checks for BLAS by importing `scipy.linalg.cython_blas`, the table of BLAS
functions its products (and kernels/blas.py) call. That import would run `scipy.linalg`'s
package initialiser, which loads all of scipy.linalg (LAPACK wrappers, the array-API layer,
numpy.testing and f2py with it): memory and start-up time that no kernel uses
(`bench_memory.RuntimeFloor` measures the floor). `load_blas()` loads the Cython table module by itself instead, under its own name, so
Numba and its C helpers find it in `sys.modules`; if the program imports `scipy.linalg` later,
the package is initialised as usual and gets the same module as its `cython_blas` attribute.
When scipy.linalg is already imported, or the file cannot be found, the usual import is used.

`set_blas_threads(n)` sets the threads of that OpenBLAS (numpy carries its own copy, which is
left alone); where the library cannot be found (another BLAS, another OS) it does nothing.

A leaf: imports nothing of odtrain's.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys

_BLAS_MODULE = "scipy.linalg.cython_blas"
_SETTERS = ("scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads")


def load_blas() -> None:
    """Make `scipy.linalg.cython_blas` importable at the cost of that one extension module."""
    if _BLAS_MODULE in sys.modules:
        return
    if "scipy.linalg" in sys.modules:
        importlib.import_module(_BLAS_MODULE)
        return
    path = _blas_module_path()
    if path is None:
        importlib.import_module(_BLAS_MODULE)
        return
    loader = importlib.machinery.ExtensionFileLoader(_BLAS_MODULE, path)
    spec = importlib.util.spec_from_file_location(_BLAS_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_BLAS_MODULE] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[_BLAS_MODULE]
        raise
    sys.meta_path.insert(0, _AttachToPackage())


def _blas_module_path() -> str | None:
    spec = importlib.util.find_spec("scipy")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "linalg", "cython_blas" + suffix)
            if os.path.isfile(path):
                return path
    return None


class _AttachToPackage:
    """Import hook: when `scipy.linalg` is first imported, give it the BLAS module loaded above."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "scipy.linalg":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_package = spec.loader.exec_module

        def exec_module(module):
            run_package(module)
            module.cython_blas = sys.modules[_BLAS_MODULE]

        spec.loader.exec_module = exec_module
        return spec


def set_blas_threads(count: int) -> bool:
    """Use `count` threads in scipy's OpenBLAS; returns whether the library was found."""
    setter = _thread_setter()
    if setter is None:
        return False
    setter(ctypes.c_int(max(int(count), 1)))
    return True


def _thread_setter():
    """The thread-count setter of the OpenBLAS that scipy.linalg.cython_blas is linked to, or None."""
    try:
        load_blas()
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "scipy.libs" in line}
    except (ImportError, OSError):
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                return setter
    return None
