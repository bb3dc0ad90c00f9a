"""The kernel sources, and cached kernels compiled from other sources than these.

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

Imports nothing of odtrain's.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys

SOURCES_STAMP = "odtrain-kernel-sources.sha256"
_PACKAGE = __package__ or "odtrain"
_CHECKOUT_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
_checked = False


def kernels_dir() -> str:
    """The folder holding the kernel sources: odtrain/kernels installed, kernels/ in a checkout."""
    installed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
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
    """SHA-256 over the names and contents of the kernel sources (every .py of the kernels' folder) as
    they were when this process imported odtrain."""
    return _IMPORTED_DIGEST


def _digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
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
    modules = {name[:-3] for name in os.listdir(kernels_dir()) if name.endswith(".py")}
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
