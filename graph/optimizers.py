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
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import ArgumentError, ModelError
from .ir import ODTRAIN_DOMAIN, Graph, Node


class OptimType(enum.Enum):
    """The built-in optimizers, named as in onnxruntime.training.artifacts.OptimType."""

    AdamW = 1
    SGD = 2


STATE_DTYPES = ("float32", "int8")  # how AdamW stores its moments
STATE_BLOCK = 2048  # values per absmax of 8-bit moments


def check_state_dtype(state_dtype, kind: str) -> str:
    """`state_dtype` when `kind` supports it, else an ArgumentError naming what does."""
    if state_dtype not in STATE_DTYPES:
        raise ArgumentError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if state_dtype != "float32" and kind != "AdamW":
        raise ArgumentError(f"state_dtype={state_dtype!r} applies to AdamW's moments; {kind} keeps its state in "
                            "float32 (leave state_dtype out, or train with AdamW)")
    return state_dtype


@dataclass
class AdamW:
    """AdamW hyper-parameters, fixed when the artifacts are generated; `state_dtype="int8"` keeps the moments
    in 8 bits (a quarter of the bytes)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    bias_correction: bool = True
    state_dtype: str = "float32"
    kind: str = field(default="AdamW", init=False)
    state_names = ("momentum0", "momentum1")

    def __post_init__(self):
        check_state_dtype(self.state_dtype, self.kind)

    def attributes(self) -> dict:
        attrs = {"beta1": float(self.betas[0]), "beta2": float(self.betas[1]), "epsilon": float(self.eps),
                 "weight_decay": float(self.weight_decay), "bias_correction": int(bool(self.bias_correction))}
        if self.state_dtype != "float32":  # float32 models stay as they were
            attrs.update(state_dtype=self.state_dtype, state_block=STATE_BLOCK)
        return attrs


@dataclass
class SGD:
    """Plain stochastic gradient descent: w -= lr·g."""

    kind: str = field(default="SGD", init=False)
    state_names = ()

    def attributes(self) -> dict:
        return {}


@dataclass
class SGDMomentum:
    """Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD."""

    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    kind: str = field(default="SGDMomentum", init=False)
    state_names = ("momentum_buffer",)

    def __post_init__(self):
        if self.momentum < 0 or self.weight_decay < 0 or not 0 <= self.dampening <= 1:
            raise ArgumentError(f"SGDMomentum needs momentum >= 0, weight_decay >= 0 and 0 <= dampening <= 1; "
                                f"got momentum={self.momentum}, dampening={self.dampening}, "
                                f"weight_decay={self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ArgumentError("Nesterov momentum needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    def attributes(self) -> dict:
        return {"momentum": float(self.momentum), "dampening": float(self.dampening),
                "nesterov": int(bool(self.nesterov)), "weight_decay": float(self.weight_decay)}


def parse_optimizer(optimizer) -> AdamW | SGD | SGDMomentum:
    if isinstance(optimizer, (AdamW, SGD, SGDMomentum)):
        return optimizer
    if isinstance(optimizer, str) and optimizer in OptimType.__members__:
        optimizer = OptimType[optimizer]
    if optimizer is OptimType.AdamW:
        return AdamW()
    if optimizer is OptimType.SGD:
        return SGD()
    raise ArgumentError(
        f"optimizer must be an odtrain.artifacts.OptimType ({list(OptimType.__members__)}) or an "
        f"odtrain.artifacts.AdamW(...)/SGD()/SGDMomentum(...) with hyper-parameters, got {optimizer!r}")


def build_optimizer_graph(optimizer: AdamW | SGD | SGDMomentum, parameters: list[str]) -> Graph:
    attrs = dict(optimizer.attributes(), parameters=list(parameters))
    inputs = ["learning_rate", "step", "params", "gradients"] + [f"{s}s" for s in optimizer.state_names]
    node = Node(optimizer.kind, inputs, ["updated_flag"], attrs, f"{optimizer.kind}_update", ODTRAIN_DOMAIN)
    return Graph([node], inputs, ["updated_flag"], opsets={"": 17}, name=f"{optimizer.kind}_optimizer")


def read_optimizer_graph(graph: Graph, source: str) -> tuple[AdamW | SGD | SGDMomentum, list[str]]:
    """The optimizer and its parameter list from a loaded optimizer model."""
    kinds = ("AdamW", "SGD", "SGDMomentum")
    if len(graph.nodes) != 1 or graph.nodes[0].domain != ODTRAIN_DOMAIN or graph.nodes[0].op_type not in kinds:
        raise ModelError(f"'{source}' is not an odtrain optimizer model (one ai.odtrain AdamW, SGD or SGDMomentum "
                         "node); generate it with odtrain.artifacts.generate_artifacts")
    node = graph.nodes[0]
    attrs = dict(node.attrs)
    parameters = list(attrs.pop("parameters", []))
    needed = {"SGD": (), "SGDMomentum": ("momentum", "dampening", "nesterov", "weight_decay"),
              "AdamW": ("beta1", "beta2", "epsilon", "weight_decay", "bias_correction")}[node.op_type]
    missing = [k for k in needed if k not in attrs]
    if missing:
        raise ModelError(f"'{source}': its {node.op_type} node has no attribute '{missing[0]}'; generate the "
                         "optimizer model again with odtrain.artifacts.generate_artifacts")
    unreadable = [k for k in needed if isinstance(attrs[k], bool) or not isinstance(attrs[k], (int, float))]
    if unreadable or not all(isinstance(p, str) for p in parameters):
        what = f"attribute '{unreadable[0]}' is not a number" if unreadable else "parameter names are not text"
        raise ModelError(f"'{source}': its {node.op_type} node's {what}: the file is damaged; generate the "
                         "optimizer model again with odtrain.artifacts.generate_artifacts")
    if node.op_type == "SGD":
        return SGD(), parameters
    if node.op_type == "SGDMomentum":
        return SGDMomentum(momentum=attrs["momentum"], dampening=attrs["dampening"], nesterov=bool(attrs["nesterov"]),
                           weight_decay=attrs["weight_decay"]), parameters
    state_dtype = attrs.get("state_dtype", "float32")
    state_dtype = state_dtype.decode() if isinstance(state_dtype, bytes) else state_dtype
    if state_dtype not in STATE_DTYPES or int(attrs.get("state_block", STATE_BLOCK)) != STATE_BLOCK:
        raise ModelError(f"'{source}' keeps AdamW's moments as {state_dtype} in blocks of "
                         f"{attrs.get('state_block')}; this odtrain reads {list(STATE_DTYPES)} in blocks of "
                         f"{STATE_BLOCK}: generate the artifacts again")
    return AdamW(betas=(attrs["beta1"], attrs["beta2"]), eps=attrs["epsilon"], weight_decay=attrs["weight_decay"],
                 bias_correction=bool(attrs["bias_correction"]), state_dtype=state_dtype), parameters


__all__ = ["OptimType", "STATE_BLOCK", "STATE_DTYPES", "check_state_dtype", "AdamW", "SGD", "SGDMomentum",
           "parse_optimizer", "build_optimizer_graph", "read_optimizer_graph"]
