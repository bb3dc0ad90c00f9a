"""Block, the builder blocks add nodes through, and the building blocks custom losses are made of.

A `Block` adds nodes to a model being built: `build(*input_names)` takes value names, calls other
blocks, and returns the names of its outputs. Inside `build`, `self.base` is the `GraphBuilder` of
that model (`node`, `constant`, `input`, `input_like`, `type_of`, `has`). A block called inside
another block's build adds to the same model; the model itself is always handed over explicitly
(see odtrain.onnxblock), and the builder is known only while that build runs.

Building blocks: Add, Sub, Mul, Div (either operand may be a number), Pow, Neg, Abs, Log, Exp,
Sqrt, Sigmoid, Relu, Tanh, Reciprocal, ReduceMean, ReduceSum (all axes by default, reduced axes
dropped, so a loss is a scalar), Constant (a number is a float32 scalar), Clip, PassThrough,
InputLike.
"""
from __future__ import annotations

import contextvars
import numbers

import numpy as np
import onnx

from ..graph.errors import ModelError, StateError
from ..graph.ir import Graph, NameScope, Node, TensorType
from ..graph.onnx_io import graph_from_proto, graph_to_proto, read_model_proto

# The builder a running build adds to; set only while an explicit build (or `with base(model)`) runs.
_BUILDING: contextvars.ContextVar = contextvars.ContextVar("odtrain_onnxblock_builder", default=None)


class GraphBuilder:
    """The model a build adds to: an odtrain IR graph, and fresh names for what blocks add."""

    def __init__(self, graph: Graph, proto: onnx.ModelProto | None = None):
        self.graph = graph
        self.names = NameScope(graph)
        self._proto = proto  # the model this graph came from, while nothing has been added

    @classmethod
    def from_model(cls, model) -> "GraphBuilder":
        proto, path = read_model_proto(model, "model")
        return cls(graph_from_proto(proto, path or "model"), proto)

    @property
    def model(self) -> onnx.ModelProto:
        """The model as built so far."""
        return self._proto if self._proto is not None else graph_to_proto(self.graph, producer="odtrain.onnxblock")

    def has(self, name: str) -> bool:
        return name in self.graph.all_value_names()

    def type_of(self, name: str) -> TensorType | None:
        """The type of a value: declared, or found by ONNX shape inference over the graph so far."""
        known = self.graph.value_types.get(name)
        if known is None and name in self.graph.initializers:
            array = self.graph.initializers[name]
            known = TensorType(array.dtype, tuple(array.shape))
        if known is None:
            try:
                known = _inferred_types(self.graph).get(name)
            except Exception:  # shape inference is a convenience here, never a requirement
                known = None
        return known

    def node(self, op_type: str, inputs, attrs: dict | None = None, hint: str | None = None, outputs: int = 1,
             domain: str = ""):
        """Append one node; returns its output name (a list of names when outputs > 1)."""
        for name in inputs:
            if name and not self.has(name):
                raise ModelError(f"{op_type} block: input '{name}' is not a value of the model")
        hint = hint or op_type.lower()
        outs = [self.names.fresh(f"{hint}_output") for _ in range(outputs)]
        self.graph.nodes.append(Node(op_type, list(inputs), outs, dict(attrs or {}), self.names.fresh(hint), domain))
        self._proto = None
        return outs[0] if outputs == 1 else outs

    def constant(self, value, hint: str = "constant", dtype=None) -> str:
        """A constant tensor (an initializer); Python numbers become float32 scalars unless `dtype` says."""
        if dtype is None and isinstance(value, numbers.Real) and not isinstance(value, np.generic):
            dtype = np.float32
        array = np.asarray(value, dtype=dtype)
        name = self.names.fresh(hint)
        self.graph.initializers[name] = array
        self.graph.value_types[name] = TensorType(array.dtype, tuple(array.shape))
        self._proto = None
        return name

    def input(self, name: str, t: TensorType) -> str:
        """A new graph input named exactly `name` (a target the caller feeds)."""
        if self.has(name):
            raise ModelError(f"cannot add input '{name}': the model already has a value of that name")
        self.names.taken.add(name)
        self.graph.inputs.append(name)
        self.graph.value_types[name] = t
        self._proto = None
        return name

    def input_like(self, like: str, name: str | None = None) -> str:
        """The value `name` if the model has it, else a new input of the type of `like`."""
        if name and self.has(name):
            return name
        t = self.type_of(like)
        if t is None:
            raise ModelError(f"the type of '{like}' is unknown, so an input like it cannot be added; "
                             "give the model typed outputs")
        return self.input(name or self.names.fresh("user_input"), t)


def _inferred_types(graph: Graph) -> dict[str, TensorType]:
    """Types that ONNX shape inference finds; large initializers go in as typed inputs, without their bytes."""
    light = graph.copy()
    for name, array in graph.initializers.items():
        if array.size > 1024:
            del light.initializers[name]
            light.inputs.append(name)
            light.value_types[name] = TensorType(array.dtype, tuple(array.shape))
    return graph_from_proto(graph_to_proto(light)).value_types


def _build_into(block, builder: GraphBuilder, args, kwargs=None):
    token = _BUILDING.set(builder)
    block.base = builder
    try:
        return block.build(*args, **(kwargs or {}))
    finally:
        _BUILDING.reset(token)


def _output_names(result) -> list[str]:
    names = [result] if isinstance(result, str) else list(result) if isinstance(result, (tuple, list)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ModelError(f"a block's build must return an output name or a tuple of names, got {result!r}")
    return names


class Block:
    """A piece of a model: `build(*input_names)` adds nodes and returns output names."""

    base: GraphBuilder | None = None

    def build(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define build(*input_names) returning output names")

    def __call__(self, *args, **kwargs):
        builder = _BUILDING.get()
        if builder is None:
            raise StateError(f"{type(self).__name__} adds nodes to a model, and none is being built: call it inside "
                             "another block's build or inside `with onnxblock.base(model):`, or hand the model over "
                             "explicitly (generate_artifacts(model, loss=block), TrainingBlock.to_model_proto(model))")
        return _build_into(self, builder, args, kwargs)

    def build_loss(self, graph: Graph, loss_inputs: list[str]) -> tuple[str, list[str]]:
        """Run this block on `graph` as its loss (odtrain.artifacts.build_training_graphs calls this):
        (the scalar loss's name, the other output names the block returned)."""
        return build_loss_block(self, graph, loss_inputs)


def build_loss_block(block: Block, graph: Graph, loss_inputs: list[str]) -> tuple[str, list[str]]:
    """Run `block` on `graph` as a loss: (scalar loss name, extra output names the block returned)."""
    builder = GraphBuilder(graph)
    names = _output_names(_build_into(block, builder, loss_inputs))
    for name in names:
        if not builder.has(name):
            raise ModelError(f"{type(block).__name__}.build returned '{name}', which is not a value of the model")
    loss_name = _scalar_loss(builder, names[0], type(block).__name__)
    produced = any(loss_name in node.outputs for node in graph.nodes)
    if loss_name != "loss" and produced and not builder.has("loss") and loss_name not in graph.outputs:
        _rename(graph, loss_name, "loss")  # the name the built-in losses give, for module.output_names()
        loss_name = "loss"
    for name in names[1:]:
        if name not in graph.value_types and builder.type_of(name) is not None:
            graph.value_types[name] = builder.type_of(name)
    return loss_name, names[1:]


def _rename(graph: Graph, old: str, new: str) -> None:
    for node in graph.nodes:
        node.inputs = [new if name == old else name for name in node.inputs]
        node.outputs = [new if name == old else name for name in node.outputs]
    if old in graph.value_types:
        graph.value_types[new] = graph.value_types.pop(old)


def _scalar_loss(builder: GraphBuilder, name: str, who: str) -> str:
    t = builder.type_of(name)
    if t is None or t.shape is None:
        return name
    if t.shape != ():
        if not all(d == 1 for d in t.shape):
            raise ModelError(f"{who}: the loss '{name}' must be a scalar to train, it is {t}; reduce it "
                             "(reduction='mean' or 'sum', or a ReduceMean/ReduceSum block)")
        name = builder.node("ReduceSum", [name], {"keepdims": 0}, hint="loss_scalar")
    builder.graph.value_types[name] = TensorType(t.dtype, ())
    return name


def _operand(builder: GraphBuilder, value, like: str | None) -> str:
    """A value name as is; a Python or numpy number as a scalar constant of `like`'s dtype."""
    if isinstance(value, str):
        return value
    t = builder.type_of(like) if like else None
    return builder.constant(value, dtype=t.dtype if t is not None else np.float32)


class _Binary(Block):
    op_type = ""

    def build(self, input_name1, input_name2):
        a = _operand(self.base, input_name1, input_name2 if isinstance(input_name2, str) else None)
        b = _operand(self.base, input_name2, a)
        return self.base.node(self.op_type, [a, b])


class _Unary(Block):
    op_type = ""

    def build(self, input_name):
        return self.base.node(self.op_type, [input_name])


def _unary(op_type: str) -> type:
    return type(op_type, (_Unary,), {"op_type": op_type, "__doc__": f"An ONNX {op_type} node."})


def _binary(op_type: str) -> type:
    return type(op_type, (_Binary,), {"op_type": op_type,
                                      "__doc__": f"An ONNX {op_type} node; either operand may be a number."})


Add, Sub, Mul, Div = (_binary(t) for t in ("Add", "Sub", "Mul", "Div"))
Neg, Abs, Log, Exp, Sqrt, Sigmoid, Relu, Tanh, Reciprocal = (
    _unary(t) for t in ("Neg", "Abs", "Log", "Exp", "Sqrt", "Sigmoid", "Relu", "Tanh", "Reciprocal"))


class Pow(Block):
    """x ** exponent; the exponent is a constant (2 is written as x·x)."""

    def __init__(self, exponent):
        self._exponent = exponent

    def build(self, pow_input_name):
        if np.ndim(self._exponent) == 0 and float(self._exponent) == 2.0:
            return self.base.node("Mul", [pow_input_name, pow_input_name], hint="pow")
        return self.base.node("Pow", [pow_input_name, _operand(self.base, self._exponent, pow_input_name)])


class _Reduce(Block):
    op_type = ""
    axes_input_from = 0  # the opset from which `axes` is an input instead of an attribute

    def __init__(self, axes=None, keepdims: bool = False):
        self._axes = None if axes is None else [int(a) for a in np.atleast_1d(axes)]
        self._keepdims = int(bool(keepdims))

    def build(self, input_name):
        attrs, inputs = {"keepdims": self._keepdims}, [input_name]
        if self._axes is not None:
            if self.base.graph.opsets.get("", 17) >= self.axes_input_from:
                inputs.append(self.base.constant(np.array(self._axes, dtype=np.int64), "axes"))
            else:
                attrs["axes"] = self._axes
        return self.base.node(self.op_type, inputs, attrs)


class ReduceMean(_Reduce):
    """The mean over `axes` (all by default), the reduced axes dropped unless keepdims."""

    op_type, axes_input_from = "ReduceMean", 18


class ReduceSum(_Reduce):
    """The sum over `axes` (all by default), the reduced axes dropped unless keepdims."""

    op_type, axes_input_from = "ReduceSum", 13


class Constant(Block):
    """A constant: a number becomes a float32 scalar (or of `dtype`); an array keeps its dtype and shape."""

    def __init__(self, value_float, dtype=None):
        self._value, self._dtype = value_float, dtype

    def build(self):
        return self.base.constant(self._value, dtype=self._dtype)


class Clip(Block):
    """Clip to [clip_min, clip_max]; either bound may be None."""

    def __init__(self, clip_min=None, clip_max=None):
        self._min, self._max = clip_min, clip_max

    def build(self, clip_input_name):
        bounds = ["" if b is None else _operand(self.base, b, clip_input_name) for b in (self._min, self._max)]
        return self.base.node("Clip", [clip_input_name] + bounds)


class PassThrough(Block):
    """Its inputs, unchanged (the 'none' reduction)."""

    def build(self, *input_names):
        return input_names[0] if len(input_names) == 1 else tuple(input_names)


class InputLike(Block):
    """A new model input with the type of the value `like` (its name given, or fresh)."""

    def __init__(self, like: str):
        self._like = like

    def build(self, input_name: str | None = None):
        return self.base.input_like(self._like, input_name)
