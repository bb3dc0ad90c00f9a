"""Element-wise fusion of a bound step (graph/elementwise_fusion.py, kernels/fused_elementwise.py).

Oracle: the same artifacts planned without fusion (ODTRAIN_ELEMENTWISE_FUSION=0), which run each op through its
per-op kernel. Both evaluate the same scalar expressions of kernels/scalar_expressions.py, and float32
arithmetic rounds each operation to float32 whether the value is in a register or in memory (Numba compiles
without fast-math, so nothing is contracted into FMA): losses, outputs and gradients must agree bit for bit,
at one thread and split into parts.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from odtrain import artifacts
from odtrain.api import CheckpointState, Module
from odtrain.graph.elementwise_fusion import FUSED_OP, SWITCH


def chain_model():
    """x [batch, 16] → MatMul → (+bias)·scale → sigmoid-gated tanh − mean over features → MatMul → logits: chains
    with a broadcast bias, a scalar, a [batch, 1] operand and values the backward reads."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(-0.5, 0.5, (16, 32)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.uniform(-0.1, 0.1, 32).astype(np.float32), "b1"),
             numpy_helper.from_array(np.array(0.7, np.float32), "scale"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (32, 4)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Mul", ["hb", "scale"], ["hs"]),
             helper.make_node("Sigmoid", ["hs"], ["g"]),
             helper.make_node("Mul", ["hs", "g"], ["silu"]),
             helper.make_node("Tanh", ["silu"], ["t"]),
             helper.make_node("ReduceMean", ["t", "axes"], ["m"], keepdims=1),
             helper.make_node("Sub", ["t", "m"], ["c"]),
             helper.make_node("Mul", ["c", "c"], ["sq"]),
             helper.make_node("Add", ["sq", "c"], ["z"]),
             helper.make_node("MatMul", ["z", "W2"], ["logits"])]
    graph = helper.make_graph(nodes, "chains", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture(scope="module")
def chain_artifacts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chains")
    artifacts.generate_artifacts(chain_model(), requires_grad=["W1", "b1", "W2"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory, additional_output_names=["logits"])
    return directory


def run(directory, monkeypatch, fused: bool, threads: int, batch: int = 64):
    monkeypatch.setenv(SWITCH, "1" if fused else "0")
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx", num_threads=threads)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 16)).astype(np.float32)
    labels = rng.integers(0, 4, batch).astype(np.int64)
    loss, logits = module(x, labels)
    grads = {name: p.grad.copy() for name, p in state.parameters.items() if p.grad is not None}
    order = module.executable_step_at(batch).order
    module.eval()
    eval_loss, eval_logits = module(x, labels)
    return (float(loss), logits.copy(), grads, float(eval_loss), eval_logits.copy()), order


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_chains_give_the_unfused_bits(chain_artifacts, monkeypatch, threads):
    from odtrain.kernels import parallel_split

    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 1)  # the parts run even at this small size
    fused, order = run(chain_artifacts, monkeypatch, True, threads)
    plain, plain_order = run(chain_artifacts, monkeypatch, False, threads)
    assert any(n.op_type == FUSED_OP for n in order) and not any(n.op_type == FUSED_OP for n in plain_order)
    assert len(order) < len(plain_order)
    assert fused[0] == plain[0] and fused[3] == plain[3]
    np.testing.assert_array_equal(fused[1], plain[1])
    np.testing.assert_array_equal(fused[4], plain[4])
    assert fused[2].keys() == plain[2].keys()
    for name in plain[2]:
        np.testing.assert_array_equal(fused[2][name], plain[2][name], err_msg=name)


def test_the_exported_inference_model_is_standard_onnx(chain_artifacts, monkeypatch, tmp_path):
    """Fusion lives in bound steps only: the artifacts and the exported model hold the exporter's ops."""
    import onnx

    _, order = run(chain_artifacts, monkeypatch, True, 1)
    assert any(n.op_type == FUSED_OP for n in order)
    state = CheckpointState.load_checkpoint(chain_artifacts / "checkpoint")
    module = Module(chain_artifacts / "training_model.onnx", state, chain_artifacts / "eval_model.onnx")
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    model = onnx.load(tmp_path / "inference.onnx")
    onnx.checker.check_model(model)
    assert {n.domain for n in model.graph.node} <= {""} and FUSED_OP not in {n.op_type for n in model.graph.node}


def test_a_new_element_wise_op_is_one_row(tmp_path, monkeypatch):
    """A row added to the table (with the op's graph rule, as README's "Adding an op") gives the op a per-op kernel
    (kernels/fused_elementwise.py's row_binding) and a place in fused chains: y = ToySoftCube(x·W) · s + x·W,
    fused and unfused the same bits, and the forward as numpy computes it."""
    from odtrain.graph.ir import ODTRAIN_DOMAIN
    from odtrain.graph.ops import registry as graph_registry
    from odtrain.kernels import fused_elementwise, scalar_expressions
    from odtrain.kernels import registry as kernel_registry

    row = scalar_expressions.Row("({0} * {0} * {0} / (1 + abs({0})))", 1, "rare", ODTRAIN_DOMAIN)
    monkeypatch.setitem(scalar_expressions.UNARY, "ToySoftCube", row)
    monkeypatch.setitem(scalar_expressions.ROWS, "ToySoftCube", row)
    monkeypatch.setitem(graph_registry.OPS, (ODTRAIN_DOMAIN, "ToySoftCube"), None)  # restored after the test
    graph_registry.op("ToySoftCube", ODTRAIN_DOMAIN)(graph_registry.same_as_input(0))
    monkeypatch.setitem(kernel_registry.BINDINGS, (ODTRAIN_DOMAIN, "ToySoftCube"),
                        fused_elementwise.row_binding("ToySoftCube"))
    rng = np.random.default_rng(3)
    weight = rng.uniform(-1, 1, (4, 6)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("ToySoftCube", ["h"], ["c"], domain=ODTRAIN_DOMAIN),
             helper.make_node("Mul", ["c", "s"], ["cs"]),
             helper.make_node("Add", ["cs", "h"], ["y"])]
    graph = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])],
                              [numpy_helper.from_array(weight, "W"),
                               numpy_helper.from_array(np.array([0.5], np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ODTRAIN_DOMAIN, 1)])
    from odtrain.inference import InferenceSession

    path = tmp_path / "toy.onnx"
    import onnx

    onnx.save(model, path)
    x = rng.uniform(-2, 2, (7, 4)).astype(np.float32)
    results = {}
    for fused in (True, False):
        monkeypatch.setenv(SWITCH, "1" if fused else "0")
        session = InferenceSession(str(path))
        results[fused] = session.run(None, {"x": x})[0]
        ((bound, _),) = session._plans.values()  # the step the run bound: the toy op in a fused chain, or alone
        assert [n.op_type for n in bound.order][1:] == ([FUSED_OP] if fused else ["ToySoftCube", "Mul", "Add"])
    h = x @ weight
    expected = (h * h * h / (1 + np.abs(h))) * np.float32(0.5) + h
    np.testing.assert_array_equal(results[True], results[False])
    np.testing.assert_allclose(results[True], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias_shape", [(300,), (4, 1, 1)])
def test_a_chain_written_over_its_input_gives_the_same_bits(bias_shape):
    """The planner may put a fused node's output over an input that dies there: the kernel then writes through
    the input's own name (kernels/fused_elementwise.py), flat or by rows, with the bits of separate buffers."""
    from odtrain.kernels import fused_elementwise

    rng = np.random.default_rng(4)
    a = rng.standard_normal((4, 5, 300)).astype(np.float32)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    steps = (("Mul", (), (("input", 0), ("input", 0))), ("Add", (), (("step", 0), ("input", 1))),
             ("Sigmoid", (), (("step", 1),)), ("Mul", (), (("step", 2), ("input", 0))))
    separate = np.empty_like(a)
    in_place = a.copy()
    for out, x in ((separate, a), (in_place, in_place)):
        for kernel, args in fused_elementwise.fused_calls([x, bias], [out], steps, (3,)):
            kernel(*args)
    expected = (lambda t: 1 / (1 + np.exp(-t)))(a.astype(np.float64) ** 2 + bias) * a
    np.testing.assert_array_equal(in_place, separate)
    np.testing.assert_allclose(separate, expected, rtol=3e-6, atol=1e-7)
    assert any(" = r0\n" in text for text in fused_elementwise.SOURCES.values())
