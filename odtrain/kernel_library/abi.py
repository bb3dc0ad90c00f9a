"""How a call crosses into the kernel library: what a library folder holds, how a kernel and its arguments
are named, and how a call's arguments are packed.

A library folder (FOLDER beside the artifacts, or the one LIBRARY_ENV names) holds LIBRARY_FILE, the shared
object, and MANIFEST_FILE, its JSON description (odtrain/kernel_library/loader.py checks it). The shared object
exports one `int32 k(void **arguments)` wrapper per (kernel, signature), the runner `odtrain_run` and the
launcher (odtrain/library_build/launcher.c).

A kernel call is (kernel, args): the kernel is named by its module and qualified name (`kernel_name`), its
arguments by a signature string (`signature_of`) that says what Numba's typeof would: an array's dtype, rank,
layout ('C', 'F' or 'A'), read-only and unaligned flags; a scalar's type (a Python int is int64, a float
float64, a bool bool); a tuple of scalars, theirs in parentheses. A call's arguments are packed once, when a
step is bound, into one int64 block (`pack`): a pointer per argument, then each argument's record (an array:
data address, shape, strides in bytes; a scalar: its value in its own dtype, in one word; a tuple: a word per
item). A step's calls then run in one foreign call over a `CallList`; a call outside a step (an optimizer
update) is packed once for its arrays and later only gets its scalars written (`PreparedCall`).

Invariant: a block holds the addresses of the arrays it was packed from, so whoever runs it keeps them alive
(CallList holds the blocks; the executor holds the arena). Imports numpy only.
"""
from __future__ import annotations

import numpy as np

LIBRARY_FILE = "libodtrain_kernels.so"
MANIFEST_FILE = "manifest.json"
FOLDER = "kernels"  # the library's folder inside an artifact folder
LIBRARY_ENV = "ODTRAIN_KERNEL_LIBRARY"  # a library folder to use when the artifact folder has none; "off": none
_SCALARS = {bool: "bool", int: "int64", float: "float64"}


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
