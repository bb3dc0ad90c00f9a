"""Quantized reference models, made by onnxruntime's own quantizer from the models in tests/data, and
what tests/test_quantize.py and benchmarks/quantized.py both do with them.

- `qdq_mobilenetv2`: mobilenetv2_personalize through `quantize_static` in the QDQ format (uint8
  activations, int8 weights, per tensor), the classifier Gemm kept float, calibrated on the four
  golden batches (MinMax). As exported for training, its BatchNormalizations normalise with the
  batch's statistics; with `inference_form=True` they use their running statistics, as in the
  model an application ships (and as a frozen backbone runs).
- `dynamic_mlp`: the reference MLP through `quantize_dynamic` (DynamicQuantizeLinear + MatMulInteger).

Beside them: running a model in onnxruntime, the float64 head gradients a step on the QDQ MobileNetV2
should give, and the digits classifier trained with and without quantization-aware training.

They are generated rather than stored (the QDQ MobileNetV2 is 2.8 MB): the tests build them once per
session; `python tests/quantized_models.py FOLDER` writes them into FOLDER, the MobileNetV2s as
workload folders for benchmarks/compare.py:

    python tests/quantized_models.py /tmp/qmodels
    python benchmarks/compare.py --models /tmp/qmodels --workload mobilenetv2_qdq_inference --systems odtrain
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

import numpy as np

DATA = pathlib.Path(__file__).parent / "data"
HEAD = "/classifier/Gemm"  # the float head of mobilenetv2_personalize, kept out of quantization
# The value the head reads in the QDQ model: the pooled, flattened features after their last
# QuantizeLinear -> DequantizeLinear.
FEATURES = "/Flatten_output_0_DequantizeLinear_Output"


def golden_batches(name: str = "mobilenetv2_personalize") -> np.ndarray:
    """The golden input batches of a reference model as float32 [steps, batch, ...]."""
    return np.load(DATA / name / "golden.npz")["x"].astype(np.float32)


def with_running_statistics(source, path) -> str:
    """Write `source` with every BatchNormalization in inference mode (running statistics) to `path`."""
    import onnx

    model = onnx.load(str(source))
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            del node.output[1:]
    onnx.save(model, str(path))
    return str(path)


def qdq_mobilenetv2(path, inference_form: bool = False) -> str:
    """Write the QDQ MobileNetV2 (float head) to `path`; returns the path."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    batches = golden_batches()

    class GoldenBatches(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"input": batch} for batch in batches])

        def get_next(self):
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory() as scratch:
        source = DATA / "mobilenetv2_personalize" / "forward.onnx"
        if inference_form:
            source = with_running_statistics(source, os.path.join(scratch, "forward.onnx"))
        quantize_static(str(source), str(path), GoldenBatches(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_exclude=[HEAD])
    return str(path)


def onnxruntime_outputs(model, feeds, optimized: bool = True) -> list:
    """Every output of `model` (a path or a ModelProto) in onnxruntime's CPU session; `optimized=False` runs
    the graph as written (its fused integer kernels are not exact on every CPU)."""
    import onnx
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    if not optimized:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def with_output(path, name):
    """The model at `path` with the float value `name` as an extra graph output."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return model


def feature_step(model) -> float:
    """The quantization step (scale) of the QDQ MobileNetV2's pooled features, FEATURES."""
    from onnx import numpy_helper

    scale = FEATURES.replace("_DequantizeLinear_Output", "_QuantizeLinear_Output")
    node = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.output[0] == scale)
    return float(numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == node.input[1])))


def head_gradients(features, weight, bias, labels) -> tuple[np.ndarray, np.ndarray]:
    """Cross-entropy (mean) gradients of the Gemm head in float64: dW = dZᵀ·F, db = Σ dZ, dZ = (p - onehot)/N."""
    features = features.astype(np.float64)
    logits = features @ weight.astype(np.float64).T + bias.astype(np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    d = p / len(labels)
    return d.T @ features, d.sum(axis=0)


def train_digits(folder, qat=None, epochs: int = 15) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train `odtrain demo`'s classifier on 80% of the bundled digits (AdamW, lr 1e-2, batch 32, seed 0: the
    same initial weights and batch order with and without `qat`, an `artifacts.QatConfig`), save the
    checkpoint and export folder/inference.onnx. Returns the held-out images, their labels and odtrain's
    eval logits on them."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.datasets import load_digits, train_test_split
    from odtrain.demo import build_classifier

    folder = pathlib.Path(folder)
    images, labels = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_fraction=0.2, seed=0)
    model, params = build_classifier(seed=0)
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 additional_output_names=["output"], qat=qat)
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(1e-2)
    order_rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = order_rng.permutation(len(train_y))
        for start in range(0, len(order), 32):
            index = order[start:start + 32]
            module(train_x[index], train_y[index])
            optimizer.step()
            module.lazy_reset_grad()
    module.eval()
    _, logits = module(test_x, test_y)
    CheckpointState.save_checkpoint(state, folder / "checkpoint")
    module.export_model_for_inferencing(folder / "inference.onnx", ["output"])
    return test_x, test_y, logits


def dynamic_mlp(path) -> str:
    """Write the dynamically quantized reference MLP to `path`; returns the path."""
    from onnxruntime.quantization import quantize_dynamic

    quantize_dynamic(str(DATA / "mlp" / "forward.onnx"), str(path))
    return str(path)


def personalize_parameters(model_path) -> tuple[list[str], list[str]]:
    """(requires_grad, frozen_params) for the QDQ MobileNetV2: the float head trains, every other
    initializer on the way to the output (int8 weights, int32 biases, scales, zero points, running
    statistics) is frozen. (With batch statistics the quantizer also quantizes the running-statistics
    outputs, which lead nowhere.)"""
    import onnx

    meta = json.loads((DATA / "mobilenetv2_personalize" / "meta.json").read_text())
    graph = onnx.load(str(model_path), load_external_data=False).graph
    needed = {o.name for o in graph.output}
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            needed.update(node.input)
    trainable = list(meta["requires_grad"])
    return trainable, [t.name for t in graph.initializer if t.name in needed and t.name not in trainable]


def write_workload(folder, inference_form: bool = False) -> str:
    """A workload folder for benchmarks/compare.py (--models PARENT --workload NAME): the QDQ MobileNetV2
    as forward.onnx, meta.json with its head trainable and the rest frozen, the golden batches."""
    folder = pathlib.Path(folder)
    os.makedirs(folder, exist_ok=True)
    model = qdq_mobilenetv2(folder / "forward.onnx", inference_form)
    meta = json.loads((DATA / "mobilenetv2_personalize" / "meta.json").read_text())
    meta["name"] = folder.name
    meta["requires_grad"], meta["frozen_params"] = personalize_parameters(model)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    golden = folder / "golden.npz"
    if not golden.exists():
        os.symlink(DATA / "mobilenetv2_personalize" / "golden.npz", golden)
    return str(folder)


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    os.makedirs(folder, exist_ok=True)
    print(write_workload(folder / "mobilenetv2_qdq"))
    print(write_workload(folder / "mobilenetv2_qdq_inference", inference_form=True))
    print(dynamic_mlp(folder / "mlp_dynamic.onnx"))
