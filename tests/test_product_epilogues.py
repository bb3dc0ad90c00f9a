"""A product's activation epilogue (graph/product_epilogues.py, kernels/linalg.py's FusedMatMul with `activation`)
and its one-pass gradient (ActivationBiasGrad): the same values as the unfused ops, gradients against float64
finite differences, the fold only where the product's value is read by the activation alone, and eval models
left standard ONNX."""
import numpy as np
import onnx
import pytest
from onnx import helper
from scipy.special import erf

from oracles import GradientCase
from odtrain.graph.ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from odtrain.graph import product_epilogues
from odtrain.graph.product_epilogues import fold_product_epilogues
from odtrain.kernels import BINDINGS
from odtrain.kernels.linalg import EPILOGUE_PANEL_BYTES

RNG = np.random.default_rng(7)


def _values(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


GRADIENT_CASES: dict[str, GradientCase] = {
    "Gemm bias Relu": GradientCase(
        [helper.make_node("Gemm", ["a", "w", "c"], ["p"], transB=1), helper.make_node("Relu", ["p"], ["y"])],
        {"w": _values(5, 4), "c": _values(5)}, {"a": _values(6, 4)}, fuses_into=("FusedMatMul", "ActivationBiasGrad")),
    "MatMul bias Gelu, rank 3": GradientCase(
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["a", "wt"], ["m"]),
         helper.make_node("Add", ["m", "c"], ["p"]), helper.make_node("Gelu", ["p"], ["y"])],  # as nn.Linear exports
        {"a": _values(2, 3, 4), "w": _values(5, 4), "c": _values(5)}, opset=20, step=1e-3,
        fuses_into=("FusedMatMul", "GeluGrad")),
    "Gemm Relu without bias, the input's gradient too": GradientCase(
        [helper.make_node("Gemm", ["a", "w"], ["p"], alpha=0.5), helper.make_node("Relu", ["p"], ["y"])],
        {"a": _values(6, 4), "w": _values(4, 5)}, fuses_into=("FusedMatMul", "ActivationBiasGrad")),
    "MatMul Relu, rank 3": GradientCase(
        [helper.make_node("MatMul", ["a", "w"], ["p"]), helper.make_node("Relu", ["p"], ["y"])],
        {"w": _values(4, 5)}, {"a": _values(2, 3, 4)}, fuses_into=("FusedMatMul", "ActivationBiasGrad")),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_epilogue_gradients_match_float64_finite_differences(name, tmp_path, monkeypatch):
    monkeypatch.setattr(product_epilogues, "FOLDED", {"Relu", "Gelu"})  # GELU's fold too, off by default
    GRADIENT_CASES[name].check(tmp_path)
    eval_ops = {n.op_type for n in onnx.load(str(tmp_path / "eval_model.onnx")).graph.node}
    assert "FusedMatMul" not in eval_ops and eval_ops & {"Relu", "Gelu"}, "the eval model stays standard ONNX"


def _graph(nodes, outputs, weight_shape=(4, 5)):
    types = {"w": TensorType(np.float32, weight_shape), "c": TensorType(np.float32, (weight_shape[1],))}
    return Graph(nodes, ["a"], outputs, {"w": np.zeros(weight_shape, np.float32), "c": np.zeros(5, np.float32)},
                 types)


def test_a_product_read_by_more_than_its_activation_keeps_its_activation():
    product = Node("Gemm", ["a", "w", "c"], ["p"], name="fc")
    shared = _graph([product, Node("Relu", ["p"], ["y"]), Node("Add", ["p", "y"], ["z"])], ["z"])
    fold_product_epilogues(shared)
    assert [n.op_type for n in shared.nodes] == ["Gemm", "Relu", "Add"]
    as_output = _graph([Node("Gemm", ["a", "w", "c"], ["p"]), Node("Relu", ["p"], ["y"])], ["y", "p"])
    fold_product_epilogues(as_output)
    assert [n.op_type for n in as_output.nodes] == ["Gemm", "Relu"]
    tanh_form = _graph([Node("Gemm", ["a", "w", "c"], ["p"]), Node("Gelu", ["p"], ["y"], {"approximate": "tanh"})],
                       ["y"])
    fold_product_epilogues(tanh_form, {"Relu", "Gelu"})
    assert [n.op_type for n in tanh_form.nodes] == ["Gemm", "Gelu"]
    alone = _graph([Node("Gemm", ["a", "w", "c"], ["p"], name="fc"), Node("Gelu", ["p"], ["y"])], ["y"])
    fold_product_epilogues(alone)
    assert [n.op_type for n in alone.nodes] == ["Gemm", "Gelu"]  # GELU is folded when asked for only
    fold_product_epilogues(alone, {"Gelu"})
    (fused,) = alone.nodes
    assert (fused.key, fused.attrs["activation"], fused.outputs, fused.name) == \
        ((ODTRAIN_DOMAIN, "FusedMatMul"), "Gelu", ["y", "p"], "fc")  # GELU's gradient reads p: it stays


def _run(calls):
    for kernel, args in calls:
        kernel(*args)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["Relu", "Gelu"])
def test_epilogue_gives_the_bits_of_the_product_then_its_activation(activation, threads):
    # several panels of rows, and parts at 2 threads
    m, k, n = 3 * EPILOGUE_PANEL_BYTES // (4 * 600) + 7, 200, 600
    a, w, bias = _values(m, k), _values(n, k), _values(n)
    product, expected = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    _run(BINDINGS[("", "Gemm")]([a, w, bias], [product], transB=1, threads=threads))
    _run(BINDINGS[("", activation)]([product], [expected], threads=threads))
    out, pre = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    _run(BINDINGS[(ODTRAIN_DOMAIN, "FusedMatMul")]([a, w, None, bias], [out, pre], transB=1, activation=activation,
                                                   threads=threads))
    if threads == 1:  # the same BLAS products in the same order: the same bits
        np.testing.assert_array_equal(out, expected)
        if activation == "Gelu":
            np.testing.assert_array_equal(pre, product)
        return
    # In parts, the panels (and the unfused product's column blocks) are other BLAS calls, whose kernels may sum in
    # another order: within the bound of a float32 sum of k + 1 terms (k + 1 roundings of 2^-24 of the sum of
    # magnitudes), carried through f (|f'| <= 1.13), plus f's own float32 error (a few ulps of |f| and |x|).
    exact = a.astype(np.float64) @ w.astype(np.float64).T + bias
    magnitudes = np.abs(a).astype(np.float64) @ np.abs(w).astype(np.float64).T + np.abs(bias)
    f = np.maximum(exact, 0) if activation == "Relu" else 0.5 * exact * (1 + erf(exact / np.sqrt(2)))
    bound = 1.13 * (k + 1) * 2.0 ** -24 * magnitudes + 16 * 2.0 ** -24 * (np.abs(f) + np.abs(exact))
    assert np.all(np.abs(out - f) <= bound), np.max(np.abs(out - f) / bound)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["Relu", "Gelu"])
def test_activation_bias_gradient_is_the_activation_gradient_and_its_column_sums(activation, threads):
    dy, x = _values(3, 500, 300), _values(3, 500, 300)
    read = np.maximum(x, 0) if activation == "Relu" else x  # Relu's gradient reads its output
    dx, dbias = np.empty_like(dy), np.empty(300, np.float32)
    _run(BINDINGS[(ODTRAIN_DOMAIN, "ActivationBiasGrad")]([dy, read, dbias], [dx, dbias], activation=activation,
                                                          threads=threads))
    unfused = np.empty_like(dy)
    _run(BINDINGS[(ODTRAIN_DOMAIN, f"{activation}Grad")]([dy, read], [unfused], threads=threads))
    np.testing.assert_array_equal(dx, unfused)
    exact = dx.astype(np.float64).reshape(-1, 300).sum(axis=0)
    # a float32 sum of 1,500 terms in row order is within 1,500 roundings (2^-24 each) of the sum of magnitudes
    scale = np.abs(dx.astype(np.float64)).reshape(-1, 300).sum(axis=0)
    assert np.all(np.abs(dbias - exact) <= 1500 * 2.0 ** -24 * scale), np.max(np.abs(dbias - exact) / scale)
    in_place = dy.copy()
    _run(BINDINGS[(ODTRAIN_DOMAIN, "ActivationBiasGrad")]([in_place, read], [in_place, None], activation=activation,
                                                          threads=threads))
    np.testing.assert_array_equal(in_place, dx)
