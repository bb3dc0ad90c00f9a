"""Recurrent layers: GRU and LSTM (forward, reverse, bidirectional; sequence_lens; layout 0 or 1).

Shapes for layout 0 (layout 1 swaps the first two axes of X, Y, the initial
and final states): X [T, N, I], W [D, G·H, I], R [D, G·H, H], B [D, 2·G·H],
sequence_lens [N], initial_h/c [D, N, H], P [D, 3H]; Y [T, D, N, H],
Y_h/Y_c [D, N, H]; G = 3 gates for GRU (z, r, h), 4 for LSTM (i, o, f, c).
Steps at or past a sample's length leave its state unchanged and its Y zero.

Backpropagation through time is one op per layer, `GRUGrad`/`LSTMGrad`: it
reads X, the weights, the initial states and the forward's Y (all hidden
states, so the gates are recomputed with two large products instead of a
step-by-step replay), walks the steps backwards, and gives dX, dW, dR, dB and
the initial states' gradients (plus dP for LSTM).
"""
from __future__ import annotations

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op

DEFAULT_ACTIVATIONS = {"GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}
GATES = {"GRU": 3, "LSTM": 4}
DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


def recurrent_config(node) -> tuple[int, int, int]:
    """(directions, hidden size, layout), after refusing attributes odtrain does not support."""
    attrs = node.attrs
    direction = attrs.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise ModelError(f"{node.describe()}: unknown direction '{direction}'")
    dirs = DIRECTIONS[direction]
    activations = [str(a).lower() for a in attrs.get("activations", [])]
    if activations and activations != DEFAULT_ACTIVATIONS[node.op_type] * dirs:
        raise ModelError(f"{node.describe()}: activations {attrs['activations']} are not supported; odtrain runs "
                         f"the default ones ({DEFAULT_ACTIVATIONS[node.op_type]})")
    if attrs.get("clip") is not None:
        raise ModelError(f"{node.describe()}: the clip attribute is not supported")
    if attrs.get("input_forget", 0):
        raise ModelError(f"{node.describe()}: input_forget=1 is not supported")
    if attrs.get("activation_alpha") or attrs.get("activation_beta"):
        raise ModelError(f"{node.describe()}: activation_alpha/activation_beta are not supported")
    if "hidden_size" not in attrs:
        raise ModelError(f"{node.describe()}: the hidden_size attribute is required")
    return dirs, int(attrs["hidden_size"]), int(attrs.get("layout", 0))


def _recurrent_rule(node, types, consts):
    dirs, hidden, layout = recurrent_config(node)
    x, w = types[0], types[1]
    gates = GATES[node.op_type]
    if x.shape is None:
        return [TensorType(x.dtype, None)] * len(node.outputs)
    if len(x.shape) != 3:
        raise ModelError(f"{node.describe()}: X must be 3-D, got {x}")
    if w.shape is not None and (len(w.shape) != 3 or w.shape[0] != dirs or w.shape[1] != gates * hidden):
        raise ModelError(f"{node.describe()}: W must be [{dirs}, {gates * hidden}, input], got {w}")
    steps, batch = (x.shape[0], x.shape[1]) if layout == 0 else (x.shape[1], x.shape[0])
    if layout == 0:
        y, state = (steps, dirs, batch, hidden), (dirs, batch, hidden)
    else:
        y, state = (batch, steps, dirs, hidden), (batch, dirs, hidden)
    out = [TensorType(x.dtype, y), TensorType(x.dtype, state), TensorType(x.dtype, state)]
    return out[:len(node.outputs)]


def _recurrent_flops(node, types, out) -> float:  # every step multiplies the input by W and the state by R
    x, w = types[0], types[1]
    recurrent = types[2] if len(types) > 2 and types[2] is not None and types[2].is_static else None
    rows = x.size // max(x.shape[-1], 1)  # steps · batch
    return 2.0 * rows * (w.size + (recurrent.size if recurrent else 0))


op("GRU", flops=_recurrent_flops)(_recurrent_rule)
op("LSTM", flops=_recurrent_flops)(_recurrent_rule)


def _recurrent_grad(ctx, kind: str):
    node = ctx.node
    y = ctx.forward_output(0, f"{node.name or kind}_Y")  # the backward pass reads every hidden state
    count = 8 if kind == "LSTM" else 6  # forward inputs: X W R B sequence_lens initial_h (initial_c P)
    inputs = [ctx.I(i) for i in range(count)] + [y] + [ctx.GO(i) for i in range(len(node.outputs))]
    inputs += [""] * (count + 1 + (3 if kind == "LSTM" else 2) - len(inputs))
    attrs = {k: v for k, v in node.attrs.items() if k in ("direction", "hidden_size", "layout", "linear_before_reset")}
    grads = ctx.odtrain(f"{kind}Grad", inputs, attrs, outputs=count)
    for i in range(count):
        if i != 4 and ctx.needs(i):  # sequence_lens is an integer input
            ctx.set_grad(i, grads[i])


grad("GRU")(lambda ctx: _recurrent_grad(ctx, "GRU"))
grad("LSTM")(lambda ctx: _recurrent_grad(ctx, "LSTM"))


def _recurrent_grad_rule(node, types, consts):
    """Outputs: the gradients of the forward inputs, each of its input's type (a default type if omitted)."""
    kind = node.op_type[:-len("Grad")]
    dirs, hidden, layout = DIRECTIONS[node.attrs.get("direction", "forward")], int(node.attrs["hidden_size"]), \
        int(node.attrs.get("layout", 0))
    x = types[0]
    gates = GATES[kind]
    steps, batch = (x.shape[0], x.shape[1]) if layout == 0 else (x.shape[1], x.shape[0])
    state = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    defaults = [x.shape, (dirs, gates * hidden, x.shape[2]), (dirs, gates * hidden, hidden), (dirs, 2 * gates * hidden),
                (batch,), state, state, (dirs, 3 * hidden)]
    count = 8 if kind == "LSTM" else 6
    return [TensorType(x.dtype, defaults[i] if types[i] is None else types[i].shape) for i in range(count)]


op("GRUGrad", ODTRAIN_DOMAIN)(_recurrent_grad_rule)
op("LSTMGrad", ODTRAIN_DOMAIN)(_recurrent_grad_rule)
