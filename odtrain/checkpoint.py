"""The checkpoint file: safetensors tensors plus versioned, checksummed metadata.

Layout (a safetensors file):
- tensors `param/<name>` for every parameter, and `optimizer/<name>/<state>`
  (e.g. momentum0, momentum1) for each trainable parameter when saved;
- metadata strings: `format` = "odtrain-checkpoint", `format_version`,
  `trainable`/`frozen` (JSON name lists, in order), `properties` (JSON of
  {name: [type, value]}), `optimizer` (JSON: kind, step, learning rates) when
  saved, `nominal` ("1": shapes only, values to be supplied later) with
  `shapes`, and `sha256` over every tensor's name, dtype, shape and bytes and
  (from format version 2) every other metadata entry; version 1 files, whose
  checksum covers the tensors only, are still read.

Guarantees: nothing is unpickled or evaluated; a truncated, damaged, foreign
or newer-version file is refused with the reason; saving writes a temporary
file `.<name>.<random>.tmp` in the same folder, flushes and fsyncs it, renames
it over the target and fsyncs the folder, so a crash leaves either the old or
the new file. A save first removes the temporary files that earlier saves of
the same file left when they were killed: a writer holds an exclusive `flock`
on its temporary file, so a file nobody holds is stale (the kernel drops a
dead process's locks); without `fcntl` (Windows) nothing is removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field

import numpy as np
import safetensors.numpy

try:
    import fcntl
except ImportError:  # Windows: stale temporary files are left alone
    fcntl = None

from .graph.errors import ArtifactNotFoundError, CheckpointError

FORMAT = "odtrain-checkpoint"
FORMAT_VERSION = 2
CHECKSUM_COVERS_METADATA = {"1": False, "2": True}  # every version this odtrain reads
PARAM_PREFIX = "param/"
OPTIMIZER_PREFIX = "optimizer/"


@dataclass
class CheckpointContents:
    parameters: dict[str, np.ndarray]
    trainable: list[str]
    properties: dict = field(default_factory=dict)
    optimizer: dict | None = None  # kind, step, learning_rate, initial_learning_rate
    optimizer_tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # state -> name -> array
    nominal: bool = False


def _digest(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> str:
    """sha256 over the tensors, then over the metadata entries other than the digest itself (if given)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    if metadata is not None:
        h.update(json.dumps(sorted((k, v) for k, v in metadata.items() if k != "sha256")).encode())
    return h.hexdigest()


def _read_header(blob: bytes, path: str) -> dict:
    """The metadata of a checkpoint's safetensors header, after checking that it is odtrain's and readable."""
    def refuse(reason: str):
        raise CheckpointError(f"checkpoint '{path}' is {reason}; it cannot be loaded. Use an intact checkpoint "
                              "(odtrain writes them atomically, so the previous save is still whole).")

    if len(blob) < 8:
        refuse("truncated (shorter than its header)")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > len(blob) - 8:
        refuse("truncated (its header runs past the end of the file)")
    try:
        header = json.loads(blob[8:8 + header_len])
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
    return metadata


def _decode(blob: bytes, path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    metadata = _read_header(blob, path)
    try:
        tensors = safetensors.numpy.load(blob)
    except Exception as error:  # SafetensorError and friends: offsets, sizes, dtypes
        raise CheckpointError(f"checkpoint '{path}' is truncated or damaged ({error}); it cannot be loaded") from None
    covered = metadata if CHECKSUM_COVERS_METADATA[metadata["format_version"]] else None
    if metadata.get("sha256") != _digest(tensors, covered):
        raise CheckpointError(f"checkpoint '{path}' is damaged: its tensors or metadata do not match the "
                              "checksum it was saved with; it cannot be loaded")
    return tensors, metadata


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


def write_atomically(path: str, blob: bytes) -> None:
    """Write `blob` to `path` so that a crash at any moment leaves the old file or the new one, whole;
    first remove the temporary files that killed earlier saves of `path` left behind."""
    folder = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = _locked_temporary(folder, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:  # closing it releases the lock: after the rename
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
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


def save(path, contents: CheckpointContents) -> None:
    path = os.fspath(path)
    tensors: dict[str, np.ndarray] = {}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                "trainable": json.dumps(contents.trainable),
                "frozen": json.dumps([n for n in contents.parameters if n not in contents.trainable]),
                "properties": json.dumps({k: [type(v).__name__, v] for k, v in contents.properties.items()})}
    if contents.nominal:
        metadata["nominal"] = "1"
        metadata["shapes"] = json.dumps({n: [a.dtype.str, list(a.shape)] for n, a in contents.parameters.items()})
    else:
        for name, array in contents.parameters.items():
            tensors[PARAM_PREFIX + name] = array
    if contents.optimizer is not None:
        metadata["optimizer"] = json.dumps(contents.optimizer)
        for state_name, per_param in contents.optimizer_tensors.items():
            for name, array in per_param.items():
                tensors[f"{OPTIMIZER_PREFIX}{name}/{state_name}"] = array
    metadata["sha256"] = _digest(tensors, metadata)
    write_atomically(path, safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=metadata))


def load(path) -> CheckpointContents:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactNotFoundError(f"checkpoint file '{path}' does not exist")
    with open(path, "rb") as f:
        blob = f.read()
    tensors, metadata = _decode(blob, path)
    trainable = _json(metadata, "trainable", path, [])
    frozen = _json(metadata, "frozen", path, [])
    names = list(trainable) + list(frozen)
    nominal = metadata.get("nominal") == "1"
    parameters = {}
    if nominal:
        shapes = _json(metadata, "shapes", path, {})
        for name in names:
            dtype, shape = shapes.get(name, ["<f4", None])
            if shape is None:
                raise CheckpointError(f"checkpoint '{path}' is damaged (no shape for nominal parameter '{name}')")
            parameters[name] = np.zeros(shape, dtype=np.dtype(dtype))
    else:
        for name in names:
            if PARAM_PREFIX + name not in tensors:
                raise CheckpointError(f"checkpoint '{path}' is damaged (parameter '{name}' is listed but not stored)")
            parameters[name] = tensors[PARAM_PREFIX + name]
    properties = {k: {"int": int, "float": float, "str": str}[t](v) for k, (t, v) in _json(metadata, "properties", path, {}).items()}
    optimizer = _json(metadata, "optimizer", path)
    optimizer_tensors: dict[str, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, state_name = key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
            optimizer_tensors.setdefault(state_name, {})[name] = array
    return CheckpointContents(parameters, list(trainable), properties, optimizer, optimizer_tensors, nominal)
