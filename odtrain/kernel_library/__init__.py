"""The kernel library: odtrain's kernels built ahead of time into one shared object, loaded with ctypes.

`odtrain compile` (odtrain/library_build/) writes a folder `kernels/` beside the artifacts:
- LIBRARY_FILE, the shared object: one exported `int32 k(void **arguments)` wrapper per (kernel,
  signature), the runner `odtrain_run` and the launcher (odtrain/library_build/launcher.c);
- MANIFEST_FILE, JSON: the odtrain, Numba and llvmlite versions, the target triple, CPU and features,
  the digest of the kernel sources (odtrain.jit.cache) and each entry's kernel, signature and symbol
  (and, for a parallel twin, `twin_of`: the serial kernel it runs in parts, from kernels/parallel_split.py's TWINS).

A kernel call is (kernel, args): the kernel is named by its module and qualified name (`kernel_name`),
its arguments by a signature string (`signature_of`) that says what Numba's typeof would: an array's
dtype, rank, layout ('C', 'F' or 'A'), read-only and unaligned flags; a scalar's type (a Python int
is int64, a float float64, a bool bool); a tuple of scalars, theirs in parentheses. `KernelLibrary.prepare` packs one call's arguments once, when
a step is bound, into one int64 block: a pointer per argument, then each argument's record (an array:
data address, shape, strides in bytes; a scalar: its value in its own dtype, in one word; a tuple: a
word per item). A step's calls then run
in one foreign call (`Program`, a `CallList`), the GIL released. A call outside a step (an optimizer
update) is prepared once for its arrays and later only gets its scalars written (`PreparedCall`).

Refused, by name, never loaded (`load` raises LibraryRefused, which `find` reports once and bypasses):
a library built by another odtrain version, from other kernel sources, with a Numba other than the
installed one (when one is installed), for another architecture, or for CPU features this CPU lacks
(odtrain/kernel_library/cpu.py: /proc/cpuinfo, or on aarch64 the hardware capability bits); and an artifact
folder's own kernels/ built for other artifacts (the manifest's `artifacts`: the digests of the models
it was recorded on, `artifacts_digest`).

Where Numba is not installed (a device), a step whose kernels no library holds cannot run: the executor
raises KernelsUnavailableError before the step's first call, in one line that names why (no library, a
refused one: `unavailable`) or the node, kernel and argument types the library lacks (`missing_kernel`),
and the `odtrain compile` command that builds them (`compile_command`); a refusal is then said in that
line only.

Imports numpy and ctypes only, so that a training process with a library never loads the compiler.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys

import numpy as np

from ..kernels.blas_library import found_openblas, gemm_addresses
from .cpu import cpu_flags, host_arch, missing_features
from ..kernels.jit import without_compiler
from ..threads import configure_without_compiler

LIBRARY_FILE = "libodtrain_kernels.so"
MANIFEST_FILE = "manifest.json"
FOLDER = "kernels"  # the library's folder inside an artifact folder
LIBRARY_ENV = "ODTRAIN_KERNEL_LIBRARY"  # a library folder to use when the artifact folder has none; "off": none
_SCALARS = {bool: "bool", int: "int64", float: "float64"}
_PREPARED_CALLS = 256  # calls outside bound steps a library keeps packed


class LibraryRefused(Exception):
    """A library that this process must not load, and why."""


def kernel_name(kernel) -> str | None:
    """'module:qualified name' of a Numba kernel (or a placeholder of one), else None."""
    function = getattr(kernel, "py_func", None)
    if function is None:
        return None
    return f"{function.__module__}:{function.__qualname__}"


def argument_type(value) -> str | None:
    """What Numba's typeof says of one argument, as text; None for a kind the library does not pass."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf" or not value.dtype.isnative:
            return None
        flags = value.flags
        layout = "C" if flags.c_contiguous else "F" if flags.f_contiguous else "A"
        return f"{value.dtype.name}[{value.ndim}{layout}{'' if flags.writeable else 'r'}{'' if flags.aligned else 'u'}]"
    if isinstance(value, tuple):  # of scalars: Numba's UniTuple or Tuple
        kinds = [_scalar_type(v) for v in value]
        return None if None in kinds else "(" + ",".join(kinds) + ")"
    return _scalar_type(value)


def _scalar_type(value) -> str | None:
    kind = _SCALARS.get(type(value))
    if kind is not None:
        return kind
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return "bool" if value.dtype.kind == "b" else value.dtype.name
    return None


def signature_of(args) -> str | None:
    """The signature text of a call's arguments, or None when one of them cannot be passed."""
    kinds = [argument_type(a) for a in args]
    return None if None in kinds else ",".join(kinds)


def _record(value) -> list[int]:
    """One argument's record, as int64 words."""
    if isinstance(value, np.ndarray):
        return [value.ctypes.data, *value.shape, *value.strides]
    if isinstance(value, tuple):
        return [word for item in value for word in _record(item)]
    kind = argument_type(value)
    word = np.zeros(1, dtype=np.int64)
    word.view(np.uint8)[:np.dtype(kind if kind != "bool" else np.uint8).itemsize] = \
        np.array([value], dtype=kind if kind != "bool" else np.uint8).view(np.uint8)
    return [int(word[0])]


def pack(args) -> np.ndarray:
    """The argument block of one call: the address of each argument's record, then the records."""
    return _packed(args)[0]


def _packed(args) -> tuple[np.ndarray, list[int]]:
    """(the argument block of one call, the word at which each argument's record starts)."""
    records = [_record(a) for a in args]
    block = np.zeros(len(args) + sum(len(r) for r in records), dtype=np.int64)
    base, offset, starts = block.ctypes.data, len(args), []
    for index, record in enumerate(records):
        block[index] = base + 8 * offset
        block[offset:offset + len(record)] = record
        starts.append(offset)
        offset += len(record)
    return block, starts


class CallList:
    """Calls functions[i](blocks[i]) as the runner takes them: the argument blocks packed once, and the
    addresses of the two lists taken once (reading an array's address costs about a microsecond)."""

    __slots__ = ("count", "functions", "blocks", "_arrays")

    def __init__(self, functions: list[int], blocks: list[np.ndarray]):
        function_array = np.array(functions, dtype=np.uint64)
        block_array = np.array([block.ctypes.data for block in blocks], dtype=np.uint64)
        self._arrays = (function_array, block_array, blocks)  # alive as long as the addresses are used
        self.count, self.functions, self.blocks = len(functions), function_array.ctypes.data, block_array.ctypes.data


class PreparedCall(CallList):
    """One call whose arrays stay and whose scalars change from call to call (an optimizer update: its
    learning rate and step): `set_scalars(args)` writes them into the packed block in place."""

    __slots__ = ("_slots",)

    def __init__(self, address: int, args):
        block, starts = _packed(args)
        super().__init__([address], [block])
        self._slots = []  # (argument index, the block viewed as the scalar's type, its index there)
        for index, value in enumerate(args):
            if not isinstance(value, (np.ndarray, tuple)):
                dtype = np.dtype(np.uint8 if argument_type(value) == "bool" else argument_type(value))
                self._slots.append((index, block.view(dtype), starts[index] * 8 // dtype.itemsize))

    def set_scalars(self, args) -> None:
        for index, view, position in self._slots:
            view[position] = args[index]


def call_key(kernel, args) -> tuple:
    """What decides a call's function and argument block, its scalars' values aside: the kernel, each array's
    address, read-only flag, type, shape and strides (numpy's array interface: what Numba's typeof reads, and
    where the data is), each scalar's type, each tuple of scalars (geometry) with its items' types."""
    key = [kernel]
    for value in args:
        if isinstance(value, np.ndarray):
            interface = value.__array_interface__
            key.append((interface["data"], interface["typestr"], interface["shape"], interface["strides"]))
        elif isinstance(value, tuple):
            key.append((value, tuple(map(type, value))))
        else:
            key.append(type(value))
    return tuple(key)


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


_reported: set = set()


def report_missing(calls) -> None:
    """Say once, on stderr and in the progress bar drawn now (odtrain.progress.announce), how many kernels of
    these calls (which a library lacks) compile through Numba."""
    from ..jit.ahead import FALLBACK_MESSAGE
    from ..progress import announce

    new = {(kernel_name(k) or repr(k), signature_of(a)) for k, a in calls if hasattr(k, "py_func")} - _reported
    if new:
        _reported.update(new)
        announce(f"odtrain: {FALLBACK_MESSAGE.format(count=len(new))}")


def compiler_installed() -> bool:
    """Whether Numba can be imported here, to compile the kernels a library lacks (without importing it)."""
    from importlib.util import find_spec

    try:
        return find_spec("numba") is not None and find_spec("llvmlite") is not None
    except (ImportError, ValueError):
        return False


MODEL_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")  # artifact_paths' names


def artifacts_digest(folder) -> str | None:
    """sha256 over an artifact folder's models (not its checkpoint, which training changes), or None when it
    has no training model: what a library records of the artifacts it was built for."""
    digest, found = hashlib.sha256(), False
    for name in MODEL_FILES:
        path = os.path.join(os.fspath(folder), name)
        if os.path.isfile(path):
            found = found or name == MODEL_FILES[0]
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest() if found else None


def compile_command(artifact_folder) -> str:
    """The command that builds the library of `artifact_folder` for this machine, run where Numba is (the
    desktop, for another architecture)."""
    from .cpu import DEFAULT_CPU

    here = host_arch()
    target = f" --target {here}" if here in DEFAULT_CPU else ""
    folder = os.fspath(artifact_folder) if artifact_folder is not None else "ARTIFACT_DIR"
    return f"`odtrain compile {folder}{target}` (on a machine with odtrain's dependencies; its kernels/ folder " \
           f"then goes to {os.path.join(folder, FOLDER)} here)"


_loaded: dict[str, KernelLibrary | None] = {}
_why_none: dict[str, str] = {}  # artifact folder -> why find gave it no library


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
        return f"{folder}: damaged manifest (its 'artifacts' is not a list of records); rebuild it with " \
               f"{compile_command(artifact_folder)}"
    digest = artifacts_digest(artifact_folder)
    if digest is None or digest in {entry.get("digest") for entry in recorded}:
        return ""
    built_for = ", ".join(str(entry.get("folder", "?")) for entry in recorded)
    return (f"{folder}: built for other artifacts ({built_for}; their models differ from these): rebuild it with "
            f"{compile_command(artifact_folder)}")


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


_refusals: dict[str, str] = {}  # library folder -> why it was refused ('' when it has no manifest)


def unavailable(artifact_folder) -> str:
    """The one line of a step that has no library and no Numba: why there is no library, and what builds it."""
    key = os.path.abspath(os.fspath(artifact_folder)) if artifact_folder is not None else None
    why = _why_none.get(key, "no kernel library")
    return (f"{why}, and Numba is not installed to compile the kernels instead: build the library with "
            f"{compile_command(artifact_folder)}")


def library_folder_of(library: KernelLibrary) -> str | None:
    """The artifact folder a library sits in (its kernels/ folder's parent), or None for one elsewhere."""
    folder = getattr(library, "folder", None)
    return os.path.dirname(folder) if folder and os.path.basename(folder) == FOLDER else None


def missing_kernel(where: str, kernel, args, library: KernelLibrary, artifact_folder, others: int = 0) -> str:
    """The one line of a call that `library` lacks where Numba is not installed."""
    more = f" (and {others} more call{'s' if others != 1 else ''} it lacks)" if others else ""
    return (f"{where}: kernel {kernel_name(kernel)}({signature_of(args)}) is not in the kernel library "
            f"{library.folder}{more}, and Numba is not installed to compile it: rebuild the library with "
            f"{compile_command(artifact_folder)}")
