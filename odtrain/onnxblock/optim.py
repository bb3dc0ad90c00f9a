"""Optimizer blocks: the optimizer model for a list of trainable parameters.

    optimizer_block = onnxblock.optim.SGDMomentum(momentum=0.9, nesterov=True)
    optimizer_model = optimizer_block.to_model_proto(training_block.parameters())

AdamW is ONNX Runtime's (Hugging Face's); SGD and SGDMomentum follow torch.optim.SGD, momentum
buffer included, which the checkpoint carries like AdamW's moments. The hyper-parameters are fixed
in the optimizer model; the learning rate is set on the device (Optimizer.set_learning_rate).

Every optimizer record (odtrain.graph.optimizers.OPTIMIZERS) has a block here under its kind: AdamW,
SGD and SGDMomentum are written out, with ONNX Runtime's signatures (AdamW's bias_correction first
and clip_grad, a ClipGradNorm; SGD turning to SGDMomentum when given momentum); any other record's block is made from
it on first use (`onnxblock.optim.<kind>(**hyper-parameters)`, `optimizer_block(record)`).
"""
from __future__ import annotations

import onnx

from ..graph.errors import ArgumentError, StateError
from ..graph.onnx_io import graph_to_proto
from ..graph.optimizers import OPTIMIZERS, OptimizerRecord, build_optimizer_graph, check_max_grad_norm
from ..graph.optimizers import SGD as _SGDConfig
from ..graph.optimizers import AdamW as _AdamWConfig
from ..graph.optimizers import SGDMomentum as _SGDMomentumConfig
from .blocks import Block


def _parameter_names(parameters) -> list[str]:
    """Trainable names from TrainingBlock.parameters() (trainable, frozen), or a list of tensors or names."""
    if isinstance(parameters, tuple) and len(parameters) == 2 and all(isinstance(p, (list, tuple)) for p in parameters):
        parameters = parameters[0]
    names = [p if isinstance(p, str) else getattr(p, "name", None) for p in parameters]
    if not names or not all(isinstance(n, str) for n in names):
        raise ArgumentError("an optimizer block takes TrainingBlock.parameters(), or a list of trainable parameter "
                            f"tensors or names; got {parameters!r}")
    return names


class _OptimizerBlock(Block):
    """An optimizer model for a list of trainable parameters: call it with them, then to_model_proto()."""

    config = None
    max_grad_norm = None  # the global gradient norm clipped to first (AdamW's clip_grad), or None

    def build(self, parameters):
        self._parameters = _parameter_names(parameters)
        return "updated_flag"

    def __call__(self, parameters):
        return self.build(parameters)  # needs no model: the optimizer model is built on its own

    def to_model_proto(self, parameters=None) -> onnx.ModelProto:
        if parameters is not None:
            self.build(parameters)
        if getattr(self, "_parameters", None) is None:
            raise StateError(f"{type(self).__name__}.to_model_proto() needs the parameters: call the block with "
                             "training_block.parameters() first, or pass them to to_model_proto(parameters)")
        return graph_to_proto(build_optimizer_graph(self.config, self._parameters, self.max_grad_norm),
                              producer="odtrain.onnxblock")


class ClipGradNorm:
    """Clip all gradients together to an L2 norm of `max_norm` before the update (ONNX Runtime's block of the
    name; torch.nn.utils.clip_grad_norm_): pass it as AdamW's clip_grad."""

    def __init__(self, max_norm: float):
        self.max_norm = check_max_grad_norm(max_norm)


class AdamW(_OptimizerBlock):
    """AdamW (ONNX Runtime's; Hugging Face's), its hyper-parameters fixed in the optimizer model; `clip_grad`
    (a ClipGradNorm) clips the gradients first."""

    def __init__(self, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 clip_grad=None):
        if clip_grad is not None and not isinstance(clip_grad, ClipGradNorm):
            raise ArgumentError(f"clip_grad must be an onnxblock.optim.ClipGradNorm(max_norm), got {clip_grad!r}")
        self.max_grad_norm = clip_grad.max_norm if clip_grad is not None else None
        self.config = _AdamWConfig(betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                   bias_correction=bool(bias_correction))


class SGD(_OptimizerBlock):
    """SGD as torch.optim.SGD: w -= lr·g, with optional momentum, dampening, Nesterov and weight decay."""

    def __init__(self, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        plain = momentum == 0 and weight_decay == 0 and not nesterov
        self.config = _SGDConfig() if plain else _SGDMomentumConfig(momentum, dampening, nesterov, weight_decay)


class SGDMomentum(SGD):
    """SGD with momentum (0.9 by default): b = μ·b + (1-τ)·g;  w -= lr·b, or lr·(g + μ·b) with Nesterov."""

    def __init__(self, momentum: float = 0.9, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        self.config = _SGDMomentumConfig(momentum, dampening, nesterov, weight_decay)


_MADE: dict[OptimizerRecord, type] = {}  # the blocks made from records, so that each name is one class


def optimizer_block(record: OptimizerRecord) -> type:
    """The block of an optimizer record: its keyword arguments are the record's hyper-parameters."""
    if record not in _MADE:
        def __init__(self, **hyper_parameters):
            self.config = record.config(**hyper_parameters)

        _MADE[record] = type(record.kind, (_OptimizerBlock,), {
            "__init__": __init__, "__module__": __name__,
            "__doc__": f"{record.kind}: {record.config.__doc__ or 'an odtrain optimizer'}"})
    return _MADE[record]


def __getattr__(name: str):
    """onnxblock.optim.<kind> for an optimizer record without a block written out above."""
    if name in OPTIMIZERS:
        return optimizer_block(OPTIMIZERS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
