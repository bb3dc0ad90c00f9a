"""Loading a kernel library: its manifest checked, its symbols found, and the library for an artifact folder.

The manifest (MANIFEST_FILE, JSON, written by `odtrain compile`, odtrain/library_build/) records the odtrain,
Numba and llvmlite versions, the target triple, CPU and features, the digest of the kernel sources
(odtrain.jit.cache) and each entry's kernel, signature and symbol (and, for a parallel twin, `twin_of`: the
serial kernel it runs in parts, from kernels/parallel_split.py's TWINS).

Refused, by name, never loaded (`KernelLibrary` raises LibraryRefused, which `find` reports once and
bypasses): a library built by another odtrain version, from other kernel sources, with a Numba other than the
installed one (when one is installed), for another architecture, or for CPU features this CPU lacks
(odtrain/kernel_library/cpu.py: /proc/cpuinfo, or on aarch64 the hardware capability bits); and an artifact
folder's own kernels/ built for other artifacts (the manifest's `artifacts`: the digests of the models it was
recorded on, odtrain/kernel_library/digest.py).

`find` remembers, per artifact folder, why it gave no library; `unavailable` says it in the step's error
where Numba is not installed (the wording is odtrain/kernel_library/messages.py's).

Imports numpy and ctypes only, so that a training process with a library never loads the compiler.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

from ..kernels.blas_library import found_openblas, gemm_addresses
from ..kernels.jit import without_compiler
from ..threads import configure_without_compiler
from .abi import FOLDER, LIBRARY_ENV, LIBRARY_FILE, MANIFEST_FILE, CallList, PreparedCall, call_key, kernel_name, \
    signature_of
from .cpu import cpu_flags, host_arch, missing_features
from .digest import artifacts_digest
from .messages import built_for_other_artifacts, damaged_artifacts_record, without_library

_PREPARED_CALLS = 256  # calls outside bound steps a library keeps packed


class LibraryRefused(Exception):
    """A library that this process must not load, and why."""


class KernelLibrary:
    """A loaded library: its manifest, its symbols by (kernel name, signature), and the runner."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        manifest_path = os.path.join(self.folder, MANIFEST_FILE)
        try:
            with open(manifest_path) as file:
                self.manifest = json.load(file)
        except (OSError, ValueError) as error:
            raise LibraryRefused(f"{manifest_path}: unreadable manifest ({error})") from None
        entries = self.manifest.get("entries") if isinstance(self.manifest, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise LibraryRefused(f"{manifest_path}: damaged manifest (no list of entries); rebuild the library")
        refusal = refusal_of(self.manifest)
        if refusal:
            raise LibraryRefused(f"{self.folder}: {refusal}")
        configure_without_compiler()  # OpenMP's waiting policy, read once when libgomp loads with the library
        without_compiler()  # the bindings' helpers run as Python rather than load Numba for them
        try:
            self._dll = ctypes.CDLL(os.path.join(self.folder, LIBRARY_FILE))  # ctypes releases the GIL in calls
            self._run = self._dll.odtrain_run
        except (OSError, AttributeError) as error:  # missing, unreadable or not odtrain's shared object
            raise LibraryRefused(f"{self.folder}: {LIBRARY_FILE} cannot be loaded ({error}); rebuild the library") from None
        self._run.restype = ctypes.c_int64
        self._run.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._forked = self._dll.odtrain_regions_forked
        self._forked.restype = ctypes.c_int32
        self._dll.odtrain_set_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        found = found_openblas()
        self._dll.odtrain_set_gemm(*(gemm_addresses(found) if found else (0, 0)))
        self.entries, self._messages = {}, {}
        self._prepared: dict[tuple, PreparedCall | None] = {}  # call_key -> the call (None: not in the library)
        for index, entry in enumerate(entries):
            try:
                key = (str(entry["kernel"]), str(entry["signature"]))
                self.entries[key] = ctypes.cast(getattr(self._dll, str(entry["symbol"])), ctypes.c_void_p).value
            except (KeyError, AttributeError, ValueError) as error:  # a damaged manifest, or one of another build
                what = f"no {error}" if isinstance(error, KeyError) else f"a symbol {LIBRARY_FILE} lacks ({error})"
                raise LibraryRefused(f"{manifest_path}: entry {index} has {what}; the manifest does not describe "
                                     "this shared object: rebuild the library") from None
            errors = entry.get("errors", [])
            self._messages[key] = [str(e) for e in errors] if isinstance(errors, list) else []

    def address(self, kernel, args) -> int | None:
        """The library's function for this call, or None."""
        name = kernel_name(kernel)
        signature = signature_of(args) if name else None
        return self.entries.get((name, signature)) if signature is not None else None

    def message(self, kernel, args) -> str:
        """What a kernel that stopped on its data says (the messages its source raises)."""
        messages = self._messages.get((kernel_name(kernel), signature_of(args)), [])
        return " or ".join(messages) if messages else f"kernel {kernel_name(kernel)} stopped on its data"

    def run(self, calls: CallList, threads: int) -> int:
        """Run the calls in order; the index of the first that failed, or -1."""
        return self._run(calls.count, calls.functions, calls.blocks, threads)

    def call(self, kernel, args, threads: int = 1) -> bool:
        """Run one call through the library if it holds it (False if not); a failure raises ValueError.
        The call is prepared once for its arrays (`call_key`); later calls on the same arrays only write
        their scalars, so that an optimizer update costs no more to start than the JIT's dispatch. Two
        threads updating the same arrays at once would race on the block as they race on the arrays."""
        key = call_key(kernel, args)
        prepared = self._prepared.get(key, False)
        if prepared is False:
            address = self.address(kernel, args)
            prepared = PreparedCall(address, args) if address is not None else None
            if len(self._prepared) >= _PREPARED_CALLS:  # arrays come and go: forget the old ones
                self._prepared.clear()
            self._prepared[key] = prepared
        elif prepared is not None:
            prepared.set_scalars(args)
        if prepared is None:
            return False
        if self._run(1, prepared.functions, prepared.blocks, threads) >= 0:
            raise ValueError(self.message(kernel, args))
        return True

    def regions_forked(self) -> bool:
        """Whether this process was forked after the library ran a parallel region (it then runs serially)."""
        return bool(self._forked())


def refusal_of(manifest: dict) -> str:
    """Why a library with this manifest must not be loaded here ('' when it may be)."""
    from .. import __version__
    from ..jit.cache import sources_digest

    if manifest.get("odtrain") != __version__:
        return f"built by odtrain {manifest.get('odtrain')}, this is odtrain {__version__}"
    if manifest.get("kernel_sources") != sources_digest():
        return "built from other kernel sources than these (odtrain/kernels changed since)"
    numba = installed_version("numba") if compiler_installed() else None  # a device: no metadata read at all
    if numba is not None and manifest.get("numba") != numba:
        return f"built with Numba {manifest.get('numba')}, the installed Numba is {numba}"
    machine, here = str(manifest.get("triple", "")).split("-")[0], host_arch()
    if machine != here:
        return f"built for {machine}, this machine is {here}"
    flags = cpu_flags(here)
    missing = missing_features(here, str(manifest.get("features") or ""), flags) if flags is not None else []
    if missing:
        return f"built for {manifest.get('cpu')}: CPU features {', '.join(missing)}, which this CPU lacks"
    return ""


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, without importing it."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def compiler_installed() -> bool:
    """Whether Numba can be imported here, to compile the kernels a library lacks (without importing it)."""
    from importlib.util import find_spec

    try:
        return find_spec("numba") is not None and find_spec("llvmlite") is not None
    except (ImportError, ValueError):
        return False


_loaded: dict[str, KernelLibrary | None] = {}


def forget(folder) -> None:
    """Let the next `find` look at `folder` again (a library built or damaged there since this process looked)."""
    _loaded.pop(os.fspath(folder), None)
_why_none: dict[str, str] = {}  # artifact folder -> why find gave it no library
_refusals: dict[str, str] = {}  # library folder -> why it was refused ('' when it has no manifest)


def _own_library_mismatch(folder: str, artifact_folder) -> str:
    """Why an artifact folder's own kernels/ library does not belong to its artifacts ('' when it does, or when
    its manifest records no artifacts)."""
    try:
        with open(os.path.join(folder, MANIFEST_FILE)) as file:
            manifest = json.load(file)
    except (OSError, ValueError):
        return ""
    recorded = manifest.get("artifacts") if isinstance(manifest, dict) else None
    if not recorded:
        return ""
    if not isinstance(recorded, list) or not all(isinstance(entry, dict) for entry in recorded):
        return damaged_artifacts_record(folder, artifact_folder)
    digest = artifacts_digest(artifact_folder)
    if digest is None or digest in {entry.get("digest") for entry in recorded}:
        return ""
    return built_for_other_artifacts(folder, ", ".join(str(entry.get("folder", "?")) for entry in recorded),
                                     artifact_folder)


def find(artifact_folder=None) -> KernelLibrary | None:
    """The library for a model in `artifact_folder`: its `kernels/` folder (refused when it was built for other
    artifacts), else the folder ODTRAIN_KERNEL_LIBRARY names; None when there is none, or when it was refused
    (said once, on stderr, where Numba compiles the kernels instead; without Numba, `unavailable` says it
    in the step's error)."""
    key = os.path.abspath(os.fspath(artifact_folder)) if artifact_folder is not None else None
    if os.environ.get(LIBRARY_ENV, "").strip().lower() == "off":
        _why_none[key] = f"{LIBRARY_ENV}=off"
        return None
    candidates = []
    if artifact_folder is not None:
        candidates.append((os.path.join(os.fspath(artifact_folder), FOLDER), True))
    if os.environ.get(LIBRARY_ENV):
        candidates.append((os.environ[LIBRARY_ENV], False))
    reasons = []
    for folder, own in candidates:
        folder = os.path.abspath(folder)
        if folder not in _loaded:
            if not os.path.isfile(os.path.join(folder, MANIFEST_FILE)):
                _loaded[folder] = None
                _refusals[folder] = ""
                continue
            try:
                mismatch = _own_library_mismatch(folder, artifact_folder) if own else ""
                if mismatch:
                    raise LibraryRefused(mismatch)
                _loaded[folder] = KernelLibrary(folder)
            except LibraryRefused as refused:
                _refusals[folder] = str(refused)
                if compiler_installed():
                    print(f"odtrain: kernel library refused: {refused}; its kernels compile through Numba instead",
                          file=sys.stderr)
                _loaded[folder] = None
        if _loaded[folder] is not None:
            _why_none.pop(key, None)
            return _loaded[folder]
        reasons.append(f"kernel library refused: {_refusals[folder]}" if _refusals.get(folder) else
                       f"no kernel library in {folder}")
    _why_none[key] = "; ".join(reasons) or "no kernel library"
    return None


def unavailable(artifact_folder) -> str:
    """The one line of a step that has no library and no Numba: why there is no library, and what builds it."""
    key = os.path.abspath(os.fspath(artifact_folder)) if artifact_folder is not None else None
    return without_library(_why_none.get(key, "no kernel library"), artifact_folder)


def library_folder_of(library: KernelLibrary) -> str | None:
    """The artifact folder a library sits in (its kernels/ folder's parent), or None for one elsewhere."""
    folder = getattr(library, "folder", None)
    return os.path.dirname(folder) if folder and os.path.basename(folder) == FOLDER else None
