"""Rotary embeddings and attention (opset 23), and the fused rotary form of the training model.

RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) -> Y, X 4-D [batch, heads, seq, head] or
3-D [batch, seq, heads·head] (num_heads given); the caches hold rot/2 values per row, indexed by
position_ids ([positions, rot/2]) or by (batch, seq) ([batch, seq, rot/2]). The rotation is
linear in X, so dX is the transposed rotation of dY; the caches' gradients need X too.
RotaryEmbeddingGrad(dY, cos, sin, position_ids?, X?) -> dX?, dcos?, dsin?.

ai.odtrain RotaryEmbedding(X, cos, sin, split) is what graph/fusion.py writes for the exported
`X·cos + rotate_half(X)·sin`, rotate_half(X) = Concat(-X[..., split:], X[..., :split]): caches of
the full head width broadcast to X [batch, heads, seq, head]; `split` (the Slices' boundary, often
computed from X's shape) must be known when the step is bound. Its gradient op takes the split
where ONNX's takes position_ids.

Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?) -> Y, present_key?,
present_value?, qk_matmul_output? (kernels/attention.py states the computation). Its gradient,
AttentionGrad(dY, Q, K, V, attn_mask?, nonpad_kv_seqlen?) -> dQ?, dK?, dV?, covers attention
without a key/value cache; masks (and the cache) receive no gradient.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op

ROTARY_ATTRIBUTES = ("interleaved", "num_heads", "rotary_embedding_dim")
ATTENTION_ATTRIBUTES = ("scale", "is_causal", "q_num_heads", "kv_num_heads", "softcap", "left_window_size",
                        "right_window_size")


def _float32(node, t: TensorType, what: str) -> None:
    if t.dtype != np.float32:
        raise UnsupportedOpError(f"{node.describe()}: {what} is {t.dtype}; odtrain runs this op on float32")


def _dims_product(*dims):
    if all(isinstance(d, int) for d in dims):
        return int(np.prod(dims, dtype=np.int64))
    return "*".join(str(d) for d in dims)


def _dims_sum(a, b):
    return a + b if isinstance(a, int) and isinstance(b, int) else f"{a}+{b}"


# ---- rotary embeddings ----------------------------------------------------------------------------------


@op("RotaryEmbedding")
def _rotary_rule(node, types, consts):
    x, cos, sin = types[:3]
    positions = types[3] if len(types) > 3 else None
    _float32(node, x, "X")
    if x.shape is None:
        return [x]
    if len(x.shape) not in (3, 4):
        raise ModelError(f"{node.describe()}: X must be 3-D or 4-D, got {x}")
    num_heads = int(node.attrs.get("num_heads", 0))
    if len(x.shape) == 3:
        if num_heads <= 0:
            raise ModelError(f"{node.describe()}: a 3-D X needs the num_heads attribute")
        head_size = x.shape[2] // num_heads if isinstance(x.shape[2], int) else None
    else:
        head_size = x.shape[3] if isinstance(x.shape[3], int) else None
    rot = int(node.attrs.get("rotary_embedding_dim", 0)) or head_size
    if rot is not None and (rot % 2 or (head_size is not None and rot > head_size)):
        raise ModelError(f"{node.describe()}: the rotary dimension {rot} must be even and at most the head size "
                         f"{head_size}")
    want_rank = 2 if positions is not None else 3
    for t, what in ((cos, "cos_cache"), (sin, "sin_cache")):
        width = t.shape[-1] if t.shape else None
        if t.shape is not None and (len(t.shape) != want_rank or (rot and isinstance(width, int) and width != rot // 2)):
            raise ModelError(f"{node.describe()}: {what} must be {want_rank}-D with rot/2 = {rot // 2 if rot else '?'} "
                             f"values per row, got {t}")
    return [x]


@op("RotaryEmbedding", ODTRAIN_DOMAIN)
def _rotary_full_width_rule(node, types, consts):
    x = types[0]
    _float32(node, x, "X")
    if x.shape is not None and len(x.shape) != 4:
        raise ModelError(f"{node.describe()}: X must be [batch, heads, seq, head], got {x}")
    for t in types[1:3]:
        if x.shape is not None and t.shape is not None and (len(t.shape) > 4 or t.shape[-1] != x.shape[-1]):
            raise ModelError(f"{node.describe()}: caches must broadcast to X {x} with its full head width, got {t}")
    if x.shape is not None and x.is_static and consts[3] is None:
        raise ModelError(f"{node.describe()}: the point '{node.inputs[3]}' where rotate_half splits the head is "
                         "not known when the step is bound")
    return [x]


def _rotary_grad(ctx, full_width: bool):  # dX = Rᵀ·dY (the inverse rotation); dcos, dsin from dY and X
    attrs = {k: ctx.attr(k) for k in ROTARY_ATTRIBUTES if ctx.attr(k) is not None}
    attrs["full_width"] = int(full_width)
    caches = ctx.needs(1) or ctx.needs(2)
    _first_three_grads(ctx, "RotaryEmbeddingGrad", [ctx.GO(0), ctx.I(1), ctx.I(2), ctx.I(3),  # I(3): split or ids
                                                    ctx.I(0) if caches else ""], attrs)


def _first_three_grads(ctx, op_type: str, inputs: list[str], attrs: dict) -> None:
    """Emit the gradient op (trailing omitted inputs dropped) whose outputs are inputs 0-2's gradients."""
    while not inputs[-1]:
        inputs.pop()
    grads = ctx.odtrain(op_type, inputs, attrs, outputs=[ctx.needs(0), ctx.needs(1), ctx.needs(2)])
    for i in range(3):
        if ctx.needs(i):
            ctx.set_grad(i, grads[i])


grad("RotaryEmbedding")(lambda ctx: _rotary_grad(ctx, False))
grad("RotaryEmbedding", ODTRAIN_DOMAIN)(lambda ctx: _rotary_grad(ctx, True))


@op("RotaryEmbeddingGrad", ODTRAIN_DOMAIN)
def _rotary_grad_rule(node, types, consts):
    return [types[0], types[1], types[2]]


# ---- attention --------------------------------------------------------------------------------------------


def _attention_heads(node, q: TensorType, k: TensorType, v: TensorType):
    """(q heads, kv heads, head size, value head size) of 3-D or 4-D inputs, validated."""
    if q.shape is None or k.shape is None or v.shape is None:
        raise ModelError(f"{node.describe()}: Q, K and V need known ranks")
    if not len(q.shape) == len(k.shape) == len(v.shape) or len(q.shape) not in (3, 4):
        raise ModelError(f"{node.describe()}: Q, K and V must all be 3-D or all 4-D, got {q}, {k}, {v}")
    if len(q.shape) == 4:
        q_heads, kv_heads, head, v_head = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
        if v.shape[1] != kv_heads:
            raise ModelError(f"{node.describe()}: K and V have different head counts ({k}, {v})")
    else:
        q_heads, kv_heads = int(node.attrs.get("q_num_heads", 0)), int(node.attrs.get("kv_num_heads", 0))
        if q_heads <= 0 or kv_heads <= 0:
            raise ModelError(f"{node.describe()}: 3-D inputs need the q_num_heads and kv_num_heads attributes")
        head = q.shape[2] // q_heads if isinstance(q.shape[2], int) else None
        v_head = v.shape[2] // kv_heads if isinstance(v.shape[2], int) else None
    if isinstance(q_heads, int) and isinstance(kv_heads, int) and q_heads % kv_heads:
        raise ModelError(f"{node.describe()}: {q_heads} query heads do not divide into {kv_heads} key/value heads")
    return q_heads, kv_heads, head, v_head


@op("Attention")
def _attention_rule(node, types, consts):
    q, k, v = types[:3]
    mask, past_key, past_value, nonpad = (types[i] if len(types) > i else None for i in range(3, 7))
    for t, what in ((q, "Q"), (k, "K"), (v, "V")):
        _float32(node, t, what)
    q_heads, kv_heads, head, v_head = _attention_heads(node, q, k, v)
    if (past_key is None) != (past_value is None):
        raise ModelError(f"{node.describe()}: past_key and past_value must be given together")
    if past_key is not None and nonpad is not None:
        raise ModelError(f"{node.describe()}: nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if mask is not None and (mask.shape is None or len(mask.shape) > 4):
        raise ModelError(f"{node.describe()}: attn_mask must have rank 1 to 4, got {mask}")
    if mask is not None and mask.dtype not in (np.float32, np.bool_):
        raise UnsupportedOpError(f"{node.describe()}: attn_mask is {mask.dtype}; odtrain takes bool or float32 masks")
    batch, seq = q.shape[0], q.shape[2] if len(q.shape) == 4 else q.shape[1]
    new_keys = k.shape[2] if len(k.shape) == 4 else k.shape[1]
    keys = _dims_sum(past_key.shape[2], new_keys) if past_key is not None else new_keys
    if len(q.shape) == 4:
        y = TensorType(q.dtype, (batch, q_heads, seq, v_head))
    else:
        y = TensorType(q.dtype, (batch, seq, _dims_product(q_heads, v_head)))
    outputs = [y, TensorType(k.dtype, (batch, kv_heads, keys, head)), TensorType(v.dtype, (batch, kv_heads, keys, v_head)),
               TensorType(q.dtype, (batch, q_heads, seq, keys))]
    return outputs[:len(node.outputs)]


@grad("Attention")
def _attention_grad(ctx):  # dV = Pᵀ·dY;  dT = P ⊙ (dY·Vᵀ - rowsum);  dQ = scale·dT·K;  dK = scale·dTᵀ·Q
    node = ctx.node
    if ctx.I(4) or ctx.I(5):
        raise UnsupportedOpError(f"{node.describe()}: its gradient is for attention without a key/value cache "
                                 "(past_key/past_value); export the model for training without a cache")
    if ctx.GO(1) or ctx.GO(2) or ctx.GO(3):
        raise UnsupportedOpError(f"{node.describe()}: the loss depends on its present_key, present_value or "
                                 "qk_matmul_output, whose gradients are not implemented; only Y has one")
    if ctx.needs(3):
        raise UnsupportedOpError(f"{node.describe()}: a trainable parameter feeds its attn_mask, which gets no "
                                 "gradient; freeze it")
    attrs = {k: ctx.attr(k) for k in ATTENTION_ATTRIBUTES if ctx.attr(k) is not None}
    _first_three_grads(ctx, "AttentionGrad", [ctx.GO(0), ctx.I(0), ctx.I(1), ctx.I(2), ctx.I(3), ctx.I(6)], attrs)


@op("AttentionGrad", ODTRAIN_DOMAIN)
def _attention_grad_rule(node, types, consts):
    return [types[1], types[2], types[3]]
