"""odtrain: train ONNX models on the device that holds the data.

`odtrain.artifacts.generate_artifacts` prepares a forward-only ONNX model for
training (offline); `odtrain.api` trains it on the device with ONNX Runtime
training's API. Heavy modules load on first use, so `import odtrain` is cheap.
"""
from .graph.errors import (
    ArgumentError,
    ArtifactNotFoundError,
    CheckpointError,
    InputError,
    ModelError,
    OdtrainError,
    ParameterError,
    StateError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "OdtrainError", "ModelError", "UnsupportedOpError", "InputError", "ArgumentError",
    "ParameterError", "CheckpointError", "ArtifactNotFoundError", "StateError", "__version__",
]
