"""The files of an artifact folder, named in this one place.

`generate_artifacts` writes them (each name may carry a prefix); every loader finds them here:
- `training_model.onnx`: forward, loss and gradients;
- `eval_model.onnx`: forward and loss;
- `optimizer_model.onnx`: the optimizer's update (when an optimizer was given);
- `checkpoint`: parameter values, optimizer state and properties;
- `nominal_checkpoint`: parameter names and shapes only (when asked for).

Imports nothing of odtrain's but its errors, so any module may use it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .graph.errors import ArtifactNotFoundError

TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
OPTIMIZER_MODEL = "optimizer_model.onnx"
CHECKPOINT = "checkpoint"
NOMINAL_CHECKPOINT = "nominal_checkpoint"


def refuse_a_model(path) -> None:
    """Where an artifact folder belongs, refuse an ONNX model file (or any file) with the command that
    prepares its artifacts in a folder that does not exist yet."""
    path = os.fspath(path)
    if os.path.isfile(path):
        stem = os.path.splitext(path)[0] if path.endswith(".onnx") else path
        suggested = f"{stem}-artifacts"
        what = "an ONNX model" if path.endswith(".onnx") else "a file"
        raise ArtifactNotFoundError(f"'{path}' is {what}, not an artifact folder: prepare its artifacts with "
                                    f"`odtrain prepare {path} -o {suggested}`, then give '{suggested}' instead")


@dataclass
class ArtifactPaths:
    directory: str
    training_model: str
    eval_model: str
    optimizer_model: str
    checkpoint: str
    nominal_checkpoint: str

    @classmethod
    def of(cls, directory, prefix: str = "", checkpoint=None) -> "ArtifactPaths":
        """The paths of an artifact folder's files, whether they exist or not; `checkpoint` replaces its
        checkpoint (a checkpoint saved elsewhere)."""
        directory = os.fspath(directory)
        paths = cls(directory, *(os.path.join(directory, f"{prefix}{name}") for name in
                                 (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT, NOMINAL_CHECKPOINT)))
        if checkpoint is not None:
            paths.checkpoint = os.fspath(checkpoint)
        return paths

    @classmethod
    def find(cls, directory, checkpoint=None) -> "ArtifactPaths":
        """The paths of an existing artifact folder with its training and eval models and a checkpoint."""
        directory = os.fspath(directory)
        refuse_a_model(directory)
        if not os.path.isdir(directory):
            raise ArtifactNotFoundError(f"artifact folder '{directory}' does not exist; create it with "
                                        f"`odtrain prepare MODEL.onnx -o {directory}`")
        paths = cls.of(directory, checkpoint=checkpoint)
        missing = paths.missing("training_model", "eval_model")
        missing += [] if os.path.isfile(paths.checkpoint) else [paths.checkpoint]
        if missing:
            raise ArtifactNotFoundError(f"artifact folder '{directory}' lacks {', '.join(missing)}; generate the "
                                        "artifacts with `odtrain prepare` or odtrain.artifacts.generate_artifacts")
        return paths

    def missing(self, *files: str) -> list[str]:
        """The file names, among the named fields (e.g. "training_model"), that do not exist."""
        return [os.path.basename(getattr(self, name)) for name in files if not os.path.isfile(getattr(self, name))]

    def has(self, file: str) -> bool:
        """Whether the file of the named field (e.g. "optimizer_model") exists."""
        return os.path.isfile(getattr(self, file))
