"""Optimizer builders: the optimizer model, one fused update over flat buffers.

The optimizer model holds a single node of odtrain's domain, `AdamW`,
`SGD` or `SGDMomentum`, whose attributes are the hyper-parameters and the
ordered list of parameters it updates. The runtime applies it as one loop over the flat
parameter, gradient and moment buffers.

AdamW follows ONNX Runtime's generated optimizer (and Hugging Face's AdamW):
    m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²
    step_size = lr·√(1-β2ᵗ)/(1-β1ᵗ)   (lr when bias correction is off)
    w = w - step_size · m / (√v + ε);  then  w = w - lr·λ·w
With `state_dtype="int8"` AdamW keeps m and v in one byte each, quantized in blocks of STATE_BLOCK values of
one parameter with a float32 absmax per block (kernels/optim.py states the code maps); the node's attributes
say so (`state_dtype`, `state_block`), and the checkpoint stores the codes and the absmax values.
SGD: w = w - lr·g.
SGDMomentum (torch.optim.SGD; μ momentum, τ dampening, λ weight decay):
    d = g + λ·w;  b = d on the first step, else μ·b + (1-τ)·d
    w = w - lr·(d + μ·b)  with Nesterov, else  w = w - lr·b

Any optimizer may clip the gradients first (torch.nn.utils.clip_grad_norm_, ONNX Runtime's
onnxblock.optim.ClipGradNorm): with the node's attribute `max_grad_norm` = c, every gradient is
scaled by min(1, c / (‖g‖ + CLIP_EPSILON)), ‖g‖ the L2 norm of all trainable parameters' gradients
together, before the update reads them. Without the attribute nothing is clipped.

Each optimizer is one record in OPTIMIZERS, written by `@optimizer(...)` on the class of its
hyper-parameters; everything else odtrain knows of an optimizer is read from it:
- kind: the class's name; the op type of the optimizer model's node and the kind the checkpoint stores.
- config: the class, a dataclass whose defaults are the optimizer's (OptimType.<kind> takes them all).
- state_names: its state buffers, each one value per trainable value (the node's inputs `<name>s`, the
  checkpoint's optimizer tensors, the moments the update kernel reads and writes).
- to_attributes / from_attributes: the hyper-parameters as the node's attributes and back. By default each
  field under its own name (a boolean as 0/1); a class that defines `attributes()` and the classmethod
  `from_attributes(attrs, source)` writes and reads its own (AdamW: betas as beta1 and beta2).
- command: its choice of `odtrain prepare --optimizer`, or None where the command line does not offer it.
- state_dtypes: the types its state may be kept in.
Read from OPTIMIZERS: parse_optimizer, build_optimizer_graph, read_optimizer_graph, check_state_dtype,
`odtrain prepare --optimizer` (odtrain/cli/prepare.py), odtrain.artifacts' optimizer classes and
odtrain.onnxblock.optim's blocks. A new optimizer is its record here, its kernel (kernels/optim.py) and
its row of UPDATES (odtrain/optimizer_update.py).
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Callable

from .errors import ArgumentError, ModelError
from .ir import ODTRAIN_DOMAIN, Graph, Node


class OptimType(enum.Enum):
    """The optimizers ONNX Runtime names (onnxruntime.training.artifacts.OptimType); each member is the
    record of its name with its defaults."""

    AdamW = 1
    SGD = 2


STATE_DTYPES = ("float32", "int8")  # how an optimizer may keep its state (int8: AdamW's moments)
STATE_BLOCK = 2048  # values per absmax of 8-bit moments
MAX_GRAD_NORM = "max_grad_norm"  # the optimizer node's attribute that clips the gradients' global norm
CLIP_EPSILON = 1e-6  # c / (norm + this): torch.nn.utils.clip_grad_norm_'s and ONNX Runtime's


@dataclass(frozen=True)
class OptimizerRecord:
    """What odtrain knows of one optimizer (see the module docstring)."""

    kind: str
    config: type
    state_names: tuple[str, ...]
    to_attributes: Callable  # (config) -> the node's attributes
    from_attributes: Callable  # (the node's attributes, the model's path) -> config
    command: str | None
    state_dtypes: tuple[str, ...]

    def hyper_parameters(self) -> tuple[str, ...]:
        """The names its class takes (the `kind` field is set, not given)."""
        return tuple(f.name for f in dataclasses.fields(self.config) if f.init)


OPTIMIZERS: dict[str, OptimizerRecord] = {}  # kind -> record, in the order registered


def _field_attributes(config) -> dict:
    """Each hyper-parameter under its own name, as the type of its default: a boolean as 0/1, an int, a
    string, else a float."""
    attrs = {}
    for f in dataclasses.fields(config):
        if f.init:
            value = getattr(config, f.name)
            if isinstance(f.default, bool):
                attrs[f.name] = int(bool(value))
            elif isinstance(f.default, (int, str)):
                attrs[f.name] = type(f.default)(value)
            else:
                attrs[f.name] = float(value)
    return attrs


def _attribute(attrs: dict, name: str, kind: str, source: str):
    if name not in attrs:
        raise ModelError(f"'{source}': its {kind} node has no attribute '{name}'; generate the optimizer model "
                         "again with odtrain.artifacts.generate_artifacts")
    value = attrs[name]
    return value.decode() if isinstance(value, bytes) else value


def _from_field_attributes(cls):
    """The reader of _field_attributes: each field from the attribute of its name, as the type of its default."""

    def read(attrs: dict, source: str):
        values = {}
        for f in dataclasses.fields(cls):
            if f.init:
                value = _attribute(attrs, f.name, cls.__name__, source)
                values[f.name] = bool(value) if isinstance(f.default, bool) else value
        return cls(**values)

    return read


def optimizer(state: tuple[str, ...] = (), command: str | None = None, state_dtypes: tuple[str, ...] = ("float32",)):
    """Make the class a dataclass of an optimizer's hyper-parameters and register its record under the class's
    name: its `state` buffers, its `odtrain prepare --optimizer` choice, the types its state may be kept in.
    The class gets `kind` (a field, set) and `state_names`; where it defines no `attributes()` and
    `from_attributes()`, each field is an attribute of the node under its own name."""

    def register(cls):
        kind = cls.__name__
        cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), "kind": "str"}
        cls.kind = dataclasses.field(default=kind, init=False)
        cls.state_names = tuple(state)
        config = dataclass(cls)
        if "attributes" not in cls.__dict__:
            config.attributes = _field_attributes
        if "from_attributes" not in cls.__dict__:
            config.from_attributes = staticmethod(_from_field_attributes(config))
        OPTIMIZERS[kind] = OptimizerRecord(kind, config, tuple(state), config.attributes, config.from_attributes,
                                           command, tuple(state_dtypes))
        return config

    return register


def _either(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def record_of(config) -> OptimizerRecord:
    """The record of an optimizer's hyper-parameters (an instance of a registered class)."""
    record = OPTIMIZERS.get(getattr(config, "kind", None))
    if record is None or not isinstance(config, record.config):
        raise ArgumentError(f"{config!r} is not the hyper-parameters of an odtrain optimizer "
                            f"({_either(OPTIMIZERS)})")
    return record


def check_state_dtype(state_dtype, kind: str) -> str:
    """`state_dtype` when `kind` supports it, else an ArgumentError naming what does."""
    if state_dtype not in STATE_DTYPES:
        raise ArgumentError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if state_dtype not in OPTIMIZERS[kind].state_dtypes:
        keeping = [r.kind for r in OPTIMIZERS.values() if state_dtype in r.state_dtypes]
        raise ArgumentError(f"state_dtype={state_dtype!r} applies to {_either(keeping)}'s moments; {kind} keeps its "
                            f"state in float32 (leave state_dtype out, or train with {_either(keeping)})")
    return state_dtype


@optimizer(state=("momentum0", "momentum1"), command="adamw", state_dtypes=STATE_DTYPES)
class AdamW:
    """AdamW hyper-parameters, fixed when the artifacts are generated; `state_dtype="int8"` keeps the moments
    in 8 bits (a quarter of the bytes)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    bias_correction: bool = True
    state_dtype: str = "float32"

    def __post_init__(self):
        check_state_dtype(self.state_dtype, self.kind)

    def attributes(self) -> dict:
        attrs = {"beta1": float(self.betas[0]), "beta2": float(self.betas[1]), "epsilon": float(self.eps),
                 "weight_decay": float(self.weight_decay), "bias_correction": int(bool(self.bias_correction))}
        if self.state_dtype != "float32":  # float32 models stay as they were
            attrs.update(state_dtype=self.state_dtype, state_block=STATE_BLOCK)
        return attrs

    @classmethod
    def from_attributes(cls, attrs: dict, source: str) -> "AdamW":
        state_dtype = attrs.get("state_dtype", "float32")
        state_dtype = state_dtype.decode() if isinstance(state_dtype, bytes) else state_dtype
        if state_dtype not in STATE_DTYPES or int(attrs.get("state_block", STATE_BLOCK)) != STATE_BLOCK:
            raise ModelError(f"'{source}' keeps AdamW's moments as {state_dtype} in blocks of "
                             f"{attrs.get('state_block')}; this odtrain reads {list(STATE_DTYPES)} in blocks of "
                             f"{STATE_BLOCK}: generate the artifacts again")
        read = {name: _attribute(attrs, name, "AdamW", source)
                for name in ("beta1", "beta2", "epsilon", "weight_decay", "bias_correction")}
        return cls(betas=(read["beta1"], read["beta2"]), eps=read["epsilon"], weight_decay=read["weight_decay"],
                   bias_correction=bool(read["bias_correction"]), state_dtype=state_dtype)


@optimizer(command="sgd")
class SGD:
    """Plain stochastic gradient descent: w -= lr·g."""


@optimizer(state=("momentum_buffer",))
class SGDMomentum:
    """Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD."""

    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.momentum < 0 or self.weight_decay < 0 or not 0 <= self.dampening <= 1:
            raise ArgumentError(f"SGDMomentum needs momentum >= 0, weight_decay >= 0 and 0 <= dampening <= 1; "
                                f"got momentum={self.momentum}, dampening={self.dampening}, "
                                f"weight_decay={self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ArgumentError("Nesterov momentum needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")


def parse_optimizer(optimizer):
    """The hyper-parameters of a registered optimizer as given, or those an OptimType (or its name) defaults to."""
    if isinstance(optimizer, tuple(record.config for record in OPTIMIZERS.values())):
        return optimizer
    if isinstance(optimizer, str) and optimizer in OptimType.__members__:
        optimizer = OptimType[optimizer]
    if isinstance(optimizer, OptimType):
        return OPTIMIZERS[optimizer.name].config()
    classes = "/".join(f"{kind}({'...' if record.hyper_parameters() else ''})" for kind, record in OPTIMIZERS.items())
    raise ArgumentError(
        f"optimizer must be an odtrain.artifacts.OptimType ({list(OptimType.__members__)}) or an "
        f"odtrain.artifacts.{classes} with hyper-parameters, got {optimizer!r}")


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_max_grad_norm(max_grad_norm) -> float | None:
    """A gradient clipping norm as given (None: no clipping), or an ArgumentError."""
    if max_grad_norm is None:
        return None
    if not _positive_number(max_grad_norm):
        raise ArgumentError(f"max_grad_norm must be a positive number (the largest L2 norm of all gradients "
                            f"together, as torch.nn.utils.clip_grad_norm_'s max_norm), got {max_grad_norm!r}")
    return float(max_grad_norm)


def build_optimizer_graph(optimizer, parameters: list[str], max_grad_norm: float | None = None) -> Graph:
    """The optimizer model: one node of odtrain's domain, the optimizer's kind, over the flat buffers; with
    `max_grad_norm`, the gradients are clipped to that global L2 norm before the update."""
    record = record_of(optimizer)
    attrs = dict(record.to_attributes(optimizer), parameters=list(parameters))
    if check_max_grad_norm(max_grad_norm) is not None:
        attrs[MAX_GRAD_NORM] = float(max_grad_norm)
    inputs = ["learning_rate", "step", "params", "gradients"] + [f"{s}s" for s in record.state_names]
    node = Node(record.kind, inputs, ["updated_flag"], attrs, f"{record.kind}_update", ODTRAIN_DOMAIN)
    return Graph([node], inputs, ["updated_flag"], opsets={"": 17}, name=f"{record.kind}_optimizer")


def read_optimizer_graph(graph: Graph, source: str) -> tuple[object, list[str]]:
    """The optimizer's hyper-parameters and its parameter list from a loaded optimizer model."""
    if len(graph.nodes) != 1 or graph.nodes[0].domain != ODTRAIN_DOMAIN or graph.nodes[0].op_type not in OPTIMIZERS:
        raise ModelError(f"'{source}' is not an odtrain optimizer model (one ai.odtrain {_either(OPTIMIZERS)} "
                         "node); generate it with odtrain.artifacts.generate_artifacts")
    node = graph.nodes[0]
    attrs = dict(node.attrs)
    parameters = list(attrs.pop("parameters", []))
    record = OPTIMIZERS[node.op_type]
    numbers = [k for k, v in record.to_attributes(record.config()).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]  # as the defaults are written
    unreadable = [k for k in numbers if k in attrs and (isinstance(attrs[k], bool)
                                                         or not isinstance(attrs[k], (int, float)))]
    if unreadable or not all(isinstance(p, str) for p in parameters):
        what = f"attribute '{unreadable[0]}' is not a number" if unreadable else "parameter names are not text"
        raise ModelError(f"'{source}': its {node.op_type} node's {what}: the file is damaged; generate the "
                         "optimizer model again with odtrain.artifacts.generate_artifacts")
    return record.from_attributes(attrs, source), parameters


def read_max_grad_norm(graph: Graph, source: str) -> float | None:
    """The global gradient norm a loaded optimizer model clips to, or None when it does not clip."""
    node = graph.nodes[0]
    if MAX_GRAD_NORM not in node.attrs:
        return None
    value = node.attrs[MAX_GRAD_NORM]
    if not _positive_number(value):
        raise ModelError(f"'{source}': its {node.op_type} node's attribute '{MAX_GRAD_NORM}' is {value!r}, not a "
                         "positive number: the file is damaged; generate the optimizer model again with "
                         "odtrain.artifacts.generate_artifacts")
    return float(value)


__all__ = ["OptimType", "STATE_BLOCK", "STATE_DTYPES", "OPTIMIZERS", "OptimizerRecord", "optimizer", "record_of",
           "check_state_dtype", "AdamW", "SGD", "SGDMomentum", "parse_optimizer", "build_optimizer_graph",
           "read_optimizer_graph", "MAX_GRAD_NORM", "CLIP_EPSILON", "check_max_grad_norm", "read_max_grad_norm"]
