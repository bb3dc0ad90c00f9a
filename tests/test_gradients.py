"""Every gradient rule against float64 finite differences of ONNX's reference evaluator."""
import numpy as np
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
