"""Loading scipy's BLAS table, the one Numba's matrix products call, at the cost of that one module.

`import scipy.linalg.cython_blas` would run `scipy.linalg`'s package initialiser, which loads all of
scipy.linalg (LAPACK wrappers, the array-API layer, numpy.testing and f2py with it): about 15 MiB of
RSS and a quarter of a second that no kernel uses. `load_blas()` loads the Cython table module by
itself instead, under its own name, so Numba and its C helpers find it in `sys.modules`; if the
program imports `scipy.linalg` later, the package is initialised as usual and gets the same module
as its `cython_blas` attribute. When scipy.linalg is already imported, or the file cannot be found,
the usual import is used.

A leaf: the runtime (`odtrain.runtime`) and the thread policy (`odtrain.threads`) both use it.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_BLAS_MODULE = "scipy.linalg.cython_blas"


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
