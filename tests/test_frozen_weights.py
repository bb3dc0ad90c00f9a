"""Frozen weights stored as int8 or bfloat16 (generate_artifacts' frozen_dtype, graph/frozen.py) and read a panel
at a time (graph/ops/dequantized.py, kernels/dequantized.py).

Oracles: numpy in float64 on the dequantized weight (the products, the activation's gradient, the gathered rows);
the float32 LoRA run of the test decoder (the int8 run's loss after 8 steps); onnxruntime (the exported models).
A float32 product of inner size K lands within K·2⁻²⁴·(|A|·|W|) of the exact one per element (the rounding of
each multiply-add); the tests allow 4x that bound elementwise, far below what a wrong scale or panel shifts.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import DATA, odtrain_main
from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.errors import ArgumentError
from odtrain.graph.frozen import reads_stored, restore_frozen, store_frozen
from odtrain.graph.ir import Graph
from odtrain.kernels import BINDINGS
from odtrain.kernels.dequantized import PANEL_ELEMENTS, _product_scratch

ODTRAIN = "ai.odtrain"
ROWS, COLUMNS, M = 400, 400, 6  # 2 or more panels of rows at either orientation, and 2 parts at 2 threads


def stored(kind: str, shape, axis: int, seed: int = 0):
    """(stored weight, scale or None, its float64 dequantized values) of a random float32 weight."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    graph = Graph(nodes=[], inputs=[], outputs=[], initializers={"w": w}, value_types={}, opsets={"": 17})
    from odtrain.graph.ir import Node

    graph.nodes = [Node("MatMul", ["x", "w"], ["y"], {}, "product")] if axis == 1 else \
        [Node("Gather", ["w", "i"], ["y"], {}, "gather")]
    scales = store_frozen(graph, ["w"], kind)
    values, scale = graph.initializers["w"], graph.initializers[scales[0]] if scales else None
    restore_frozen(graph)
    return values, scale, np.asarray(graph.initializers["w"], np.float64)


def bound(a, w64):
    return 4 * a.shape[-1] * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(w64))


def run_product(a, values, scale, out_shape, threads, **attrs):
    specs = [(a.shape, a.dtype), (values.shape, values.dtype)]
    scratch = np.zeros(_product_scratch(specs, [], threads=threads, **attrs), np.uint8)
    out = np.full(out_shape, np.nan, np.float32)
    inputs = [a, values] + ([scale] if scale is not None else [])
    for kernel, args in BINDINGS[(ODTRAIN, "DequantizedMatMul")](inputs, [out], threads=threads, scratch=scratch,
                                                                  **attrs):
        kernel(*args)
    return out


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_dequantized_product_and_its_transpose_match_float64(kind, trans_b, threads):
    """Y = A · dequant(W) (and A · dequant(W)ᵀ, the activation's gradient of the other orientation), scales per
    row and per column, over several panels and in parallel parts, against float64 on the dequantized weight."""
    assert ROWS * COLUMNS > 2 * PANEL_ELEMENTS
    for axis in (0, 1):
        values, scale, w64 = stored(kind, (ROWS, COLUMNS), axis)
        w64 = w64.T if trans_b else w64
        a = np.random.default_rng(1).standard_normal((2, M // 2, w64.shape[0])).astype(np.float32)
        out = run_product(a, values, scale, (2, M // 2, w64.shape[1]), threads, transB=trans_b, axis=axis)
        expected = a.astype(np.float64) @ w64
        assert np.all(np.abs(out - expected) <= bound(a, w64)), f"axis {axis}"


def test_dequantized_gather_reads_only_rows_exactly():
    for kind in ("int8", "bfloat16"):
        values, scale, w64 = stored(kind, (50, 7), 0)
        indices = np.array([[3, -1], [49, 0]], np.int64)
        out = np.full((2, 2, 7), np.nan, np.float32)
        inputs = [values, indices] + ([scale] if scale is not None else [])
        for kernel, args in BINDINGS[(ODTRAIN, "DequantizedGather")](inputs, [out], axis=0):
            kernel(*args)
        np.testing.assert_array_equal(out, w64[indices].astype(np.float32))


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_dequantized_gather_refuses_an_index_outside_the_rows_as_gather_does(kind):
    """Indices in [-rows, rows) gather (a negative one counts from the end: -rows is row 0); rows itself and
    -rows - 1 are outside, refused before any row outside the weight is read."""
    values, scale, w64 = stored(kind, (50, 7), 0)
    gather = BINDINGS[(ODTRAIN, "DequantizedGather")]

    def run(indices):
        out = np.full((len(indices), 7), np.nan, np.float32)
        inputs = [values, np.array(indices, np.int64)] + ([scale] if scale is not None else [])
        for kernel, args in gather(inputs, [out], axis=0):
            kernel(*args)
        return out

    np.testing.assert_array_equal(run([-50, 49, -1]), w64[[0, 49, 49]].astype(np.float32))
    for outside in (50, -51, 1000):
        with pytest.raises(ValueError, match="outside the gathered axis"):
            run([0, outside])


def linear_model(rows=24, inner=40, outer=32):
    """y = P · Wᵀ (W [outer, inner] as exported nn.Linear: MatMul of a Transpose); loss = Σ y ⊙ R."""
    rng = np.random.default_rng(2)
    inits = {"P": rng.standard_normal((rows, inner)).astype(np.float32),
             "W": rng.standard_normal((outer, inner)).astype(np.float32),
             "R": rng.standard_normal((rows, outer)).astype(np.float32)}
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["P", "Wt"], ["y"]),
             helper.make_node("Mul", ["y", "R"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "linear", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(v, n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), inits


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_activation_gradient_through_a_stored_weight(kind, tmp_path):
    """dP = R · dequant(W): the gradient rule's product (transB flipped) against float64; the training model reads
    the stored weight in place (no DequantizeLinear or Cast left), and the checkpoint holds it in its type."""
    model, inits = linear_model()
    artifacts.generate_artifacts(model, requires_grad=["P"], frozen_params=["W"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path, frozen_dtype=kind)
    trained = {n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node}
    assert "DequantizedMatMul" in trained and not trained & {"DequantizeLinear", "Cast"}
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    weight = state.parameters["W"].data
    assert weight.dtype.name == kind
    scale = (state.parameters["W_frozen_scale"].data[:, None].astype(np.float64) if kind == "int8" else 1.0)
    w64 = weight.astype(np.float64) * scale
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss = module()
    p64, r64 = inits["P"].astype(np.float64), inits["R"].astype(np.float64)
    np.testing.assert_allclose(float(loss), np.sum((p64 @ w64.T) * r64), rtol=1e-5)
    expected = r64 @ w64
    assert np.all(np.abs(state.parameters["P"].grad - expected) <= bound(inits["R"], w64))


GRADIENT_ORACLES = {"DequantizedMatMul": test_activation_gradient_through_a_stored_weight}


def test_stored_weights_round_trip_through_a_checkpoint(tmp_path):
    """int8 weights with their scales, and bfloat16 weights, save and load bit for bit and keep their types."""
    model, _ = linear_model()
    for kind in ("int8", "bfloat16"):
        folder = tmp_path / kind
        artifacts.generate_artifacts(model, requires_grad=["P"], frozen_params=["W"], loss=None,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=folder, frozen_dtype=kind)
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        CheckpointState.save_checkpoint(state, folder / "again")
        again = CheckpointState.load_checkpoint(folder / "again")
        for name in state.parameters.keys():
            before, after = state.parameters[name].data, again.parameters[name].data
            assert before.dtype == after.dtype and before.tobytes() == after.tobytes(), name
        assert again.parameters["W"].data.dtype.name == kind


def test_a_type_frozen_weights_are_not_stored_in_is_refused(capsys, tmp_path):
    model, _ = linear_model()
    with pytest.raises(ArgumentError, match="'float16' is not a type frozen weights are stored in.*int8"):
        artifacts.generate_artifacts(model, requires_grad=["P"], frozen_params=["W"], loss=None,
                                     artifact_directory=tmp_path, frozen_dtype="float16")
    path = tmp_path / "linear.onnx"
    onnx.save(model, path)
    code, _, err = odtrain_main(capsys, "prepare", path, "-o", tmp_path / "out", "--frozen-dtype", "int2")
    assert code == 2 and "--frozen-dtype: invalid choice: 'int2' (choose from 'float32', 'bfloat16', 'int8', 'int4')" \
        in err


# ---- the test decoder with LoRA ----------------------------------------------------------------------------

LORA_TARGETS = ["*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*"]
STEPS, LR = 8, 1e-2
# The int8 run's loss after 8 steps on one repeated batch (the loss falls 5.488 -> 5.139), relative to the
# float32 run's: measured 5.4e-5 (bfloat16: 5.5e-5); a float32 run at 1.01x the learning rate lands 1.9e-4
# away, so this bound, well inside the 1% asked of int8, still tells a 1% learning-rate change apart.
LOSS_TOLERANCE = 1e-4


def lora_run(directory, frozen_dtype, lr=LR, outputs=(), model=None):
    """STEPS LoRA steps on the tiny Llama's golden batch (or on `model`, a file of the same inputs); returns the eval
    loss, the module and the batch."""
    folder = DATA / "decoders" / "llama"
    golden = np.load(folder / "golden.npz")
    artifacts.generate_artifacts(str(model or folder / "torchscript17.onnx"), loss=artifacts.LossType.CrossEntropyLoss,
                                 class_axis=-1, ignore_index=-100, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory, additional_output_names=list(outputs),
                                 lora=artifacts.LoraConfig(4, 8.0, LORA_TARGETS), frozen_dtype=frozen_dtype)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(lr)
    batch = [golden[key][0] for key in ("input_ids", "attention_mask", "labels")]
    for _ in range(STEPS):
        module(*batch)
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    results = module(*batch)
    return (float(results[0]) if outputs else float(results)), module, batch


@pytest.mark.slow
def test_int8_lora_run_lands_on_the_float32_run(tmp_path):
    """8 LoRA steps on an int8 base end within LOSS_TOLERANCE of the float32 base's loss; a 1% larger learning
    rate on the float32 base does not."""
    float32, _, _ = lora_run(tmp_path / "float32", "float32")
    int8, module, _ = lora_run(tmp_path / "int8", "int8")
    assert abs(int8 - float32) <= LOSS_TOLERANCE * float32
    mutant, _, _ = lora_run(tmp_path / "mutant", "float32", lr=LR * 1.01)
    assert abs(mutant - float32) > 1.5 * LOSS_TOLERANCE * float32
    held = module.state.buffer_bytes().frozen_bytes_by_type
    assert held["int8"] > 3 * held["float32"]  # the matrices; the norms and scales stay float32


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_exported_models_run_in_onnxruntime_like_odtrain(kind, tmp_path):
    """After LoRA steps on a stored base, odtrain's eval (the eval model's products and gathers reading the stored
    weights in place) and the inference model in float32 (the default: adapters merged) and in the
    stored type (int8 as QDQ, DequantizeLinear per output channel; bfloat16 through Cast; adapters beside the
    weights) gives odtrain's eval logits in onnxruntime. Measured: 4.6e-7 of the largest logit (float32),
    3.1e-7 (int8), 3.0e-7 (bfloat16); merging the adapters into int8 weights instead was 6.8e-3 away."""
    onnxruntime = pytest.importorskip("onnxruntime")
    _, module, batch = lora_run(tmp_path, kind, outputs=("logits",))
    _, logits = module(*batch)
    evaluated = module._eval.step_graph  # the eval model reads them in place too
    types = evaluated.value_types
    assert {"DequantizedMatMul", "DequantizedGather"} <= {n.op_type for n in evaluated.nodes}
    assert not any(reads_stored(n, lambda name: types[name].dtype if name in types else None) for n in evaluated.nodes)
    feeds = {"input_ids": batch[0], "attention_mask": batch[1]}
    for frozen_dtype in (None, kind):
        path = tmp_path / f"inference_{frozen_dtype}.onnx"
        module.export_model_for_inferencing(path, ["logits"], frozen_dtype=frozen_dtype)
        saved = onnx.load(str(path))
        matrices = {t.data_type for t in saved.graph.initializer if len(t.dims) == 2 and min(t.dims) > 4}
        assert matrices == ({TensorProto.FLOAT} if frozen_dtype is None else
                            {TensorProto.INT8 if kind == "int8" else TensorProto.BFLOAT16})
        (got,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(got, logits, atol=1e-5 * np.abs(logits).max(), rtol=0, err_msg=str(frozen_dtype))
    # stored in the other type: the weights converted once more (measured: int8 to bfloat16 2.4e-3 of the largest
    # logit, bfloat16 to int8 1.0e-2), still a model onnxruntime runs
    other = "bfloat16" if kind == "int8" else "int8"
    path = tmp_path / f"inference_{other}.onnx"
    module.export_model_for_inferencing(path, ["logits"], frozen_dtype=other)
    (got,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got, logits, atol=3e-2 * np.abs(logits).max(), rtol=0)


def test_weights_convert_in_blocks_as_whole():
    """int8 per channel (either axis, several blocks of rows) equals qat.symmetric_weight; bfloat16 equals ml_dtypes'
    conversion of the whole weight."""
    from odtrain.graph import frozen
    from odtrain.graph.qat import symmetric_weight

    w = np.random.default_rng(3).standard_normal((3000, 700)).astype(np.float32)
    w[5] = 0  # a channel of zeros: scale 1
    assert w.size > 2 * frozen.BLOCK_ELEMENTS
    for axis in (0, 1):
        values, scale = frozen.int8_per_channel(w, axis)
        expected_values, expected_scale = symmetric_weight(w, axis)
        np.testing.assert_array_equal(scale, expected_scale)
        np.testing.assert_array_equal(values, expected_values)
    converted = frozen.bfloat16_values(w)
    assert converted.tobytes() == w.astype(converted.dtype).tobytes()


def test_a_model_written_without_onnx_appends_its_large_initializers(tmp_path, monkeypatch):
    """Where onnx is not loaded (a device exporting), save_graph writes the large initializers (int8, bfloat16,
    float32) from their arrays after the model's other bytes; onnx reads every value back."""
    import sys

    from odtrain.graph.ir import Graph, Node
    from odtrain.graph.onnx_io import save_graph
    from odtrain.graph.onnx_wire import numpy_dtype

    w = np.random.default_rng(4).standard_normal((64, 48)).astype(np.float32)
    values = {"float": w, "int8": np.arange(64 * 48).reshape(64, 48).astype(np.int8),
              "bf16": w.astype(numpy_dtype(TensorProto.BFLOAT16)), "scale": np.ones(48, np.float32)}
    graph = Graph([Node("DequantizeLinear", ["int8", "scale"], ["a"], {"axis": 1}, "dq"),
                   Node("Cast", ["bf16"], ["b"], {"to": 1}, "cast"), Node("Add", ["a", "b"], ["c"], {}, "add"),
                   Node("Add", ["c", "float"], ["y"], {}, "add2")], [], ["y"], dict(values), {}, {"": 21})
    path = tmp_path / "model.onnx"
    with monkeypatch.context() as patched:
        patched.delitem(sys.modules, "onnx")
        save_graph(graph, path)
    saved = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert sorted(saved) == sorted(values)
    for name, value in values.items():
        assert saved[name].dtype == value.dtype and saved[name].tobytes() == value.tobytes(), name


def embedding_model(vocabulary=64, width=48, outer=40):
    """y = (E[ids] ⊙ P) · Wᵀ, loss = Σ y ⊙ R: an embedding and a product of frozen weights, P trains."""
    rng = np.random.default_rng(5)
    inits = {"E": rng.standard_normal((vocabulary, width)).astype(np.float32),
             "P": rng.standard_normal(width).astype(np.float32),
             "W": rng.standard_normal((outer, width)).astype(np.float32),
             "R": rng.standard_normal((2, 8, outer)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Mul", ["h", "P"], ["scaled"]),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["scaled", "Wt"], ["y"]),
             helper.make_node("Mul", ["y", "R"], ["weighted"]), helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(v, n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "bfloat16", "int4"])
def test_the_kernel_library_runs_stored_weights_with_the_jits_bits(kind, tmp_path):
    """The dequantizing kernels built into the kernel library (odtrain compile) give the JIT's bits, at one
    thread and at two."""
    import shutil

    from odtrain import kernel_library
    from odtrain.library_build import compile_artifacts

    with_library, without = tmp_path / "library", tmp_path / "jit"
    artifacts.generate_artifacts(embedding_model(), requires_grad=["P"], frozen_params=["E", "W"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=with_library,
                                 frozen_dtype=kind)
    shutil.copytree(with_library, without)
    compile_artifacts(with_library, thread_counts=(1, 2), out=lambda line: None)
    ids = np.random.default_rng(6).integers(0, 64, (3, 2, 8))
    for threads in (1, 2):
        results = []
        for folder in (with_library, without):
            state = CheckpointState.load_checkpoint(folder / "checkpoint")
            module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx", num_threads=threads)
            optimizer = Optimizer(folder / "optimizer_model.onnx", module)
            losses = []
            for step in range(3):
                losses.append(float(module(ids[step])))
                optimizer.step()
                module.lazy_reset_grad()
            assert (module.kernel_library is not None) == (folder == with_library)
            if folder == with_library:  # every call of the step ran in the library
                assert next(iter(module._train.plans.values())).program.jit_calls == 0
            results.append((losses, state._store.flat.copy()))
        kinds = {n.op_type for n in onnx.load(str(with_library / "training_model.onnx")).graph.node}
        assert {"DequantizedGather", "DequantizedMatMul"} <= kinds
        assert results[0][0] == results[1][0] and np.array_equal(results[0][1], results[1][1])
    assert kernel_library.FOLDER in {p.name for p in with_library.iterdir()}
