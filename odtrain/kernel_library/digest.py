"""What a kernel library records of the artifacts it was built for: a digest of their models.

`odtrain compile` writes the digest of each artifact folder it recorded on into the library's manifest
(`artifacts`); the loader refuses an artifact folder's own kernels/ library when the folder's digest is not
among them (odtrain/kernel_library/loader.py). The digest covers the models, not the checkpoint, which
training changes; the file names are odtrain/artifact_paths.py's. Standard library only.
"""
from __future__ import annotations

import hashlib
import os

from ..artifact_paths import EVAL_MODEL, OPTIMIZER_MODEL, TRAINING_MODEL

# in this order, each name hashed before its bytes: the digests in existing manifests depend on both
DIGESTED_MODELS = (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL)


def artifacts_digest(folder) -> str | None:
    """sha256 over an artifact folder's models (not its checkpoint, which training changes), or None when it
    has no training model: what a library records of the artifacts it was built for."""
    digest, found = hashlib.sha256(), False
    for name in DIGESTED_MODELS:
        path = os.path.join(os.fspath(folder), name)
        if os.path.isfile(path):
            found = found or name == TRAINING_MODEL
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest() if found else None
