"""Numba's names in the kernel modules, loaded only when a kernel compiles.

The kernel modules take `njit`, `prange`, `intrinsic`, `overload`, `types` and `carray` from here. Until
`load()` runs they are placeholders, so that a process whose kernels all run in the kernel library
(odtrain/kernel_library/) imports the kernel modules, and their bindings, without Numba:
- `@njit(...)` gives a `Deferred` kernel: its `py_func` names it; called, it loads the compiler and runs
  as Numba's dispatcher, except in a process whose kernel library runs the steps (`without_compiler()`):
  there the helpers that bindings call while a step is bound (sizes, layouts) run as Python until the
  compiler loads (a kernel the library lacks is run only after odtrain.jit.load()); a dispatcher's
  attribute asked of it loads the compiler;
- `@intrinsic`, `prange`, `types` and `carray` give placeholders; `@overload(f)` is remembered.
`load()` (called by odtrain.jit.load before the first JIT step, and by the library's build) imports Numba, replaces
the placeholders of names (prange, types, carray, intrinsics) in the kernel modules' globals and in the
namespaces of kernels generated from source by Numba's objects, registers the overloads and runs the
hooks given to `on_load` (kernels/blas.py registers its BLAS symbols there). Deferred kernels stay what
they are: Numba types one as its dispatcher (`_numba_type_`, asked of the dispatcher), so kernels that
call kernels compile as if decorated at import; `resolved(kernel)` is the dispatcher, for a step's loop.
From then on `njit` is Numba's.

Imports nothing at import; Numba at load().
"""
from __future__ import annotations

import sys
import threading

_PACKAGE = __name__.rpartition(".")[0]
_lock = threading.RLock()
_loaded = False
_without_compiler = False  # a kernel library runs the steps: helpers called from Python run as Python
_deferred: list = []
_overloads: list = []
_hooks: list = []


class Placeholder:
    """A name of Numba's, until the compiler loads."""

    def compiled(self):
        raise NotImplementedError


class Deferred(Placeholder):
    """An @njit kernel whose dispatcher is made when the compiler loads."""

    def __init__(self, function, options):
        self.py_func = function
        self.options = options
        self.__name__, self.__qualname__ = function.__name__, function.__qualname__
        self.__doc__, self.__module__ = function.__doc__, function.__module__
        self._dispatcher = None
        _deferred.append(self)

    def compiled(self):
        if self._dispatcher is None:
            from numba import njit as numba_njit

            self._dispatcher = numba_njit(**self.options)(self.py_func)
        return self._dispatcher

    def __call__(self, *args, **kwargs):
        if not _loaded:
            if _without_compiler:  # a helper called while a step is bound (sizes, layouts): as Python
                return self.py_func(*args, **kwargs)
            load()
        return self.compiled()(*args, **kwargs)

    def __getattr__(self, name):  # a dispatcher's attribute (signatures, stats, ...): the compiler is needed
        if name.startswith("__"):
            raise AttributeError(name)
        load()
        return getattr(self.compiled(), name)

    def __repr__(self):
        return f"Deferred({self.__module__}.{self.__qualname__})"


class _Intrinsic(Placeholder):
    def __init__(self, function, options):
        self.function, self.options, self._made = function, options, None

    def compiled(self):
        if self._made is None:
            from numba.extending import intrinsic as numba_intrinsic

            self._made = numba_intrinsic(**self.options)(self.function) if self.options \
                else numba_intrinsic(self.function)
        return self._made


class _Name(Placeholder):
    """A plain Numba name (prange, types, carray): the object itself once loaded."""

    def __init__(self, name):
        self.name = name

    def compiled(self):
        import numba

        return getattr(numba, self.name)

    def __getattr__(self, attribute):
        load()
        return getattr(self.compiled(), attribute)

    def __call__(self, *args, **kwargs):  # prange in a kernel run as Python: range
        if not _loaded and self.name == "prange":
            return range(*args, **kwargs)
        load()
        return self.compiled()(*args, **kwargs)


prange = _Name("prange")
types = _Name("types")
carray = _Name("carray")


def njit(*args, **options):
    """Numba's njit once loaded, else a Deferred kernel (used as @njit or @njit(options))."""
    if args and callable(args[0]) and not options:
        return njit(**{})(args[0])

    def decorate(function):
        if _loaded:
            from numba import njit as numba_njit

            return numba_njit(**options)(function)
        return Deferred(function, options)

    return decorate


def intrinsic(*args, **options):
    if args and callable(args[0]):
        return _Intrinsic(args[0], {}) if not _loaded else _load_intrinsic(args[0], {})
    return lambda function: _Intrinsic(function, options) if not _loaded else _load_intrinsic(function, options)


def _load_intrinsic(function, options):
    return _Intrinsic(function, options).compiled()


def overload(target, **options):
    """Register `impl` as Numba's overload of `target` when the compiler loads."""

    def register(impl):
        if _loaded:
            from numba.extending import overload as numba_overload

            numba_overload(target, **options)(impl)
        else:
            _overloads.append((target, options, impl))
        return impl

    return register


def on_load(hook) -> None:
    """Run `hook()` when the compiler loads (now, if it has)."""
    if _loaded:
        hook()
    else:
        _hooks.append(hook)


def without_compiler() -> None:
    """From now on, until the compiler loads, a deferred kernel called from Python runs as Python (its
    arithmetic as the kernel's for the integer helpers that bindings call while a step is bound) instead of
    loading the compiler: a process whose kernel library runs the steps (odtrain/kernel_library/)."""
    global _without_compiler
    _without_compiler = True


def resolved(kernel):
    """The callable that runs `kernel`: its Numba dispatcher once the compiler is loaded, else itself."""
    return kernel.compiled() if _loaded and isinstance(kernel, Deferred) else kernel


def loaded() -> bool:
    return _loaded


def _swapped(value):
    """`value` with Numba's objects for the placeholders of names (prange, types, carray, intrinsics), in it
    and in the dicts, lists and tuples it holds (a dict is changed in place). Deferred kernels stay: they are
    the kernels' identity everywhere (tables of twins, closures of bindings, calls bound before the compiler
    loaded), Numba types one as its dispatcher and calling one calls the dispatcher."""
    if isinstance(value, Deferred):  # stays: Numba types it as its dispatcher (_numba_type_), Python calls it
        return value
    if isinstance(value, Placeholder):
        return value.compiled()
    if isinstance(value, dict):
        if any(isinstance(v, (Placeholder, dict, list, tuple)) for item in value.items() for v in item):
            items = [(_swapped(k), _swapped(v)) for k, v in value.items()]
            value.clear()
            value.update(items)
    elif isinstance(value, list):
        value[:] = [_swapped(v) for v in value]
    elif isinstance(value, tuple) and any(isinstance(v, (Placeholder, dict, list, tuple)) for v in value):
        swapped = tuple(_swapped(v) for v in value)
        return value if all(a is b for a, b in zip(swapped, value)) else type(value)(*swapped) \
            if hasattr(value, "_fields") else swapped
    return value


def load() -> None:
    """Import Numba and give the kernel modules its objects in place of every placeholder (idempotent)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from numba.extending import overload as numba_overload

        namespaces = {id(vars(m)): vars(m) for name, m in list(sys.modules.items())
                      if m is not None and name.startswith(_PACKAGE + ".")}
        for kernel in _deferred:
            namespaces.setdefault(id(kernel.py_func.__globals__), kernel.py_func.__globals__)
        for namespace in namespaces.values():
            for key, value in list(namespace.items()):
                namespace[key] = _swapped(value)
        for target, options, impl in _overloads:
            numba_overload(target, **options)(impl)
        _loaded = True
        for hook in _hooks:
            hook()
