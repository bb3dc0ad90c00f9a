"""Independent references for tests: ONNX's reference evaluator and float64 finite differences.

`gradient_check` differentiates a small graph with odtrain (float32, through
generate_artifacts, Module and the kernels) and compares every parameter's
gradient with central differences of the same graph evaluated in float64 by
`onnx.reference.ReferenceEvaluator`.

Gradient tests are tables of `GradientCase` rows, each named `GRADIENT_CASES`
in its test module; tests/test_registry.py reads the op types of every row to
prove that each gradient rule has a case.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from odtrain import artifacts
from odtrain.api import CheckpointState, Module

OPSET = 17


def make_model(nodes, initializers: dict, inputs=(), outputs=("y",), opset: int = OPSET) -> onnx.ModelProto:
    """A model from onnx.helper nodes; inputs are (name, np dtype, shape) triples; outputs untyped."""
    graph = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), list(s)) for n, t, s in inputs],
        [helper.make_empty_tensor_value_info(o) if not isinstance(o, tuple) else
         helper.make_tensor_value_info(o[0], helper.np_dtype_to_tensor_dtype(np.dtype(o[1])), o[2]) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), name=k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def with_weighted_sum(nodes, output: str, weights: np.ndarray):
    return list(nodes) + [helper.make_node("Mul", [output, "gc_weights"], ["gc_weighted"]),
                          helper.make_node("ReduceSum", ["gc_weighted"], ["loss"], keepdims=0)]


def _casts_to_float64(nodes) -> list:
    """The nodes with every Cast to float32 made a Cast to float64: the float64 reference stays float64
    throughout (central differences cannot see through float32 rounding; a Cast's derivative is 1)."""
    float32, float64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE
    widened = []
    for n in nodes:
        if n.op_type == "Cast" and any(a.name == "to" and a.i == float32 for a in n.attribute):
            n = helper.make_node("Cast", list(n.input), list(n.output), n.name, to=float64)
        widened.append(n)
    return widened


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose float32 initializers are float64, for float64 reference evaluation."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.dtype == np.float32:
            tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float64), name=tensor.name))
    return model


def numeric_gradient(loss64, params64: dict, name: str, step: float = 1e-6) -> np.ndarray:
    """Central differences of `loss64(params)` with respect to parameter `name`, in float64."""
    value = params64[name]
    numeric = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        for sign in (1, -1):
            shifted = value.copy()
            shifted[index] += sign * step
            numeric[index] += sign * loss64({**params64, name: shifted}) / (2 * step)
    return numeric


def assert_gradients_match(state, loss64, params64: dict, rtol: float = 1e-3, atol: float = 1e-5) -> None:
    """Every parameter's gradient in `state` equals float64 central differences of `loss64`."""
    for name in params64:
        np.testing.assert_allclose(state.parameters[name].grad, numeric_gradient(loss64, params64, name),
                                   rtol=rtol, atol=atol, err_msg=name)


def reference_outputs(model: onnx.ModelProto, feeds: dict | None = None) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds or {})


def gradient_check(nodes, params: dict[str, np.ndarray], output: str = "y", constants: dict | None = None,
                   tmp_path=None, opset: int = OPSET, step: float = 1e-6, seed: int = 0,
                   rtol: float = 2e-3, atol_fraction: float = 2e-4):
    """Assert that odtrain's gradients of sum(output * R) match float64 central differences."""
    constants = constants or {}
    rng = np.random.default_rng(seed)
    probe = make_model(nodes, {**params, **constants}, outputs=[output], opset=opset)
    shape = np.asarray(reference_outputs(probe)[0]).shape
    weights = rng.standard_normal(shape).astype(np.float32)

    full_nodes = with_weighted_sum(nodes, output, weights)
    model32 = make_model(full_nodes, {**params, **constants, "gc_weights": weights},
                         outputs=[("loss", np.float32, [])], opset=opset)
    artifacts.generate_artifacts(model32, requires_grad=list(params), loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss32 = module()
    analytic = {name: state.parameters[name].grad for name in params}

    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    consts64 = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in constants.items()}
    inits64 = {**params64, **consts64, "gc_weights": weights.astype(np.float64)}
    model64 = make_model(_casts_to_float64(full_nodes), inits64, outputs=["loss"], opset=opset)

    def loss64(values):
        for tensor in model64.graph.initializer:
            if tensor.name in values:
                tensor.CopyFrom(numpy_helper.from_array(values[tensor.name], name=tensor.name))
        return float(reference_outputs(model64)[0])

    base = loss64(params64)
    np.testing.assert_allclose(float(loss32), base, rtol=1e-4, atol=1e-5)
    for name in params64:
        numeric = numeric_gradient(loss64, params64, name, step)
        loss64(params64)
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(analytic[name], numeric, rtol=rtol, atol=atol_fraction * scale * 10,
                                   err_msg=f"gradient of '{name}'")
    return analytic


@dataclass
class GradientCase:
    """One row of a gradient table: `nodes` (output "y") differentiated with respect to `params`, with
    `constants` held fixed, checked by `gradient_check` at `opset` with finite-difference `step`.

    `fuses_into`: ops that graph fusion makes of the nodes in the training model (FusedMatMul, ...);
    the row checks their gradients too, and fails if the training model lacks them.
    """

    nodes: list
    params: dict
    constants: dict = field(default_factory=dict)
    opset: int = OPSET
    step: float = 1e-6
    fuses_into: tuple = ()

    @property
    def op_types(self) -> set[str]:
        """The op types whose gradient rules this row runs."""
        return {n.op_type for n in self.nodes} | set(self.fuses_into)

    def check(self, tmp_path) -> dict:
        analytic = gradient_check(self.nodes, self.params, constants=self.constants, tmp_path=tmp_path,
                                  opset=self.opset, step=self.step)
        trained = {n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node}
        assert set(self.fuses_into) <= trained, f"the training model has no {set(self.fuses_into) - trained}"
        return analytic


# ---- golden trajectories --------------------------------------------------------------------------


def expected_first_update(kind: str, settings: dict, grad64: np.ndarray, w0: np.ndarray) -> np.ndarray:
    """Δw of the first step (zero moments, step 1) from a float64 gradient, in float64: SGD -lr·g;
    ONNX Runtime's AdamW w - s·m/(√v + ε) with m = (1-β1)·g, v = (1-β2)·g², s = lr·√(1-β2)/(1-β1)
    under bias correction (else lr), then w - lr·λ·w."""
    lr = settings["lr"]
    if kind == "sgd":
        return -lr * grad64
    beta1, beta2 = settings["beta1"], settings["beta2"]
    m, v = (1 - beta1) * grad64, (1 - beta2) * grad64 * grad64
    size = lr * np.sqrt(1 - beta2) / (1 - beta1) if settings.get("bias_correction", True) else lr
    w1 = w0 - size * m / (np.sqrt(v) + settings["eps"])
    return w1 - lr * settings.get("weight_decay", 0.0) * w1 - w0


# |learning_rate_ratio - 1| stays below this. Measured on odtrain under OpenBLAS's Haswell and Sandybridge kernels
# at 1 and 2 threads (mlp, cnn, transformer; SGD and AdamW): at most 6.5e-6 (cnn AdamW, 1 thread); a learning
# rate 1% off gives 1.0e-2.
LEARNING_RATE_RATIO_TOLERANCE = 1e-3


def learning_rate_ratio(before: dict, after: dict, kind: str, settings: dict, golden) -> float:
    """The least-squares s of Δw ≈ s·Δw64 over every trainable parameter, where Δw is the first update a
    run made (`before` and `after` map names to values) and Δw64 the float64 update from golden's grad64:
    the learning rate the run used, relative to golden's. A learning rate 1% off moves it by 1e-2 on any
    model; float32 rounding barely moves it, even where it changes single elements (a tiny gradient whose
    AdamW step eps decides, a ReLU tie), because it projects the whole update."""
    update = np.concatenate([(after[n].astype(np.float64) - before[n]).ravel() for n in before])
    expected = np.concatenate([expected_first_update(kind, settings, golden[f"grad64/{n}"], before[n]).ravel()
                               for n in before])
    return float(np.dot(update, expected) / np.dot(expected, expected))
