"""The opset-23 ops of decoder language models — RMSNormalization, RotaryEmbedding, Attention — against
ONNX's reference evaluator (forward) and float64 finite differences (every input's gradient), and the fusion
of the exporters' decomposed RMSNorm, rotary and SiLU patterns onto the same kernels."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from odtrain.graph.fusion import fuse_for_training
from odtrain.graph.onnx_io import graph_from_proto
from oracles import GradientCase, gradient_check, make_model

rng = np.random.default_rng(23)
OPSET = 23


def rand(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def rotary_caches(rows, width, batch=None):
    angles = rng.uniform(0, 3, (rows, width) if batch is None else (batch, rows, width))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


GRADIENT_CASES: dict[str, GradientCase] = {}

for _shape, _axis, _scale_shape in [((3, 8), -1, (8,)), ((2, 3, 4), 1, (3, 4)), ((2, 3, 4), -1, (1,)),
                                    ((2, 2, 3, 4), 2, (3, 4))]:
    GRADIENT_CASES[f"RMSNormalization {_shape} axis={_axis} scale {_scale_shape}"] = GradientCase(
        [node("RMSNormalization", ["x", "scale"], axis=_axis, epsilon=1e-3)],
        {"x": rand(*_shape), "scale": rand(*_scale_shape)}, opset=OPSET)


def _rotary_4d(interleaved, rotary_dim, positions) -> GradientCase:
    batch, heads, seq, head = 2, 3, 4, 6
    rot = rotary_dim or head
    x = rand(batch, heads, seq, head)
    constants = {}
    if positions:
        cos, sin = rotary_caches(seq + 3, rot // 2)
        constants["pos"] = np.array([[0, 2, 4, 6], [1, 1, 3, 5]], np.int64)  # a row used twice
        inputs = ["x", "cos", "sin", "pos"]
    else:
        cos, sin = rotary_caches(seq, rot // 2, batch)
        inputs = ["x", "cos", "sin"]
    return GradientCase([node("RotaryEmbedding", inputs, interleaved=interleaved, rotary_embedding_dim=rotary_dim)],
                        {"x": x, "cos": cos, "sin": sin}, constants, opset=OPSET)


for _interleaved in (0, 1):
    for _rotary_dim in (0, 4):
        for _positions in (True, False):
            GRADIENT_CASES[f"RotaryEmbedding 4d interleaved={_interleaved} rotary_dim={_rotary_dim} "
                           f"positions={_positions}"] = _rotary_4d(_interleaved, _rotary_dim, _positions)

_cos, _sin = rotary_caches(3, 2, 2)
GRADIENT_CASES["RotaryEmbedding 3d num_heads"] = GradientCase(
    [node("RotaryEmbedding", ["x", "cos", "sin"], num_heads=2)], {"x": rand(2, 3, 8), "cos": _cos, "sin": _sin},
    opset=OPSET)

ATTENTION_CASES = {
    "4d": dict(q=(2, 2, 3, 4), k=(2, 2, 5, 4), v=(2, 2, 5, 4)),
    "4d_gqa_causal": dict(q=(2, 4, 5, 4), k=(2, 2, 5, 4), v=(2, 2, 5, 3), attrs=dict(is_causal=1)),
    "4d_scale_softcap": dict(q=(1, 2, 3, 4), k=(1, 2, 4, 4), v=(1, 2, 4, 4), attrs=dict(scale=0.7, softcap=2.0)),
    "4d_float_mask": dict(q=(2, 2, 3, 4), k=(2, 2, 4, 4), v=(2, 2, 4, 4), mask=("float", (2, 1, 3, 4))),
    "4d_bool_mask_causal": dict(q=(2, 2, 4, 4), k=(2, 2, 4, 4), v=(2, 2, 4, 4), mask=("bool", (4, 4)),
                                attrs=dict(is_causal=1)),
    "3d_gqa": dict(q=(2, 3, 8), k=(2, 4, 4), v=(2, 4, 6), attrs=dict(q_num_heads=4, kv_num_heads=2)),
}


def _attention(spec) -> GradientCase:
    params = {"q": rand(*spec["q"]), "k": rand(*spec["k"]), "v": rand(*spec["v"])}
    inputs, constants = ["q", "k", "v"], {}
    if "mask" in spec:
        kind, shape = spec["mask"]
        constants["mask"] = rand(*shape) if kind == "float" else rng.uniform(size=shape) > 0.3
        if kind == "bool":
            constants["mask"][..., 0] = True  # every row keeps a key
        inputs.append("mask")
    return GradientCase([node("Attention", inputs, **spec.get("attrs", {}))], params, constants, opset=OPSET)


for _case, _spec in ATTENTION_CASES.items():
    GRADIENT_CASES[f"Attention {_case}"] = _attention(_spec)


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_gradient(name, tmp_path):
    """Forward against ONNX's reference evaluator (the loss), every input's gradient against float64
    finite differences."""
    GRADIENT_CASES[name].check(tmp_path)


# ---- fusion of the exporters' decomposed patterns ---------------------------------------------------------


def decomposed_rms_norm(x="x", weight="w", out="y", reciprocal="Div"):
    """RMSNorm as the TorchScript (Div) and dynamo (Reciprocal) exporters write LlamaRMSNorm: (nodes, constants)."""
    constants = {"two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32), "one": np.array(1.0, np.float32)}
    nodes = [node("Pow", [x, "two"], ["sq"]), node("ReduceMean", ["sq"], ["mean"], axes=[-1], keepdims=1),
             node("Add", ["mean", "eps"], ["var_eps"]), node("Sqrt", ["var_eps"], ["root"]),
             node("Div", ["one", "root"], ["inverse"]) if reciprocal == "Div" else node("Reciprocal", ["root"], ["inverse"])]
    return nodes + [node("Mul", [x, "inverse"], ["normed"]), node("Mul", [weight, "normed"], [out])], constants


def decomposed_rotary(x="x", cos="cos", sin="sin", out="y", half=2, from_shape=False):
    """x·cos + rotate_half(x)·sin, rotate_half(x) = Concat(-x[..., half:], x[..., :half]), as exported; with
    `from_shape` the boundary is x.shape[-1] // 2 unsqueezed twice, as the TorchScript exporter writes it."""
    consts = {"zero": [0], "end": [2 ** 62], "last": [-1], "axis0": [0], **({} if from_shape else {"half": [half]})}
    nodes = [node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], value))
             for name, value in consts.items()]
    if from_shape:
        scalars = {"three": 3, "two": 2}
        nodes += [node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value]))
                  for name, value in scalars.items()]
        nodes += [node("Shape", [x], ["shape"]), node("Gather", ["shape", "three"], ["width"], axis=0),
                  node("Div", ["width", "two"], ["middle"]), node("Unsqueeze", ["middle", "axis0"], ["half_end"]),
                  node("Unsqueeze", ["middle", "axis0"], ["half_start"])]
    end, start = ("half_end", "half_start") if from_shape else ("half", "half")
    return nodes + [node("Slice", [x, "zero", end, "last"], ["x1"]), node("Slice", [x, start, "end", "last"], ["x2"]),
                    node("Neg", ["x2"], ["neg"]), node("Concat", ["neg", "x1"], ["rotated"], axis=-1),
                    node("Mul", [x, cos], ["xc"]), node("Mul", ["rotated", sin], ["rs"]), node("Add", ["xc", "rs"], [out])]


def fused_ops(model):
    graph = graph_from_proto(model, "model")
    return sorted(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in fuse_for_training(graph).nodes
                  if n.op_type != "Constant")


@pytest.mark.parametrize("reciprocal", ["Div", "Reciprocal"])
def test_decomposed_rms_norm_fuses_and_keeps_its_gradients(reciprocal, tmp_path):
    nodes, constants = decomposed_rms_norm(reciprocal=reciprocal)
    params = {"x": rand(2, 3, 8), "w": rand(8)}
    model = make_model(nodes, {**params, **constants}, outputs=[("y", np.float32, [2, 3, 8])], opset=17)
    assert fused_ops(model) == ["ai.odtrain::RMSNormalization"]
    gradient_check(nodes, params, constants=constants, tmp_path=tmp_path, opset=17)


@pytest.mark.parametrize("cos_shape, from_shape", [((1, 1, 4, 4), False), ((2, 1, 4, 4), False), ((1, 4, 4), True)],
                         ids=str)
def test_decomposed_rotary_fuses_and_keeps_its_gradients(cos_shape, from_shape, tmp_path):
    """Caches of the full head width, broadcast over heads (and batch); their halves differ here on purpose:
    the fused op computes what the decomposed ops compute, not what it assumes of them."""
    nodes = decomposed_rotary(from_shape=from_shape)
    params = {"x": rand(2, 3, 4, 4), "cos": rand(*cos_shape), "sin": rand(*cos_shape)}
    model = make_model(nodes, params, inputs=(), outputs=[("y", np.float32, [2, 3, 4, 4])], opset=17)
    ops = fused_ops(model)  # what computes the boundary from x's shape stays
    assert "ai.odtrain::RotaryEmbedding" in ops and not {"Slice", "Neg", "Concat", "Mul", "Add"} & set(ops)
    gradient_check(nodes, params, tmp_path=tmp_path, opset=17)


def test_only_a_private_sigmoid_of_the_other_operand_fuses_into_swish():
    """The SiLU gate Mul(x, Sigmoid(x)) becomes one Swish; a GLU's Mul(u, Sigmoid(x)), a Sigmoid also read
    elsewhere and a float64 SiLU (Swish's kernels are float32) keep their ops."""
    x, u = rand(2, 3), rand(2, 3)
    silu = [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"])]
    cases = [(silu, {"x": x}, ["ai.odtrain::Swish"]),
             ([silu[0], node("Mul", ["u", "s"])], {"x": x, "u": u}, ["Mul", "Sigmoid"]),
             (silu + [node("Identity", ["s"], ["s_copy"])], {"x": x}, ["Identity", "Mul", "Sigmoid"]),
             (silu, {"x": x.astype(np.float64)}, ["Mul", "Sigmoid"])]
    for nodes, params, expected in cases:
        outputs = [o for n in nodes for o in n.output if o in ("y", "s_copy")]
        assert fused_ops(make_model(nodes, params, outputs=outputs, opset=17)) == expected, nodes


def test_a_rotary_whose_pieces_are_read_elsewhere_is_left_alone():
    nodes = decomposed_rotary() + [node("Identity", ["x1"], ["x1_copy"])]
    params = {"x": rand(1, 1, 2, 4), "cos": rand(1, 1, 2, 4), "sin": rand(1, 1, 2, 4)}
    model = make_model(nodes, params, outputs=[("y", np.float32, [1, 1, 2, 4]), ("x1_copy", np.float32, [1, 1, 2, 2])],
                       opset=17)
    assert "ai.odtrain::RotaryEmbedding" not in fused_ops(model)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_rows_without_a_mask_match_the_masked_path(causal):
    """Attention without a mask (or with causality alone) takes its own loops (the scores straight into the
    probabilities, a causal row's softmax over the keys it sees); the same product with an all-zero float mask
    (or the causal lower triangle as a boolean mask) takes the general one. They agree, forward and backward;
    a row that sees one key gives that key's value."""
    from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN, SCRATCH

    batch, seq, heads, head = 2, 9, 2, 4
    q, k, v, dy = (rand(batch, seq, heads * head) for _ in range(4))
    attrs = {"q_num_heads": heads, "kv_num_heads": heads}
    mask = np.tril(np.ones((seq, seq), bool)) if causal else np.zeros((seq, seq), np.float32)

    def run(inputs, **more):
        specs = [(x.shape, x.dtype) for x in inputs]
        y, grads = np.empty_like(q), [np.empty_like(q) for _ in range(3)]
        forward = BINDINGS[("", "Attention")](inputs, [y], scratch=np.zeros(SCRATCH[("", "Attention")](
            specs, [specs[0]], **attrs, **more), np.uint8), **attrs, **more)
        key = (ODTRAIN_DOMAIN, "AttentionGrad")
        backward_inputs = [dy] + inputs[:3] + ([inputs[3]] if len(inputs) > 3 else [])
        backward_specs = [(x.shape, x.dtype) for x in backward_inputs]
        backward = BINDINGS[key](backward_inputs, grads, scratch=np.zeros(SCRATCH[key](
            backward_specs, specs[:3], **attrs, **more), np.uint8), **attrs, **more)
        for kernel, args in forward + backward:
            kernel(*args)
        return [y] + grads

    fast = run([q, k, v], is_causal=causal)
    general = run([q, k, v, mask])
    for got, expected in zip(fast, general):  # without a mask the same sums (measured: the same bits); causal
        # rows sum fewer terms in another order (measured: 1.2e-7 absolute, 8.4e-7 relative at most on Y)
        np.testing.assert_allclose(got, expected, rtol=1e-5 if causal else 0, atol=1e-6 if causal else 0)
    if causal:  # the first query sees the first key alone
        np.testing.assert_array_equal(fast[0][:, 0], v[:, 0])
