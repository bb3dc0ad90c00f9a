"""Blocks: losses, training models and optimizers composed in Python, as ONNX Runtime's `onnxblock`.

    class WeightedLoss(onnxblock.Block):
        def __init__(self):
            self.mse, self.l1 = onnxblock.loss.MSELoss(), onnxblock.loss.L1Loss()
            self.add, self.mul = onnxblock.blocks.Add(), onnxblock.blocks.Mul()

        def build(self, first, second):
            return self.add(self.mul(0.7, self.mse(first, "target1")), self.mul(0.3, self.l1(second, "target2")))

    generate_artifacts(model, requires_grad=[...], loss=WeightedLoss(), optimizer=onnxblock.optim.SGDMomentum(0.9))

Layout, as in ONNX Runtime: `blocks` (Block and the building blocks), `loss`, `optim`; here
TrainingBlock (a model, its loss, differentiated), ForwardBlock (a model extended by blocks),
`base`/`empty_base`, `save_checkpoint`.

Nothing global is needed: the model is handed over explicitly, to `generate_artifacts(model,
loss=block)`, `TrainingBlock(model)`, `TrainingBlock.to_model_proto(model)` or
`ForwardBlock.to_model_proto(model)`; `with onnxblock.base(model):` works as in ONNX Runtime. The
training and eval models come from odtrain's own pipeline (`artifacts.build_training_graphs`), so
they are the files `generate_artifacts` writes.

Differences from ONNX Runtime: inside `build`, `self.base` is odtrain's GraphBuilder, not an
onnx.ModelProto; `Constant` is a scalar and reductions drop the reduced axes, so a loss is a
scalar (a loss of one element is reduced to one; a larger one is refused for training);
CrossEntropyLoss labels are int64; the loss value is named `loss` when that name is free.
"""
from __future__ import annotations

import contextlib

import numpy as np
import onnx
from onnx import numpy_helper

from .. import checkpoint as checkpoint_file
from ..artifacts import build_training_graphs
from ..graph.errors import ArgumentError, StateError
from ..graph.ir import Graph
from ..graph.onnx_io import graph_to_proto, read_model_proto
from . import blocks, loss, optim
from .blocks import _BUILDING, Block, GraphBuilder, _build_into, _output_names, build_loss_block


@contextlib.contextmanager
def base(model):
    """Build blocks on `model` (an onnx.ModelProto or a path) inside the `with`; yields its GraphBuilder."""
    builder = GraphBuilder.from_model(model)
    token = _BUILDING.set(builder)
    try:
        yield builder
    finally:
        _BUILDING.reset(token)


@contextlib.contextmanager
def empty_base():
    """An empty model to build on, as ONNX Runtime's empty_base (optimizer blocks need none)."""
    builder = GraphBuilder(Graph([], [], [], name="empty"))
    token = _BUILDING.set(builder)
    try:
        yield builder
    finally:
        _BUILDING.reset(token)


def _model_outputs(model) -> list[str]:
    proto, _ = read_model_proto(model, "model")
    return [output.name for output in proto.graph.output]


class _Recorded(Block):
    """Runs a TrainingBlock's build as the loss of build_training_graphs and keeps what it returned."""

    def __init__(self, block, kwargs):
        self.block, self.kwargs, self.result = block, kwargs, None

    def build(self, *inputs):
        self.result = _build_into(self.block, self.base, inputs, self.kwargs)
        return self.result


class TrainingBlock(Block):
    """A model with a loss, differentiated: `build` returns the loss name, or (loss, *outputs).

    Mark parameters with `requires_grad(name)` (trainable) or `requires_grad(name, False)` (frozen, kept in
    the checkpoint); other initializers stay constants. After a build, `to_model_proto()` gives the training
    and eval models and `parameters()` the (trainable, frozen) onnx.TensorProto lists.
    """

    def __init__(self, model=None):
        self._model = model
        self._requires_grad: dict[str, bool] = {}
        self._built = None

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        self.__dict__.setdefault("_requires_grad", {})[argument_name] = bool(value)

    def __call__(self, *args, **kwargs):
        builder = _BUILDING.get()
        model = builder.model if builder is not None else getattr(self, "_model", None)
        if model is None:
            raise StateError(f"{type(self).__name__} has no model to build on: use TrainingBlock(model), "
                             "block.to_model_proto(model), or call it inside `with onnxblock.base(model):`")
        flags = getattr(self, "_requires_grad", {})
        trainable = [name for name, value in flags.items() if value]
        if not trainable:
            raise ArgumentError(f"{type(self).__name__}: no parameter requires a gradient; mark the parameters to "
                                "train with block.requires_grad(name)")
        recorder = _Recorded(self, kwargs)
        self._built = build_training_graphs(model, requires_grad=trainable,
                                            frozen_params=[name for name, value in flags.items() if not value],
                                            loss=recorder, loss_input_names=list(args))
        loss_name = self._built.eval.outputs[0]  # the loss value may have been renamed "loss"
        return loss_name if isinstance(recorder.result, str) else (loss_name, *recorder.result[1:])

    def _graphs(self, what: str):
        built = getattr(self, "_built", None)
        if built is None:
            raise StateError(f"{what} needs the training model built first: call the block on the model's outputs "
                             "inside `with onnxblock.base(model):`, or use block.to_model_proto(model)")
        return built

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        built = self._graphs("parameters()")
        return ([numpy_helper.from_array(built.values[n], name=n) for n in built.trainable],
                [numpy_helper.from_array(built.values[n], name=n) for n in built.frozen])

    def to_model_proto(self, model=None) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """(training model, eval model); with `model`, first build on all of that model's outputs."""
        if model is not None:
            self._model = model
            token = _BUILDING.set(None)  # build on `model`, not on a model of an enclosing `with base(...)`
            try:
                self(*_model_outputs(model))
            finally:
                _BUILDING.reset(token)
        built = self._graphs("to_model_proto()")
        return (graph_to_proto(built.training, built.param_inputs, producer="odtrain.onnxblock"),
                graph_to_proto(built.eval, built.param_inputs, producer="odtrain.onnxblock"))


class ForwardBlock(Block):
    """A model extended by blocks: `build` returns the names that become the model's outputs."""

    def __init__(self, model=None):
        self._model = model
        self._proto = None

    def __call__(self, *args, **kwargs):
        builder = _BUILDING.get()
        if builder is None:
            if getattr(self, "_model", None) is None:
                raise StateError(f"{type(self).__name__} has no model to build on: use block.to_model_proto(model) "
                                 "or call it inside `with onnxblock.base(model):`")
            builder = GraphBuilder.from_model(self._model)
        result = _build_into(self, builder, args, kwargs)
        names = _output_names(result)
        for name in names:
            t = builder.type_of(name)
            if t is not None:
                builder.graph.value_types[name] = t
        builder.graph.outputs = names
        builder._proto = None
        self._proto = builder.model
        return result

    def to_model_proto(self, model=None) -> onnx.ModelProto:
        """The model with the block's outputs; with `model`, first build on all of that model's outputs."""
        if model is not None:
            self._model = model
            token = _BUILDING.set(None)
            try:
                self(*_model_outputs(model))
            finally:
                _BUILDING.reset(token)
        if getattr(self, "_proto", None) is None:
            raise StateError("to_model_proto() needs the model built first: call the block on the model's outputs "
                             "inside `with onnxblock.base(model):`, or use block.to_model_proto(model)")
        return self._proto


def save_checkpoint(parameters, path_to_checkpoint, nominal_checkpoint: bool = False) -> None:
    """Write (trainable, frozen) parameters (onnx.TensorProto lists, as TrainingBlock.parameters() gives) as a
    checkpoint; `nominal_checkpoint=True` keeps only names and shapes, values to be loaded on the device."""
    try:
        trainable, frozen = parameters
    except (TypeError, ValueError):
        raise ArgumentError("save_checkpoint takes (trainable, frozen) lists of onnx.TensorProto, as "
                            "TrainingBlock.parameters() returns them") from None
    values = {}
    for tensor in list(trainable) + list(frozen):
        if not isinstance(tensor, onnx.TensorProto):
            raise ArgumentError(f"save_checkpoint: expected onnx.TensorProto parameters, got {type(tensor).__name__}")
        values[tensor.name] = numpy_helper.to_array(tensor)
    for name in (tensor.name for tensor in trainable):
        if values[name].dtype != np.float32:
            raise ArgumentError(f"parameter '{name}' is {values[name].dtype}; only float32 parameters train")
    checkpoint_file.save(path_to_checkpoint, checkpoint_file.CheckpointContents(
        values, [t.name for t in trainable], nominal=bool(nominal_checkpoint)))


__all__ = ["Block", "TrainingBlock", "ForwardBlock", "GraphBuilder", "base", "empty_base", "save_checkpoint",
           "build_loss_block", "blocks", "loss", "optim"]
