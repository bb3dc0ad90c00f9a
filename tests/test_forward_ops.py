"""Forward kernels against the ONNX backend node tests (built in memory) for every supported op.

Each case whose ops odtrain supports and whose tensors have element types it runs is fed as ONNX
feeds it, configuring inputs (axes, pads, shapes, sizes, k) included, and must match the expected
outputs: booleans and integers exactly, floats to a tolerance. A case odtrain declines on purpose
is listed in DECLINED with the error it must give and why; declining any other case fails, and so
does a listed case that runs, so that the list stays exact.
"""
import fnmatch
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.reference import ReferenceEvaluator

from odtrain import OdtrainError
from odtrain.graph.onnx_wire import STORAGE_TYPES, numpy_dtype
from odtrain.graph.ops import OPS
from odtrain.graph.ops.tensor import STORAGE_OPS
from odtrain.inference import InferenceSession

SUPPORTED = {op for domain, op in OPS if domain == ""}
# The element types odtrain runs (Numba has no float16 arithmetic; bfloat16, float8 and 4-bit types have no
# numpy dtype of their own), and those that only Cast and CastLike convert (float16 and ml_dtypes' types), which
# DequantizeLinear also reads (ml_dtypes' types).
DTYPES = {np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                np.uint32, np.uint64, np.bool_)}
STORAGE_DTYPES = {numpy_dtype(code) for code in STORAGE_TYPES}  # read by DequantizeLinear too
CAST_DTYPES = {np.dtype(np.float16)} | STORAGE_DTYPES
# Cases whose expected outputs ONNX prints rounded to 4 decimals: compared at that precision.
ROUNDED = {"test_averagepool_2d_ceil_last_window_starts_on_pad": 1e-3, "test_gridsample_bicubic": 1e-3}

# Cases declined on purpose: case-name pattern -> (what the odtrain error says, why it is declined).
DECLINED = {
    "test_batchnorm_*_training_mode": (
        "is the updated state of input",
        "training-mode BatchNormalization returns running statistics as outputs; odtrain writes them over the "
        "checkpoint parameters instead"),
    "test_nllloss_NCd1d2d3d4d5_*_expanded": (
        "rank 7 exceeds 6",
        "the expanded loss gathers over 7 axes; odtrain's indexing kernels walk at most 6"),
    "test_tile": (
        "exceeds 6",
        "a tile of a rank-4 tensor interleaves 8 axes; odtrain's strided copy walks at most 6"),
    "test_gathernd_example_int32_batch_dim1": (
        "batch_dims=1 is not supported",
        "GatherND with batch dimensions is not implemented"),
    "test_maxpool_2d_uint8": ("runs MaxPool on float32 only", "pooling kernels are written for float32"),
    "test_scan_sum": ("opset 8 is older than 9",
                      "opset 8's Scan has a batch axis and sequence_lens; odtrain reads Scan from opset 9 on"),
}


def _declined(name: str):
    return next((entry for pattern, entry in DECLINED.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _array(tensor):
    return numpy_helper.to_array(tensor) if isinstance(tensor, TensorProto) else np.asarray(tensor)


def _runs_on_tensors_odtrain_supports(case) -> bool:
    inputs, outputs = case.data_sets[0]
    values = list(inputs) + list(outputs)
    if any(isinstance(t, (list, tuple)) or t is None for t in values):
        return False  # sequences and optional values are not tensors
    ops = {n.op_type for n in case.model.graph.node}
    allowed = DTYPES | (CAST_DTYPES if ops <= {"Cast", "CastLike"} else STORAGE_DTYPES if ops <= STORAGE_OPS else set())
    return all(_array(t).dtype in allowed for t in values)


def _cases():
    cases = []
    for case in load_model_tests(kind="node"):
        model = case.model
        ops = {n.op_type for n in model.graph.node}
        if not ops <= SUPPORTED or any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
            continue
        if not case.data_sets or not _runs_on_tensors_odtrain_supports(case):
            continue
        cases.append(pytest.param(case, id=case.name))
    return cases


CASES = _cases()


def test_the_suite_covers_each_op_family():
    covered = {n.op_type for case in CASES for n in case.values[0].model.graph.node}
    assert {"Add", "Gemm", "MatMul", "Relu", "ReduceSum", "ReduceMean", "SoftmaxCrossEntropyLoss", "Reshape",
            "Transpose", "Flatten", "Sigmoid", "Tanh", "Exp", "Log", "And", "Or", "Xor", "Not", "LessOrEqual",
            "Einsum", "CumSum", "Mod", "NegativeLogLikelihoodLoss"} <= covered


def test_every_declined_pattern_names_a_case():
    names = [case.values[0].name for case in CASES]
    unused = [pattern for pattern in DECLINED if not fnmatch.filter(names, pattern)]
    assert not unused, f"DECLINED lists patterns that match no case: {unused}"


def assert_outputs_match(got, expected, rtol=1e-4):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        if e.dtype.kind == "V" and e.dtype.name.startswith(("float", "bfloat")):  # ml_dtypes' floats: exactly
            np.testing.assert_array_equal(g.astype(np.float64), e.astype(np.float64))
        elif e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("case", CASES)
def test_backend_node_case(case):
    inputs, outputs = case.data_sets[0]
    feeds = {i.name: _array(t) for i, t in zip(case.model.graph.input, inputs)}
    declined = _declined(case.name)
    try:
        got = InferenceSession(case.model).run(None, feeds)
    except OdtrainError as error:
        if declined is None:
            pytest.fail(f"odtrain declines a case it supports (list it in DECLINED if that is meant): {error}")
        message, why = declined
        assert re.search(re.escape(message), str(error)), f"declined for another reason than '{why}': {error}"
        return
    assert declined is None, f"listed in DECLINED ({declined[1]}) but now runs: remove it from the list"
    assert_outputs_match(got, [_array(t) for t in outputs], rtol=ROUNDED.get(case.name, 1e-4))


# Cases whose op rules fold constants (numpy on the type-rule side): run again with every input an initializer.
FOLDED = ("test_cumsum_*", "test_cumprod_*", "test_argmax_*", "test_argmin_*", "test_reduce_*", "test_mod_*",
          "test_bitshift_*", "test_bitwise_*", "test_mean_*", "test_size*")


@pytest.mark.parametrize("case", [c for c in CASES if any(fnmatch.fnmatchcase(c.values[0].name, p) for p in FOLDED)
                                  and _declined(c.values[0].name) is None])
def test_backend_node_case_folded_from_initializers(case):
    inputs, outputs = case.data_sets[0]
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    for value_info, tensor in zip(list(model.graph.input), inputs):
        model.graph.initializer.append(numpy_helper.from_array(_array(tensor), value_info.name))
        model.graph.input.remove(value_info)
    assert_outputs_match(InferenceSession(model).run(None, {}), [_array(t) for t in outputs])


# Einsum as models use it, beyond the backend cases: against ONNX's reference evaluator.
EINSUMS = [("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)]), ("bhij,bhjd->bhid", [(2, 3, 4, 6), (2, 3, 6, 5)]),
           ("ij,kj->ik", [(3, 4), (5, 4)]), ("ji,jk->ik", [(4, 3), (4, 5)]), ("ij,jk->ki", [(3, 4), (4, 5)]),
           ("i,j->ij", [(3,), (4,)]), ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]), ("bij->bji", [(2, 3, 4)]),
           ("ijk,jil->kl", [(2, 3, 4), (3, 2, 5)]), ("abc,c->ab", [(2, 3, 4), (4,)]), ("ii->i", [(4, 4)]),
           ("ij,ij->ij", [(3, 4), (3, 4)]), ("bi,ci->bci", [(2, 3), (4, 3)]), ("ij->", [(3, 4)])]


@pytest.mark.parametrize("equation,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum_contractions(equation, shapes):
    rng = np.random.default_rng(3)
    arrays = {f"x{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(shapes)}
    graph = helper.make_graph([helper.make_node("Einsum", list(arrays), ["y"], equation=equation)], "einsum",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in arrays.items()],
                              [helper.make_empty_tensor_value_info("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert_outputs_match(InferenceSession(model).run(None, arrays), ReferenceEvaluator(model).run(None, arrays))


def _model(nodes, inputs, outputs=("y",)):
    graph = helper.make_graph(nodes, "fed", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_empty_tensor_value_info(o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_inputs_that_configure_ops_bind_as_constants_one_plan_per_value():
    """Axes fed to ReduceSum, and k computed from a feed for Trilu, are bound when the plan is; x reaches
    Reshape's shape only through Shape (its shape, not its values), so x stays a feed."""
    from odtrain.graph.onnx_io import load_graph
    from odtrain.graph.schedule import configuring_inputs

    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
             helper.make_node("Add", ["k0", "one"], ["k"]), helper.make_node("Trilu", ["s", "k"], ["t"]),
             helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Expand", ["t", "shape"], ["y"])]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 3, 4]), ("axes", TensorProto.INT64, [1]),
                           ("k0", TensorProto.INT64, []), ("one", TensorProto.INT64, [])])
    assert configuring_inputs(load_graph(model)) == ["axes", "k0", "one"]
    session = InferenceSession(model)
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    for axes, k0 in (([0], 0), ([-1], -1), ([0], 0), ([1], 1)):
        feeds = {"x": x + k0, "axes": np.array(axes, np.int64), "k0": np.array(k0, np.int64),
                 "one": np.array(1, np.int64)}
        assert_outputs_match(session.run(None, feeds), ReferenceEvaluator(model).run(None, feeds))


def test_nodes_of_older_opsets_are_upgraded_by_their_ops_registrations():
    """The loader applies what each op registers (graph/ops, `upgrade`): DFT's axis attribute of opsets before
    20 gets its old default written out; opset 11's flattening Softmax over the last axis alone becomes
    axis -1, over more axes it is refused; a model of the newer opset is read as it is."""
    from odtrain.graph.onnx_io import load_graph

    def loaded(node, shape, opset):
        model = _model([node], [("x", TensorProto.FLOAT, shape)])
        model.opset_import[0].version = opset
        return load_graph(model).nodes[0].attrs

    assert OPS[("", "DFT")].upgrades and OPS[("", "Softmax")].upgrades and OPS[("", "LogSoftmax")].upgrades
    assert loaded(helper.make_node("DFT", ["x"], ["y"]), [2, 8, 1], 17)["axis"] == 1
    assert "axis" not in loaded(helper.make_node("DFT", ["x"], ["y"]), [2, 8, 1], 20)
    assert loaded(helper.make_node("Softmax", ["x"], ["y"]), [2, 5], 11)["axis"] == -1
    assert loaded(helper.make_node("LogSoftmax", ["x"], ["y"], axis=2), [2, 3, 5], 11)["axis"] == -1
    assert loaded(helper.make_node("Softmax", ["x"], ["y"], axis=1), [2, 3, 5], 13)["axis"] == 1
    with pytest.raises(OdtrainError, match="opset 13's single-axis Softmax"):
        loaded(helper.make_node("Softmax", ["x"], ["y"]), [2, 3, 5], 11)


def test_models_older_than_opset_9_load_when_their_ops_have_not_changed_since():
    """And means at opset 7 what it means at 9: the model loads as it is. Upsample-7 took its scales as an
    attribute, an input from opset 9 on: the model is refused with the way out."""
    inputs = [("a", TensorProto.BOOL, [2, 3]), ("b", TensorProto.BOOL, [3])]
    logic = _model([helper.make_node("And", ["a", "b"], ["y"])], inputs)
    logic.opset_import[0].version = 7
    feeds = {"a": np.array([[True, False, True], [False, False, True]]), "b": np.array([True, True, False])}
    assert_outputs_match(InferenceSession(logic).run(None, feeds), [feeds["a"] & feeds["b"]])
    upsample = _model([helper.make_node("Upsample", ["x"], ["y"], scales=[1.0, 2.0])],
                      [("x", TensorProto.FLOAT, [2, 3])])
    upsample.opset_import[0].version = 7
    with pytest.raises(OdtrainError, match="opset 7 is older than 9; re-export it"):
        InferenceSession(upsample)


@pytest.mark.parametrize("code", [c for c in STORAGE_TYPES if numpy_dtype(c).name.startswith(("float", "bfloat"))]
                         + [TensorProto.FLOAT16])
def test_cast_rounds_every_midpoint_to_even_as_ml_dtypes(code):
    """Casting float64 to a small float type, without saturation: every representable value, every midpoint
    between neighbours (ties go to the even code), values past the largest, infinities and NaN give the codes
    ml_dtypes gives; and every code casts back to its value."""
    target = numpy_dtype(code) if code != TensorProto.FLOAT16 else np.dtype(np.float16)
    bits = np.uint16 if target.itemsize == 2 else np.uint8
    codes = np.arange(1 << (8 * target.itemsize) if target.name != "float4_e2m1fn" else 16, dtype=np.uint64)
    values = codes.astype(bits).view(target).astype(np.float64)
    finite = np.unique(values[np.isfinite(values)])
    x = np.concatenate([finite, (finite[1:] + finite[:-1]) / 2, finite * 1.0001, [np.inf, -np.inf, np.nan],
                        [finite[-1] * 1.5, -finite[-1] * 1.5, 1e300]])
    cast = helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=code, saturate=0), helper.make_node("Cast", ["c"], ["back"], to=11)],
        "cast", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [x.size]),
                 helper.make_tensor_value_info("c", code, [codes.size])],
        [helper.make_tensor_value_info("y", code, None),
         helper.make_tensor_value_info("back", TensorProto.DOUBLE, None)]),
        opset_imports=[helper.make_opsetid("", 21)])
    y, back = InferenceSession(cast).run(None, {"x": x, "c": codes.astype(bits).view(target)})
    expected = x.astype(target)
    both_nan = np.isnan(y.astype(np.float64)) & np.isnan(expected.astype(np.float64))
    same = (y.view(bits) == expected.view(bits)) | both_nan
    assert same.all(), (x[~same][:5], y[~same][:5], expected[~same][:5])
    np.testing.assert_array_equal(back, values)
