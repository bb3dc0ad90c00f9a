"""Where the JIT's compiled kernels are kept, and keeping that cache true to the kernel sources.

Every kernel is an `@njit(cache=True)` function: the first process that needs one compiles it and
writes it to Numba's cache; later processes load it (milliseconds). Where the cache lives:

- `NUMBA_CACHE_DIR` set by the user: there, untouched.
- `ODTRAIN_CACHE_DIR` set: there (odtrain sets `NUMBA_CACHE_DIR` from it before Numba is imported).
- neither: Numba's own choice, next to the kernels' sources (`odtrain/kernels/__pycache__`) when that
  folder is writable, else the user's cache folder (`$XDG_CACHE_HOME/numba` or `~/.cache/numba`).
  When neither is writable (a read-only system image and no home folder), odtrain picks a folder in
  the temporary directory, so that importing the kernels never fails for want of a cache.

`configure()` runs when `odtrain` is imported and costs a few system calls.

Numba knows a cached kernel by its own bytecode and its file's size and time, not by the kernels of
other files that it calls or inlines (their code is compiled into it). After a kernel file changes
(an update in place, a `git pull` in a checkout), the kernels of the files that use it would load
code compiled from the old one. `discard_stale()` runs before the first step of a process binds
(odtrain.executor): the cache folder keeps the SHA-256 of every kernel source it was filled from
(SOURCES_STAMP), and when the sources differ, odtrain's cached kernels are removed from that folder
so that they compile again. A process loading one meanwhile compiles it instead.

The digest is taken once, when this module is imported: `import odtrain` imports it before any kernel
module, so it never describes newer sources than the kernels this process compiles. Taken later (at
the first bind), sources edited in between would stamp the cache with the new digest over kernels
compiled from the old files, and the next process would load those as current.

Imports nothing of odtrain's at module level (the kernel modules when asked for their dispatchers).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys

CACHE_ENV = "ODTRAIN_CACHE_DIR"
NUMBA_ENV = "NUMBA_CACHE_DIR"
SOURCES_STAMP = "odtrain-kernel-sources.sha256"
_PACKAGE = (__package__ or "odtrain.jit").rpartition(".")[0]  # odtrain
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # odtrain/
_CHECKOUT_KERNELS = os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels")
_checked = False

_configured_source = None


def _writable(folder: str) -> bool:
    """Whether `folder` exists and can be written, or can be created (the nearest existing parent is writable)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def user_cache_dir() -> str:
    """Numba's user-wide cache folder (where it goes when the package folder is read-only)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba")


def configure() -> str:
    """Choose the cache folder before Numba is imported; returns how it was chosen.

    'NUMBA_CACHE_DIR' (the user's), 'ODTRAIN_CACHE_DIR', 'package' (next to the kernels' sources),
    'user' (the user's cache folder) or 'temporary'.
    """
    global _configured_source
    if os.environ.get(NUMBA_ENV):
        source = NUMBA_ENV
    elif os.environ.get(CACHE_ENV):
        _set_numba_cache_dir(os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV])))
        source = CACHE_ENV
    else:
        kernels = kernels_dir()
        pycache = os.path.join(kernels, "__pycache__")
        if _writable(pycache if os.path.isdir(pycache) else kernels):
            source = "package"
        elif _writable(user_cache_dir()):
            source = "user"
        else:
            import tempfile

            uid = os.getuid() if hasattr(os, "getuid") else "user"
            _set_numba_cache_dir(os.path.join(tempfile.gettempdir(), f"odtrain-numba-cache-{uid}"))
            source = "temporary"
    _configured_source = source
    return source


def configured_source() -> str | None:
    """How configure() chose the folder (None before it ran)."""
    return _configured_source


def _set_numba_cache_dir(path: str) -> None:
    os.environ[NUMBA_ENV] = path
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba imported first: its configuration is read already, and reread by the compiler
        config.CACHE_DIR = path


def cache_dir() -> str:
    """The folder the kernels are cached in (imports the kernels)."""
    chosen = os.environ.get(NUMBA_ENV)
    for dispatcher in kernel_dispatchers():
        path = getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
        if path:  # NUMBA_CACHE_DIR/<folder>_<hash of the sources' folder>, or the folder itself
            if chosen and os.path.dirname(path) == os.path.abspath(chosen):
                return os.path.abspath(chosen)
            return path
    return ""


def kernel_dispatchers() -> list:
    """Every Numba dispatcher of odtrain's kernel modules (imports them: the kernels package imports every family)."""
    importlib.import_module(_PACKAGE + ".kernels")
    return loaded_dispatchers()


def kernel_stats() -> dict:
    """Counts over every kernel of this process so far: 'compiled' (cache misses: compiled here),
    'loaded' (cache hits: loaded from the cache), 'kernels' (dispatchers with a compiled signature),
    and 'compiled_kernels', the names of the kernels compiled."""
    compiled = loaded = used = 0
    names = []
    for dispatcher in kernel_dispatchers():
        stats = dispatcher.stats
        misses = sum(stats.cache_misses.values())
        compiled += misses
        loaded += sum(stats.cache_hits.values())
        used += bool(dispatcher.signatures)
        if misses:
            names.append(f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}")
    return {"compiled": compiled, "loaded": loaded, "kernels": used, "compiled_kernels": names}


def kernels_dir() -> str:
    """The folder holding the kernel sources: odtrain/kernels installed, kernels/ in a checkout."""
    installed = os.path.join(_PACKAGE_DIR, "kernels")
    return installed if os.path.isdir(installed) else _CHECKOUT_KERNELS


def loaded_dispatchers() -> list:
    """The Numba dispatchers of odtrain's kernel modules imported so far (loads the compiler)."""
    from numba.core.dispatcher import Dispatcher

    jit = importlib.import_module(_PACKAGE + ".kernels.jit")
    jit.load()

    found, seen = [], set()
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith(_PACKAGE + ".kernels"):
            continue
        for value in vars(module).values():
            value = jit.resolved(value)  # a deferred kernel's dispatcher
            if isinstance(value, Dispatcher) and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def sources_digest() -> str:
    """SHA-256 over the names and contents of the kernel sources (every .py of the kernels' folder and its
    sub-folders, a family such as conv/) as they were when this process imported odtrain."""
    return _IMPORTED_DIGEST


def _kernel_sources(folder: str) -> list[str]:
    """The .py files under `folder`, as paths relative to it, sorted."""
    found = []
    for root, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if f != "__pycache__")
        found += [os.path.relpath(os.path.join(root, name), folder) for name in files if name.endswith(".py")]
    return sorted(found)


def _digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in _kernel_sources(folder):
        with open(os.path.join(folder, name), "rb") as source:
            digest.update(name.encode() + b"\0" + source.read() + b"\0")
    return digest.hexdigest()


_IMPORTED_DIGEST = _digest(kernels_dir())


def discard_stale() -> int:
    """Once per process, with the kernels imported: remove odtrain's cached kernels if they were compiled
    from other kernel sources than these. Returns how many files went."""
    global _checked
    if _checked:
        return 0
    _checked = True
    folders = {getattr(getattr(d, "_cache", None), "cache_path", None) for d in loaded_dispatchers()} - {None}
    return sum(_discard_stale_in(folder) for folder in sorted(folders))


def _discard_stale_in(folder: str) -> int:
    digest, stamp = sources_digest(), os.path.join(folder, SOURCES_STAMP)
    try:
        with open(stamp) as file:
            if file.read().strip() == digest:
                return 0
    except OSError:
        pass
    # Numba names a kernel's cache files after its source file's stem (a family folder has a cache folder of its own)
    modules = {os.path.basename(name)[:-3] for name in _kernel_sources(kernels_dir())}
    removed = 0
    try:
        os.makedirs(folder, exist_ok=True)  # Numba's own folder: the stamp goes in before the first kernel
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:
        if name.endswith((".nbi", ".nbc")) and name.split(".")[0] in modules:
            try:
                os.remove(os.path.join(folder, name))
                removed += 1
            except OSError:  # removed by another process first, or not ours to write
                pass
    try:
        partial = f"{stamp}.{os.getpid()}"
        with open(partial, "w") as file:
            file.write(digest + "\n")
        os.replace(partial, stamp)
    except OSError:
        pass
    return removed
