"""Every gradient rule against float64 finite differences of ONNX's reference evaluator."""
import numpy as np
import onnx
import pytest
from onnx import helper

from oracles import gradient_check

rng = np.random.default_rng(42)


def rand(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def away_from_zero(*shape):
    x = rand(*shape)
    return (np.sign(x) * (np.abs(x) + 0.2)).astype(np.float32)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


BINARY_CASES = [
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),
    ((2, 1, 3), (4, 1)),
    ((1,), (2, 3)),
]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", BINARY_CASES, ids=str)
def test_binary(op, shapes, tmp_path):
    a = rand(*shapes[0])
    b = away_from_zero(*shapes[1]) if op == "Div" else rand(*shapes[1])
    gradient_check([node(op, ["a", "b"])], {"a": a, "b": b}, tmp_path=tmp_path)


UNARY_CASES = {
    "Neg": rand(2, 3), "Abs": away_from_zero(2, 3), "Exp": rand(2, 3), "Log": rand(2, 3, low=0.5, high=2.0),
    "Sqrt": rand(2, 3, low=0.5, high=2.0), "Reciprocal": away_from_zero(2, 3), "Relu": away_from_zero(2, 3),
    "Sigmoid": rand(2, 3, low=-3, high=3), "Tanh": rand(2, 3, low=-2, high=2), "Identity": rand(2, 3),
}


@pytest.mark.parametrize("op", sorted(UNARY_CASES))
def test_unary(op, tmp_path):
    gradient_check([node(op, ["x"])], {"x": UNARY_CASES[op]}, tmp_path=tmp_path)


def test_sum_of_three_with_broadcast(tmp_path):
    gradient_check([node("Sum", ["a", "b", "c"])], {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)}, tmp_path=tmp_path)


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias_shape", [(4,), (3, 4), (1, 4), (3, 1), None], ids=str)
def test_gemm(trans_a, trans_b, bias_shape, tmp_path):
    a = rand(*((2, 3) if trans_a else (3, 2)))
    b = rand(*((4, 2) if trans_b else (2, 4)))
    params = {"a": a, "b": b}
    inputs = ["a", "b"]
    if bias_shape is not None:
        params["c"] = rand(*bias_shape)
        inputs.append("c")
    gradient_check([node("Gemm", inputs, transA=trans_a, transB=trans_b, alpha=0.7, beta=1.3)], params, tmp_path=tmp_path)


@pytest.mark.parametrize("shapes", [((3, 4), (4, 2)), ((2, 3, 4), (4, 2)), ((2, 3, 4), (2, 4, 5)),
                                    ((1, 3, 4), (2, 4, 2)), ((3, 4), (2, 4, 2))], ids=str)
def test_matmul(shapes, tmp_path):
    gradient_check([node("MatMul", ["a", "b"])], {"a": rand(*shapes[0]), "b": rand(*shapes[1])}, tmp_path=tmp_path)


def test_reshape(tmp_path):
    gradient_check([node("Reshape", ["x", "shape"])], {"x": rand(2, 3, 2)},
                   constants={"shape": np.array([3, -1], dtype=np.int64)}, tmp_path=tmp_path)


def test_flatten(tmp_path):
    gradient_check([node("Flatten", ["x"], axis=2)], {"x": rand(2, 3, 2, 2)}, tmp_path=tmp_path)


def test_transpose(tmp_path):
    gradient_check([node("Transpose", ["x"], perm=[2, 0, 1])], {"x": rand(2, 3, 4)}, tmp_path=tmp_path)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [0, 2], None], ids=str)
def test_reduce_sum(axes, keepdims, tmp_path):
    constants, inputs = {}, ["x"]
    if axes is not None:
        constants["axes"] = np.array(axes, dtype=np.int64)
        inputs.append("axes")
    gradient_check([node("ReduceSum", inputs, keepdims=keepdims)], {"x": rand(2, 3, 4)}, constants=constants,
                   tmp_path=tmp_path)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[-1], [0, 1], None], ids=str)
def test_reduce_mean(axes, keepdims, tmp_path):
    attrs = {"keepdims": keepdims}
    if axes is not None:
        attrs["axes"] = axes
    gradient_check([node("ReduceMean", ["x"], **attrs)], {"x": rand(2, 3, 4)}, tmp_path=tmp_path)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy(reduction, weighted, tmp_path):
    labels = np.array([[0, 2], [1, 3], [3, 3]], dtype=np.int64)  # [N=3, D=2], C=4, one ignored label
    params, inputs = {"scores": rand(3, 4, 2, low=-2, high=2)}, ["scores", "labels"]
    constants = {"labels": labels}
    if weighted:
        constants["weights"] = np.array([0.5, 1.0, 2.0, 1.5], dtype=np.float32)
        inputs.append("weights")
    gradient_check([node("SoftmaxCrossEntropyLoss", inputs, reduction=reduction, ignore_index=2)], params,
                   constants=constants, tmp_path=tmp_path)


def test_chain_with_fan_out(tmp_path):
    """A value used twice (x feeds Mul and Add) receives the sum of both gradients."""
    nodes = [node("Mul", ["x", "w"], ["h"]), node("Tanh", ["h"], ["t"]), node("Add", ["t", "x"], ["y"])]
    gradient_check(nodes, {"x": rand(2, 3), "w": rand(3)}, tmp_path=tmp_path)


# ---- text and sequence models: indexing, normalisation, attention, recurrent layers --------------------


def test_gather_embedding_with_repeated_indices(tmp_path):
    """The scatter-add gradient sums the rows of every repeated token."""
    indices = np.array([[0, 2, 2], [4, 0, 2]], dtype=np.int64)
    gradient_check([node("Gather", ["emb", "ids"])], {"emb": rand(5, 3)}, constants={"ids": indices},
                   tmp_path=tmp_path)


def test_gather_axis_with_negative_indices(tmp_path):
    gradient_check([node("Gather", ["x", "ids"], axis=1)], {"x": rand(2, 4, 3)},
                   constants={"ids": np.array([3, -1, 0, 3], dtype=np.int64)}, tmp_path=tmp_path)


def test_gather_elements(tmp_path):
    indices = np.array([[0, 2, 2], [1, 1, 0]], dtype=np.int64)
    gradient_check([node("GatherElements", ["x", "ids"], axis=1)], {"x": rand(2, 4)},
                   constants={"ids": indices}, tmp_path=tmp_path)


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements(reduction, tmp_path):
    indices = np.array([[1, 0], [2, 2]], dtype=np.int64) if reduction == "add" else np.array([[1, 0], [2, 3]],
                                                                                              dtype=np.int64)
    gradient_check([node("ScatterElements", ["data", "ids", "updates"], axis=1, reduction=reduction)],
                   {"data": rand(2, 4), "updates": rand(2, 2)}, constants={"ids": indices}, tmp_path=tmp_path)


def test_scatter_nd_and_gather_nd(tmp_path):
    nodes = [node("ScatterND", ["data", "ids", "updates"], ["s"]), node("GatherND", ["s", "pick"])]
    gradient_check(nodes, {"data": rand(4, 3), "updates": rand(2, 3)},
                   constants={"ids": np.array([[1], [3]], dtype=np.int64),
                              "pick": np.array([[0, 1], [1, 2], [1, 2], [3, 0]], dtype=np.int64)}, tmp_path=tmp_path)


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_normalization(axis, bias, tmp_path):
    shape = (3, 4) if axis == -1 else (2, 3, 4)
    x = rand(2, *shape) if axis == 1 else rand(2, 3, 4)
    normalised = x.shape[axis:] if axis != -1 else x.shape[-1:]
    params = {"x": x, "scale": rand(*normalised, low=0.5, high=1.5)}
    inputs = ["x", "scale"]
    if bias:
        params["bias"] = rand(*normalised)
        inputs.append("bias")
    gradient_check([node("LayerNormalization", inputs, axis=axis, epsilon=1e-3)], params, tmp_path=tmp_path)


def test_layer_normalization_with_statistics_outputs_and_broadcast_scale(tmp_path):
    nodes = [node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv_std_dev"], axis=1)]
    gradient_check(nodes, {"x": rand(2, 3, 4), "scale": rand(4, low=0.5, high=1.5), "bias": rand(1)},
                   tmp_path=tmp_path)


def test_rms_normalisation_from_primitives(tmp_path):
    """RMSNorm as exported: x / sqrt(mean(x²) + ε) · scale."""
    nodes = [node("Pow", ["x", "two"], ["sq"]), node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             node("Add", ["ms", "eps"], ["ms_eps"]), node("Sqrt", ["ms_eps"], ["rms"]),
             node("Div", ["x", "rms"], ["normed"]), node("Mul", ["normed", "scale"])]
    gradient_check(nodes, {"x": rand(2, 3, 4), "scale": rand(4)},
                   constants={"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32)}, tmp_path=tmp_path)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax(op, axis, tmp_path):
    gradient_check([node(op, ["x"], axis=axis)], {"x": rand(2, 3, 4, low=-2, high=2)}, tmp_path=tmp_path)


TEXT_UNARY = {"Erf": rand(2, 3, low=-2, high=2), "Atan": rand(2, 3, low=-2, high=2)}


@pytest.mark.parametrize("op", sorted(TEXT_UNARY))
def test_text_unary(op, tmp_path):
    # ONNX's reference Erf rounds to float32: a larger step keeps its rounding out of the differences
    gradient_check([node(op, ["x"])], {"x": TEXT_UNARY[op]}, tmp_path=tmp_path, step=1e-3 if op == "Erf" else 1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate, tmp_path):
    gradient_check([node("Gelu", ["x"], approximate=approximate)], {"x": rand(2, 5, low=-3, high=3)}, opset=20,
                   tmp_path=tmp_path, step=1e-3)  # the reference's erf rounds to float32


def test_erf_gelu_as_exported(tmp_path):
    """PyTorch's exact GELU: x · (erf(x / √2) + 1) · 0.5, x used twice."""
    nodes = [node("Div", ["x", "root2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["a"]),
             node("Mul", ["x", "a"], ["m"]), node("Mul", ["m", "half"])]
    gradient_check(nodes, {"x": rand(3, 4, low=-3, high=3)},
                   constants={"root2": np.array(1.4142135, np.float32), "one": np.array(1.0, np.float32),
                              "half": np.array(0.5, np.float32)}, tmp_path=tmp_path, step=1e-3)


def test_pow(tmp_path):
    gradient_check([node("Pow", ["a", "b"])], {"a": rand(2, 3, low=0.5, high=2.0), "b": rand(3, low=-1.5, high=2.0)},
                   tmp_path=tmp_path)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_with_broadcast(op, tmp_path):
    gradient_check([node(op, ["a", "b", "c"])], {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)}, tmp_path=tmp_path)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceL2"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_min_l2(op, keepdims, tmp_path):
    gradient_check([node(op, ["x"], axes=[1], keepdims=keepdims)], {"x": rand(2, 3, 4)}, tmp_path=tmp_path)


def test_reduce_max_shares_the_gradient_among_ties(tmp_path):
    nodes = [node("Relu", ["x"], ["r"]), node("ReduceMax", ["r"], keepdims=0, axes=[1])]
    gradient_check(nodes, {"x": np.array([[-1.0, -2.0, -0.5], [0.3, -1.0, 0.7]], np.float32)}, tmp_path=tmp_path)


@pytest.mark.parametrize("shapes", [((2, 1, 3, 4), (1, 3, 4, 2)), ((2, 2, 3, 4), (2, 2, 4, 3)), ((4,), (2, 4, 3)),
                                    ((2, 3, 4), (4,)), ((4,), (4,)), ((1, 3, 4), (4, 2))], ids=str)
def test_matmul_broadcast_and_vectors(shapes, tmp_path):
    gradient_check([node("MatMul", ["a", "b"])], {"a": rand(*shapes[0]), "b": rand(*shapes[1])}, tmp_path=tmp_path)


def test_attention_block(tmp_path):
    """Scaled dot-product attention on [batch, heads, seq, dim] with a key-padding mask."""
    mask = np.zeros((2, 1, 1, 3), np.float32)
    mask[1, ..., 2] = -1e4
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
             node("Mul", ["s", "scale"], ["ss"]), node("Add", ["ss", "mask"], ["sm"]),
             node("Softmax", ["sm"], ["p"], axis=-1), node("MatMul", ["p", "v"])]
    gradient_check(nodes, {"q": rand(2, 2, 3, 4), "k": rand(2, 2, 3, 4), "v": rand(2, 2, 3, 4)},
                   constants={"scale": np.array(0.5, np.float32), "mask": mask}, tmp_path=tmp_path)


def test_squeeze_unsqueeze_expand(tmp_path):
    nodes = [node("Unsqueeze", ["x", "ax0"], ["u"]), node("Expand", ["u", "shape"], ["e"]),
             node("Squeeze", ["e", "ax3"])]
    gradient_check(nodes, {"x": rand(3, 1, 1)},
                   constants={"ax0": np.array([0], np.int64), "shape": np.array([2, 3, 4, 1], np.int64),
                              "ax3": np.array([3], np.int64)}, tmp_path=tmp_path)


def test_where_with_padding_mask(tmp_path):
    """masked_fill as exported: Where(Equal(tokens, pad), -big, scores)."""
    tokens = np.array([[5, 0, 3], [0, 0, 7]], np.int64)
    nodes = [node("Equal", ["tokens", "pad"], ["is_pad"]), node("Where", ["is_pad", "big", "a"], ["w"]),
             node("Where", ["is_pad", "b", "w"])]
    gradient_check(nodes, {"a": rand(2, 3), "b": rand(3)},
                   constants={"tokens": tokens, "pad": np.array(0, np.int64), "big": np.array(-1e4, np.float32)},
                   tmp_path=tmp_path)


@pytest.mark.parametrize("steps", [[1, 2], [-1, -2]], ids=["forward", "negative_steps"])
def test_slice(steps, tmp_path):
    starts, ends = ([0, 1], [3, 4]) if steps[0] > 0 else ([-1, 3], [-10, 0])
    gradient_check([node("Slice", ["x", "starts", "ends", "axes", "steps"])], {"x": rand(3, 5, 2)},
                   constants={"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
                              "axes": np.array([0, 1], np.int64), "steps": np.array(steps, np.int64)},
                   tmp_path=tmp_path)


def test_concat_split_tile(tmp_path):
    nodes = [node("Concat", ["a", "b", "a"], ["c"], axis=1),
             node("Split", ["c", "sizes"], ["s0", "s1", "s2"], axis=1),
             node("Tile", ["s1", "repeats"], ["t"]), node("Mul", ["t", "s2"])]
    gradient_check(nodes, {"a": rand(2, 2), "b": rand(2, 3)},
                   constants={"sizes": np.array([3, 2, 2], np.int64), "repeats": np.array([1, 1], np.int64)},
                   tmp_path=tmp_path)


def test_tile(tmp_path):
    gradient_check([node("Tile", ["x", "repeats"])], {"x": rand(2, 1, 3)},
                   constants={"repeats": np.array([2, 3, 1], np.int64)}, tmp_path=tmp_path)


def test_comparison_mask(tmp_path):
    """x · Where(x > 0, 1, 0): the comparison has no gradient, Where passes it through."""
    nodes = [node("Greater", ["x", "zero"], ["positive"]), node("Where", ["positive", "one", "zero"], ["mask"]),
             node("Mul", ["x", "mask"])]
    gradient_check(nodes, {"x": away_from_zero(2, 3)},
                   constants={"zero": np.array(0.0, np.float32), "one": np.array(1.0, np.float32)}, tmp_path=tmp_path)


def _recurrent_check(kind, tmp_path, direction="forward", layout=0, hidden=3, with_state=True, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    gates = 3 if kind == "GRU" else 4
    steps, batch, features = 3, 2, 2
    x = rand(steps, batch, features) if layout == 0 else rand(batch, steps, features)
    state_shape = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    params = {"x": x, "w": rand(dirs, gates * hidden, features), "r": rand(dirs, gates * hidden, hidden),
              "b": rand(dirs, 2 * gates * hidden)}
    inputs = ["x", "w", "r", "b", ""]
    if with_state:
        params["h0"] = rand(*state_shape)
        inputs.append("h0")
    outputs = ["Y", "Yh"]
    if kind == "LSTM":
        if with_state:
            params["c0"] = rand(*state_shape)
            params["p"] = rand(dirs, 3 * hidden)
            inputs += ["c0", "p"]
        outputs.append("Yc")
    nodes = [node(kind, inputs, outputs, hidden_size=hidden, direction=direction, layout=layout, **attrs)]
    final = "Yh" if layout == 0 else "Yh_1"
    if layout == 1:
        nodes.append(node("Unsqueeze", ["Yh", "axis1"], ["Yh_1"]))
    nodes.append(node("Add", ["Y", final], ["y0"] if kind == "LSTM" else ["y"]))
    if kind == "LSTM":
        nodes.append(node("Unsqueeze", ["Yc", "axis1"], ["Yc_1"]) if layout == 1 else node("Identity", ["Yc"], ["Yc_1"]))
        nodes.append(node("Add", ["y0", "Yc_1"]))
    gradient_check(nodes, params, constants={"axis1": np.array([1], np.int64)}, tmp_path=tmp_path)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru(direction, linear_before_reset, tmp_path):
    _recurrent_check("GRU", tmp_path, direction, linear_before_reset=linear_before_reset)


def test_gru_batch_first_without_initial_state(tmp_path):
    _recurrent_check("GRU", tmp_path, "bidirectional", layout=1, with_state=False, linear_before_reset=1)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm(direction, tmp_path):
    _recurrent_check("LSTM", tmp_path, direction)


def test_lstm_batch_first_without_initial_state(tmp_path):
    _recurrent_check("LSTM", tmp_path, "forward", layout=1, with_state=False)


@pytest.mark.parametrize("upper", [0, 1])
def test_castlike_and_trilu(upper, tmp_path):
    """A causal mask as exported from torch.triu, after a CastLike (to the float type it already has)."""
    nodes = [node("CastLike", ["x", "like"], ["c"]), node("Trilu", ["c", "k"], upper=upper)]
    gradient_check(nodes, {"x": rand(2, 3, 4)},
                   constants={"like": np.zeros(1, np.float32), "k": np.array(1 if upper else -1, np.int64)},
                   tmp_path=tmp_path)


def test_exported_attention_heads_fuse_into_strided_products(tmp_path):
    """Multi-head attention as PyTorch exports it: nn.Linear with a transposed weight, heads split by
    Reshape + Transpose, scores scaled, heads merged by Transpose + Reshape. Training fuses the
    transposes and the scale into FusedMatMul (graph/fusion.py); the gradients must not change."""
    batch, seq, heads, dim = 2, 3, 2, 2
    width = heads * dim
    split = np.array([batch, seq, heads, dim], np.int64)
    nodes = [node("Transpose", ["wq"], ["wq_t"], perm=[1, 0]), node("MatMul", ["x", "wq_t"], ["q"]),
             node("Transpose", ["wk"], ["wk_t"], perm=[1, 0]), node("MatMul", ["x", "wk_t"], ["k"]),
             node("Reshape", ["q", "split"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             node("Reshape", ["k", "split"], ["k4"]), node("Transpose", ["k4"], ["kh"], perm=[0, 2, 3, 1]),
             node("Reshape", ["x", "split"], ["v4"]), node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
             node("MatMul", ["qh", "kh"], ["s"]), node("Mul", ["s", "scale"], ["ss"]),
             node("Softmax", ["ss"], ["p"], axis=-1), node("MatMul", ["p", "vh"], ["o"]),
             node("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]), node("Reshape", ["o_t", "merge"])]
    gradient_check(nodes, {"x": rand(batch, seq, width), "wq": rand(width, width), "wk": rand(width, width)},
                   constants={"split": split, "merge": np.array([batch, seq, width], np.int64),
                              "scale": np.array(0.7, np.float32)}, tmp_path=tmp_path)
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    ops = [n.op_type for n in training.graph.node]
    assert "Transpose" not in ops and "MatMul" not in ops and "Mul" not in ops[:ops.index("Softmax")], ops


@pytest.mark.parametrize("x_shape, bias_shape, fuses", [
    ((2, 3, 4), (5,), True), ((2, 3, 4), (3, 1), True), ((2, 3, 4), (2, 3, 5), True),
    ((3, 4), (2, 3, 5), False),  # the bias would enlarge the product: it stays an Add
])
@pytest.mark.parametrize("bias_first", [False, True])
def test_a_bias_added_to_a_product_moves_into_it(x_shape, bias_shape, fuses, bias_first, tmp_path):
    """nn.Linear on three axes exports MatMul(x, Transpose(W)), then Add(bias). Training fuses the bias into
    the product (its output starts as the broadcast bias, BLAS adds onto it); the gradients must not change."""
    nodes = [node("Transpose", ["w"], ["w_t"], perm=[1, 0]), node("MatMul", ["x", "w_t"], ["p"]),
             node("Add", ["b", "p"] if bias_first else ["p", "b"])]
    gradient_check(nodes, {"x": rand(*x_shape), "w": rand(5, 4), "b": rand(*bias_shape)}, tmp_path=tmp_path)
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    with_bias = [n for n in training.graph.node if n.op_type == "FusedMatMul" and len(n.input) == 4]
    assert [list(n.input[2:]) for n in with_bias] == ([["", "b"]] if fuses else [])
    assert ("Add" in [n.op_type for n in training.graph.node]) != fuses
