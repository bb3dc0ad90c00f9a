"""The checkpoint file: safetensors tensors plus versioned, checksummed metadata.

Layout (a safetensors file):
- tensors `param/<name>` for every parameter, and `optimizer/<name>/<state>`
  (e.g. momentum0, momentum1) for each trainable parameter when saved;
- metadata strings: `format` = "odtrain-checkpoint", `format_version`,
  `trainable`/`frozen` (JSON name lists, in order), `properties` (JSON of
  {name: [type, value]}), `optimizer` (JSON: kind, step, learning rates) when
  saved, `random` (JSON: the run's seed and how many training steps drew
  random numbers, so a resumed run's Dropout masks continue the stream) when
  not both 0, `nominal` ("1": shapes only, values to be supplied later) with
  `shapes`, `int4` (JSON {name: shape}) for the frozen weights held as 4-bit
  integers (graph/int4.py), each stored as its packed bytes (safetensors has
  no 4-bit type: a 1-D U8 tensor of ⌈size / 2⌉ bytes, ONNX's packing), and
  `sha256` over every tensor's name, dtype, shape and bytes and
  (from format version 2) every other metadata entry; version 1 files, whose
  checksum covers the tensors only, are still read.

Loading holds no second copy: the header and the checksum are read from the
file (the checksum streamed in blocks), then the tensors are views of one
copy-on-write mapping of the file, so a frozen parameter costs page cache the
kernel can drop, not memory of its own; `read_into` reads a tensor's bytes
straight into a buffer (the trainable block) without touching the mapping.
A save replaces the file by renaming, so a mapping keeps the old file's bytes.

Guarantees: nothing is unpickled or evaluated; a truncated, damaged, foreign
or newer-version file is refused with the reason; saving writes a temporary
file `.<name>.<random>.tmp` in the same folder, flushes and fsyncs it, gives it
the mode a new file gets (0666 less the umask, as the ONNX files), renames
it over the target and fsyncs the folder, so a crash leaves either the old or
the new file. Just before the rename, the file it replaces becomes `<name>.previous` (a hard link,
renamed into place): a checkpoint damaged after it was written (a copy, a card) has the save before
it to resume from, which the refusal names. A save first removes the temporary files that earlier saves of
the same file left when they were killed: a writer holds an exclusive `flock`
on its temporary file, so a file nobody holds is stale (the kernel drops a
dead process's locks); without `fcntl` (Windows) nothing is removed.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: stale temporary files are left alone
    fcntl = None

from .graph.errors import ArtifactNotFoundError, CheckpointError
from .graph.int4 import PackedInt4

FORMAT = "odtrain-checkpoint"
FORMAT_VERSION = 2
CHECKSUM_COVERS_METADATA = {"1": False, "2": True}  # every version this odtrain reads
PARAM_PREFIX = "param/"
OPTIMIZER_PREFIX = "optimizer/"
PREVIOUS_SUFFIX = ".previous"  # each save keeps the checkpoint it replaces beside it, under this suffix
READ_BLOCK = 1 << 20  # bytes read at a time when the checksum streams the file
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "|i1",
          "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "|u1", "BOOL": "|b1"}  # safetensors' names
BFLOAT16 = "BF16"  # frozen weights stored as bfloat16 (odtrain.graph.frozen): ml_dtypes' type, imported then
INT4 = "I4"  # a nominal checkpoint's 4-bit weights (stored ones are packed U8 bytes, listed in metadata `int4`)


def element_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors element type (KeyError for one a checkpoint does not hold)."""
    if code == BFLOAT16:
        import ml_dtypes  # numpy has no bfloat16; onnx depends on ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[code])


def _int4() -> np.dtype:
    import ml_dtypes  # as for bfloat16: not through onnx, which a device that trains does not import

    return np.dtype(ml_dtypes.int4)


def element_code(dtype: np.dtype) -> str | None:
    """The safetensors element type of a numpy dtype, or None."""
    if dtype.name == "bfloat16":
        return BFLOAT16
    if dtype.name == "int4":
        return INT4
    return next((k for k, v in DTYPES.items() if np.dtype(v) == dtype), None)


@dataclass(frozen=True)
class Stored:
    """Where a tensor's bytes are in a checkpoint file."""

    dtype: np.dtype
    shape: tuple
    offset: int  # from the start of the file
    nbytes: int


class MappedFile:
    """An open checkpoint file, its stored tensors and one copy-on-write mapping of it."""

    def __init__(self, path: str, file, stored: dict[str, Stored]):
        self.path, self.file, self.stored = path, file, stored
        self.mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)

    def array(self, key: str) -> np.ndarray:
        """The tensor `key` as a view of the mapping (writable: a write copies only the pages it touches)."""
        entry = self.stored[key]
        return np.frombuffer(self.mapping, entry.dtype, int(np.prod(entry.shape, dtype=np.int64)),
                             entry.offset).reshape(entry.shape)

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read the bytes of tensor `key` from the file straight into the contiguous array `out`."""
        entry = self.stored[key]
        if out.nbytes != entry.nbytes or out.dtype != entry.dtype:
            raise CheckpointError(f"checkpoint '{self.path}': tensor '{key}' is {entry.dtype} {entry.shape}, "
                                  f"the buffer it should fill is {out.dtype} {out.shape}")
        self._read(memoryview(out.reshape(-1)).cast("B"), entry.offset)

    def chunks(self, key: str):
        """The bytes of tensor `key`, read from the file in blocks of at most READ_BLOCK (one reused buffer)."""
        entry = self.stored[key]
        block = memoryview(bytearray(min(READ_BLOCK, entry.nbytes)))
        for start in range(0, entry.nbytes, READ_BLOCK):
            view = block[:min(READ_BLOCK, entry.nbytes - start)]
            self._read(view, entry.offset + start)
            yield view

    def _read(self, view: memoryview, offset: int) -> None:
        self.file.seek(offset)
        done = 0
        while done < len(view):
            count = self.file.readinto(view[done:])
            if not count:
                raise CheckpointError(f"checkpoint '{self.path}' is truncated (it shrank while being read)")
            done += count


@dataclass
class CheckpointContents:
    parameters: dict[str, np.ndarray]
    trainable: list[str]
    properties: dict = field(default_factory=dict)
    optimizer: dict | None = None  # kind, step, learning_rate, initial_learning_rate
    optimizer_tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # state -> name -> array
    nominal: bool = False
    source: MappedFile | None = None  # the file the arrays are views of, when loaded from one
    random: dict | None = None  # the run's seed and the training steps that drew random numbers (Dropout)


class Streamed(NamedTuple):
    """A tensor hashed from blocks of its bytes rather than from an array."""

    dtype: np.dtype
    shape: tuple
    chunks: Iterable


def _digest(tensors: dict, metadata: dict[str, str] | None) -> str:
    """sha256 over the tensors (arrays or Streamed), then over the metadata entries other than the digest
    itself (if given)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name]
        h.update(f"{name}|{value.dtype.str}|{tuple(value.shape)}|".encode())
        for chunk in value.chunks if isinstance(value, Streamed) else [np.ascontiguousarray(value).reshape(-1)]:
            h.update(chunk.view(np.uint8) if isinstance(chunk, np.ndarray) else chunk)
    if metadata is not None:
        h.update(json.dumps(sorted((k, v) for k, v in metadata.items() if k != "sha256")).encode())
    return h.hexdigest()


def _refuse(path: str, reason: str):
    raise CheckpointError(f"checkpoint '{path}' is {reason}; it cannot be loaded. odtrain replaces a checkpoint "
                          "only with a whole one, so this file was cut short or changed after it was written (a "
                          f"copy, a download, a full disk): {recovery(path)}")


def recovery(path: str) -> str:
    """What to do about a damaged checkpoint at `path`: resume from the save before it, kept beside it, when
    there is one; else copy it again or start anew."""
    previous = path + PREVIOUS_SUFFIX
    if os.path.isfile(previous):
        return (f"the save before it is kept as '{previous}': copy that over it (cp '{previous}' '{path}') and "
                "train again with --resume (odtrain.training.fit(..., resume=True)) to continue from there, or load "
                f"it directly (CheckpointState.load_checkpoint('{previous}'))")
    return ("copy it again from where it came from, or start from the artifacts' initial checkpoint (odtrain prepare "
            "writes it again, and every save after that keeps the one before it as "
            f"'{os.path.basename(previous)}')")


def _read_header(file, size: int, path: str) -> tuple[dict, int]:
    """A checkpoint's safetensors header and where its data starts, after checking that it is odtrain's and
    readable."""
    def refuse(reason: str):
        _refuse(path, reason)

    if size < 8:
        refuse("truncated (shorter than its header)")
    (header_len,) = struct.unpack("<Q", file.read(8))
    if header_len > size - 8:
        refuse("truncated (its header runs past the end of the file)")
    try:
        header = json.loads(file.read(header_len))
    except (UnicodeDecodeError, ValueError):
        refuse("damaged (its header is not valid JSON)")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        refuse("not an odtrain checkpoint (no odtrain format tag; ONNX Runtime's flatbuffer checkpoints are not read)")
    version = metadata.get("format_version", "")
    version = version if isinstance(version, str) else repr(version)
    if version.isdigit() and int(version) > FORMAT_VERSION:
        refuse(f"of format version {version!r}, newer than this odtrain reads ({FORMAT_VERSION}); upgrade odtrain")
    if version not in CHECKSUM_COVERS_METADATA:
        refuse(f"damaged (its format version {version!r} is none that odtrain wrote)")
    return header, 8 + header_len


def _stored(header: dict, start: int, size: int, path: str) -> dict[str, Stored]:
    """Where each tensor of the header is, after checking that their bytes tile the data exactly."""
    stored, spans = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = element_dtype(entry["dtype"]), tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            _refuse(path, f"damaged (tensor '{key}' has no valid dtype, shape and offsets)")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes:
            _refuse(path, f"damaged (tensor '{key}' holds {end - begin} bytes, its shape needs {nbytes})")
        stored[key] = Stored(dtype, shape, start + begin, nbytes)
        spans.append((begin, end))
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            _refuse(path, "damaged (its tensors overlap or leave gaps)")
        cursor = end
    if start + cursor != size:
        _refuse(path, "truncated (its tensors run past the end of the file)" if start + cursor > size
                else "damaged (bytes follow its last tensor)")
    return stored


def _open(path: str) -> tuple[MappedFile, dict[str, str]]:
    """The checkpoint at `path` mapped, and its metadata, after checking its checksum by reading the file."""
    file = open(path, "rb")
    try:
        size = os.fstat(file.fileno()).st_size
        header, start = _read_header(file, size, path)
        metadata = header["__metadata__"]
        source = MappedFile(path, file, _stored(header, start, size, path))
        tensors = {k: Streamed(e.dtype, e.shape, source.chunks(k)) for k, e in source.stored.items()}
        covered = metadata if CHECKSUM_COVERS_METADATA[metadata["format_version"]] else None
        if metadata.get("sha256") != _digest(tensors, covered):
            raise CheckpointError(f"checkpoint '{path}' is damaged: its tensors or metadata do not match the "
                                  f"checksum it was saved with; it cannot be loaded: {recovery(path)}")
    except BaseException:
        file.close()
        raise
    return source, metadata


def _json(metadata: dict, key: str, path: str, default=None):
    if key not in metadata:
        return default
    try:
        return json.loads(metadata[key])
    except ValueError:
        raise CheckpointError(f"checkpoint '{path}' is damaged (metadata '{key}' is not valid JSON)") from None


def _locked_temporary(folder: str, name: str) -> tuple[int, str]:
    """A new temporary file `.<name>.<random>.tmp` in `folder`, open and locked against removal as stale."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:  # not removed as stale between its creation and the lock
            return fd, tmp
        os.close(fd)


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporary files of earlier saves of `path` whose writers are gone; returns their names."""
    if fcntl is None:
        return []
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(name)}\.[A-Za-z0-9_]{{8}}\.tmp")  # tempfile.mkstemp's random part
    removed = []
    for entry in os.listdir(folder):
        if not pattern.fullmatch(entry):
            continue
        candidate = os.path.join(folder, entry)
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except OSError:  # removed meanwhile, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(candidate)
            removed.append(entry)
        except OSError:  # a live save holds it
            pass
        finally:
            os.close(fd)
    return removed


def _umask() -> int:
    """The process's umask (read by setting it and setting it back: the only portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def keep_previous(path: str) -> None:
    """Make `path + PREVIOUS_SUFFIX` the file now at `path` (nothing when there is none), replaced atomically: a
    hard link (no bytes copied; the file's mode and a mapping of it stay), or a copy where the file system has
    no hard links (FAT)."""
    if not os.path.isfile(path):
        return
    previous = path + PREVIOUS_SUFFIX
    remove_stale_temporaries(previous)
    if os.path.isfile(previous) and os.path.samefile(path, previous):
        # already kept (a save killed between this and its rename leaves both names on one file); renaming a
        # link over another link of the same file does nothing, and would leave the link behind
        return
    folder, name = os.path.split(os.path.abspath(previous))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")  # remove_stale_temporaries' pattern
    try:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, previous)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def write_atomically(path: str, blob, keep: bool = False) -> None:
    """Write `blob` (bytes, or a function writing to a binary file) to `path` so that a crash at any moment
    leaves the old file or the new one, whole; first remove the temporary files that killed earlier saves of
    `path` left behind. `keep`: the file it replaces becomes `path + PREVIOUS_SUFFIX` (keep_previous) just
    before, so that a crash leaves that one whole too."""
    folder = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = _locked_temporary(folder, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:  # closing it releases the lock: after the rename
            blob(f) if callable(blob) else f.write(blob)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would keep the file from other readers
            if keep:
                keep_previous(path)
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(path, contents: CheckpointContents, keep_previous: bool = True) -> None:
    """Write `contents` to `path`; the checkpoint it replaces stays as `path + PREVIOUS_SUFFIX` (keep_previous),
    or, with keep_previous=False (the first checkpoint of new artifacts), any such file is removed: it would
    belong to other artifacts."""
    path = os.fspath(path)
    tensors: dict[str, np.ndarray] = {}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                "trainable": json.dumps(contents.trainable),
                "frozen": json.dumps([n for n in contents.parameters if n not in contents.trainable]),
                "properties": json.dumps({k: [type(v).__name__, v] for k, v in contents.properties.items()})}
    if contents.nominal:
        metadata["nominal"] = "1"
        metadata["shapes"] = json.dumps({n: [element_code(a.dtype), list(a.shape)] for n, a in contents.parameters.items()})
    else:
        packed = {name: list(a.shape) for name, a in contents.parameters.items() if isinstance(a, PackedInt4)}
        if packed:
            metadata["int4"] = json.dumps(packed)
        for name, array in contents.parameters.items():
            tensors[PARAM_PREFIX + name] = array.packed if isinstance(array, PackedInt4) else array
    if contents.random:
        metadata["random"] = json.dumps(contents.random)
    if contents.optimizer is not None:
        metadata["optimizer"] = json.dumps(contents.optimizer)
        for state_name, per_param in contents.optimizer_tensors.items():
            for name, array in per_param.items():
                tensors[f"{OPTIMIZER_PREFIX}{name}/{state_name}"] = array
    metadata["sha256"] = _digest(tensors, metadata)
    write_atomically(path, _safetensors_writer(tensors, metadata), keep=keep_previous)
    if not keep_previous and os.path.lexists(path + PREVIOUS_SUFFIX):
        os.unlink(path + PREVIOUS_SUFFIX)


def _safetensors_writer(tensors: dict[str, np.ndarray], metadata: dict[str, str]):
    """A function writing a safetensors file of `tensors` tensor by tensor (no whole-file buffer): the data
    ordered by element size, largest first, then by name, so every tensor sits aligned to its element."""
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header, cursor = {"__metadata__": metadata}, 0
    for key in order:
        array = tensors[key]
        code = element_code(array.dtype)
        if code is None:
            raise CheckpointError(f"tensor '{key}' is {array.dtype}, a type a checkpoint does not hold; store it as "
                                  f"one of {', '.join(sorted(DTYPES) + [BFLOAT16])}")
        header[key] = {"dtype": code, "shape": list(array.shape),
                       "data_offsets": [cursor, cursor + array.nbytes]}
        cursor += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f) -> None:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            f.write(np.ascontiguousarray(tensors[key]).reshape(-1).view(np.uint8))

    return write


def _packed(path: str, name: str, stored, shape) -> PackedInt4:
    """Parameter `name`'s packed 4-bit bytes as the tensor of `shape` the metadata gives, or CheckpointError."""
    try:
        if stored is None or stored.dtype != np.uint8 or stored.ndim != 1:
            raise ValueError
        return PackedInt4(stored, shape, _int4())
    except (ValueError, TypeError):
        got = "nothing" if stored is None else f"{stored.dtype} {list(stored.shape)}"
        raise CheckpointError(f"checkpoint '{path}' is damaged: 4-bit parameter '{name}' of shape {shape} needs "
                              f"packed uint8 bytes [(size + 1) // 2], it holds {got}; it cannot be loaded") from None


def load(path) -> CheckpointContents:
    """The checkpoint at `path`; its stored tensors are views of a copy-on-write mapping of the file
    (`contents.source`), read from disk only when used."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactNotFoundError(f"checkpoint file '{path}' does not exist")
    source, metadata = _open(path)
    tensors = {key: source.array(key) for key in source.stored}
    trainable = _json(metadata, "trainable", path, [])
    frozen = _json(metadata, "frozen", path, [])
    names = list(trainable) + list(frozen)
    nominal = metadata.get("nominal") == "1"
    parameters = {}
    if nominal:
        shapes = _json(metadata, "shapes", path, {})
        for name in names:
            dtype, shape = shapes.get(name, ["F32", None])
            if shape is None:
                raise CheckpointError(f"checkpoint '{path}' is damaged (no shape for nominal parameter '{name}')")
            if dtype == INT4:
                parameters[name] = PackedInt4(np.zeros((int(np.prod(shape)) + 1) // 2, np.uint8), shape, _int4())
                continue
            parameters[name] = np.zeros(shape, dtype=element_dtype(dtype) if dtype in DTYPES or dtype == BFLOAT16
                                        else np.dtype(dtype))  # numpy's names in files written before
    else:
        for name in names:
            if PARAM_PREFIX + name not in tensors:
                raise CheckpointError(f"checkpoint '{path}' is damaged (parameter '{name}' is listed but not stored)")
            parameters[name] = tensors[PARAM_PREFIX + name]
        for name, shape in _json(metadata, "int4", path, {}).items():
            parameters[name] = _packed(path, name, parameters.get(name), shape)
    properties = {k: {"int": int, "float": float, "str": str}[t](v) for k, (t, v) in _json(metadata, "properties", path, {}).items()}
    optimizer = _json(metadata, "optimizer", path)
    optimizer_tensors: dict[str, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, state_name = key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
            optimizer_tensors.setdefault(state_name, {})[name] = array
    random = _json(metadata, "random", path)
    if random is not None and not (isinstance(random, dict) and all(isinstance(random.get(k), int)
                                                                     for k in ("seed", "draws"))):
        raise CheckpointError(f"checkpoint '{path}' is damaged (metadata 'random' is not a seed and a draw count)")
    return CheckpointContents(parameters, list(trainable), properties, optimizer, optimizer_tensors, nominal,
                              None if nominal else source, random)
