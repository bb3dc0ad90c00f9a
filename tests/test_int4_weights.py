"""Frozen weights in 4 bits (frozen_dtype="int4"; graph/int4.py, graph/frozen.py, kernels/dequantized.py).

Oracles: a whole-array numpy quantizer written here from the rule (graph/int4.py's docstring); onnx's own packing
of int4 tensors; numpy in float64 on the dequantized weight (products, gathers, the fused vocabulary loss); the
float32 LoRA run of the test decoder whose weights are the int4 run's dequantized ones; onnxruntime (exports).
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto

from odtrain import artifacts
from odtrain.api import CheckpointState, Module
from odtrain.graph.errors import CheckpointError
from odtrain.graph.int4 import PackedInt4, dequantize, int4_blocks
from odtrain.kernels import BINDINGS
from odtrain.kernels.dequantized import PANEL_ELEMENTS
from conftest import DATA
from test_frozen_weights import LORA_TARGETS, LR, STEPS, bound, linear_model, lora_run, run_product

ODTRAIN = "ai.odtrain"
BLOCK = 32


def reference_int4(w: np.ndarray, axis: int, block: int):
    """(int8 values, float32 scales) by the rule, on the whole weight at once: blocks of `block` along `axis`
    (the last one shorter), s = (the block's value of largest magnitude) / -8, q = clip(rint(w / s), -8, 7)."""
    moved = np.moveaxis(w, axis, 1)
    rows, width = moved.shape
    scales = np.ones((rows, -(-width // block)), np.float32)
    values = np.zeros(moved.shape, np.int8)
    for r in range(rows):
        for b in range(scales.shape[1]):
            part = moved[r, b * block:(b + 1) * block]
            largest = part[np.argmax(np.abs(part))]
            if largest != 0:
                scales[r, b] = largest / np.float32(-8)
            values[r, b * block:(b + 1) * block] = np.clip(np.rint(part / scales[r, b]), -8, 7)
    return np.moveaxis(values, 1, axis), np.moveaxis(scales, 1, axis)


@pytest.mark.parametrize("shape", [(37, 70), (3000, 701), (64, 96)])
def test_int4_quantization_matches_the_rule_and_onnxs_packing(shape):
    """int4_blocks (a run of rows at a time, odd widths, short last blocks, an all-zero block) gives the rule's
    values and scales, packed as onnx packs an int4 tensor; dequantize is ONNX's DequantizeLinear."""
    from odtrain.graph import int4

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[1, :BLOCK] = 0
    w[:BLOCK, 1] = 0
    for axis in (0, 1):
        packed, scale = int4_blocks(w, axis, BLOCK)
        values, expected_scale = reference_int4(w, axis, BLOCK)
        np.testing.assert_array_equal(scale, expected_scale)
        np.testing.assert_array_equal(packed.values(), values)
        onnx_bytes = onnx.numpy_helper.from_array(values.astype(packed.dtype)).raw_data
        assert packed.packed.tobytes() == onnx_bytes and packed.nbytes == (w.size + 1) // 2
        np.testing.assert_array_equal(dequantize(packed, scale, axis, BLOCK),
                                      values * np.repeat(expected_scale, BLOCK, axis)[:shape[0], :shape[1]])
    assert w.size > 2 * int4.ROW_ELEMENTS or shape != (3000, 701)  # that one quantizes in several runs of rows


def whole_array_int4(w: np.ndarray, axis: int, block: int):
    """(int8 values, float32 scales) by the rule on the whole weight in one numpy expression: the oracle for
    shapes too large for reference_int4's loops."""
    moved = np.moveaxis(w, axis, 1)
    rows, width = moved.shape
    blocks = -(-width // block)
    padded = np.zeros((rows, blocks * block), np.float32)
    padded[:, :width] = moved
    grouped = padded.reshape(rows, blocks, block)
    largest = np.take_along_axis(grouped, np.abs(grouped).argmax(axis=2)[..., None], axis=2)[..., 0]
    scales = np.where(largest != 0, largest / np.float32(-8), np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(grouped / scales[..., None]), -8, 7).astype(np.int8).reshape(rows, -1)[:, :width]
    return np.moveaxis(values, 1, axis), np.moveaxis(scales, 1, axis)


@pytest.mark.parametrize("shape, block", [((2100, 1001), 3), ((1500, 1399), 5), ((2100, 1001), 32)])
def test_int4_runs_of_rows_start_on_a_block_with_an_odd_block_and_an_odd_width(shape, block):
    """Past ROW_ELEMENTS values int4_blocks quantizes a run of rows at a time; with blocks along axis 0 every run
    must start on a block and, with an odd column count, on a byte: an odd block and an odd width need both
    (block 3 on (2100, 1001) once started a run at row 1048, inside a block, and its scales diverged)."""
    from odtrain.graph import int4

    assert shape[0] * shape[1] > int4.ROW_ELEMENTS and shape[1] % 2
    w = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    for axis in (0, 1):
        packed, scale = int4_blocks(w, axis, block)
        values, expected_scale = whole_array_int4(w, axis, block)
        np.testing.assert_array_equal(scale, expected_scale)
        np.testing.assert_array_equal(packed.values(), values)


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (33, 71)])
def test_int4_tensor_of_an_odd_size_keeps_its_last_value(shape):
    """An odd count of 4-bit values packs the last one alone in the low nibble of its byte (ONNX's packing): it
    survives packing (a nominal checkpoint's is the next test)."""
    w = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    w.reshape(-1)[-1] = -3 * np.abs(w).max()  # the last value is its block's largest: it quantizes to -8
    for axis in (0, 1):
        packed, scale = int4_blocks(w, axis, BLOCK)
        values, _ = reference_int4(w, axis, BLOCK)
        assert packed.nbytes == (w.size + 1) // 2 and values.reshape(-1)[-1] == -8
        np.testing.assert_array_equal(packed.values(), values)
        assert packed.packed.tobytes() == onnx.numpy_helper.from_array(values.astype(packed.dtype)).raw_data
        np.testing.assert_array_equal(PackedInt4.from_values(values).values(), values)


def test_a_nominal_checkpoint_holds_an_odd_sized_int4_weight(tmp_path):
    """A nominal checkpoint (shapes only) records a 4-bit weight of an odd size and loads it as ⌈size / 2⌉ zero
    bytes, as the stored one."""
    from odtrain import checkpoint as checkpoint_file
    from odtrain.checkpoint import CheckpointContents

    packed, _ = int4_blocks(np.ones((5, 7), np.float32), 1, BLOCK)
    contents = CheckpointContents({"W": packed, "P": np.zeros((3,), np.float32)}, ["P"], nominal=True)
    checkpoint_file.save(tmp_path / "nominal", contents)
    loaded = checkpoint_file.load(tmp_path / "nominal").parameters["W"]
    assert isinstance(loaded, PackedInt4) and loaded.shape == (5, 7) and loaded.nbytes == 18


@pytest.mark.parametrize("threads", [1, 2])
def test_int4_transposed_product_over_zero_columns_is_zero(threads):
    """A · dequant(W)ᵀ with W [rows, 0] (an empty sum) writes zeros over the whole output, not what the arena
    held before (and A · dequant(W) with W [0, columns] likewise)."""
    for trans_b, (rows, columns) in ((1, (40, 0)), (0, (0, 40))):
        packed, scale = int4_blocks(np.zeros((rows, columns), np.float32), 1, BLOCK)
        a = np.ones((3, 0), np.float32)
        out = run_product(a, packed, scale, (3, 40), threads, transB=trans_b, axis=1, block_size=BLOCK)
        np.testing.assert_array_equal(out, np.zeros((3, 40), np.float32))


def int4_weight(shape, axis, seed=0):
    """(PackedInt4, scale, float64 dequantized values) of a random weight, blocks along `axis`."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    packed, scale = int4_blocks(w, axis, BLOCK)
    return packed, scale, dequantize(packed, scale, axis, BLOCK).astype(np.float64)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_product_and_its_transpose_match_float64(trans_b, threads):
    """Y = A · dequant(W) and A · dequant(W)ᵀ (the activation's gradient of the other orientation), blocks along
    either axis, over several panels and parallel parts; an odd width puts rows and part boundaries inside a
    byte (the high nibble first)."""
    for rows, columns in ((400, 400), (533, 251)):
        assert rows * columns > 2 * PANEL_ELEMENTS
        for axis in (0, 1):
            packed, scale, w64 = int4_weight((rows, columns), axis)
            product = w64.T if trans_b else w64
            a = np.random.default_rng(1).standard_normal((2, 3, product.shape[0])).astype(np.float32)
            out = run_product(a, packed, scale, (2, 3, product.shape[1]), threads, transB=trans_b, axis=axis,
                              block_size=BLOCK)
            expected = a.astype(np.float64) @ product
            assert np.all(np.abs(out - expected) <= bound(a, product)), (rows, columns, axis)


def test_int4_gather_dequantizes_only_its_rows_exactly():
    for axis in (0, 1):
        packed, scale, w64 = int4_weight((50, 37), axis)
        indices = np.array([[3, -1], [49, 0]], np.int64)
        out = np.full((2, 2, 37), np.nan, np.float32)
        for kernel, args in BINDINGS[(ODTRAIN, "DequantizedGather")]([packed, indices, scale], [out], axis=axis,
                                                                      block_size=BLOCK):
            kernel(*args)
        np.testing.assert_array_equal(out, w64[indices].astype(np.float32))


def test_an_unfused_dequantize_linear_reads_a_packed_weight_as_onnx_does():
    """DequantizeLinear(int4, scale, axis, block_size) on a packed weight that no product reads in place (the
    kernel unpacks it as the step binds) against onnx's reference evaluator."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    packed, scale, _ = int4_weight((40, 70), 1)
    y = np.zeros((40, 70), np.float32)
    for kernel, args in BINDINGS[("", "DequantizeLinear")]([packed, scale], [y], axis=1, block_size=BLOCK):
        kernel(*args)
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=BLOCK)
    (expected,) = ReferenceEvaluator(node).run(None, {"q": np.asarray(packed), "s": scale})
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_vocabulary_loss_on_an_int4_head_matches_float64(threads, monkeypatch):
    """LinearCrossEntropy on a tied int4 head (W [V, H] read transposed, blocks along H) in chunks of rows and
    small panels: the mean loss and dHidden against float64 on the dequantized weight."""
    from odtrain.kernels import parallel_split
    from odtrain.kernels import training as loss_kernels
    from odtrain.kernels.training import _vocabulary_scratch

    monkeypatch.setattr(loss_kernels, "CHUNK_MIN_ROWS", 4)
    monkeypatch.setattr(loss_kernels, "CHUNK_BYTES", 0)
    monkeypatch.setattr(loss_kernels, "PANEL_ELEMENTS", 256)
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    vocabulary, width, rows = 97, 70, 10
    packed, scale, w64 = int4_weight((vocabulary, width), 1)
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((rows, width)).astype(np.float32)
    labels = rng.integers(0, vocabulary, rows).astype(np.int64)
    labels[3] = -100
    attrs = dict(transB=1, axis=1, block_size=BLOCK, ignore_index=-100, reduction="mean", threads=threads)
    specs = [(hidden.shape, hidden.dtype), (packed.shape, packed.dtype), (labels.shape, labels.dtype)]
    scratch = np.zeros(_vocabulary_scratch(specs, [], **attrs), np.uint8)
    loss, dhidden = np.zeros((), np.float32), np.zeros_like(hidden)
    for kernel, args in BINDINGS[(ODTRAIN, "LinearCrossEntropy")]([hidden, packed, labels, scale], [loss, dhidden],
                                                                   scratch=scratch, **attrs):
        kernel(*args)
    logits = hidden.astype(np.float64) @ w64.T
    counted = labels != -100
    shifted = logits - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    expected_loss = -np.log(probabilities[counted, labels[counted]]).mean()
    gradient = probabilities.copy()
    gradient[counted, labels[counted]] -= 1
    gradient[~counted] = 0
    expected_hidden = gradient / counted.sum() @ w64
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
    np.testing.assert_allclose(dhidden, expected_hidden, rtol=0, atol=1e-5 * np.abs(expected_hidden).max())


def test_int4_weights_train_store_and_refuse_damage(tmp_path):
    """A product reading an int4 weight trains its activation (dP = R · dequant(W), float64 oracle); the models
    are opset 21 with DequantizeLinear(block_size) in the eval model; the checkpoint keeps the packed bytes bit
    for bit through a save; a checkpoint whose packed bytes do not fit the recorded shape is refused."""
    from odtrain import checkpoint as checkpoint_file

    model, inits = linear_model(inner=70, outer=32)  # W [32, 70]: blocks of 32 along 70, the last one short
    artifacts.generate_artifacts(model, requires_grad=["P"], frozen_params=["W"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path, frozen_dtype="int4")
    evaluated = onnx.load(str(tmp_path / "eval_model.onnx"))
    assert {o.version for o in evaluated.opset_import if o.domain in ("", "ai.onnx")} == {21}
    (dequantize_node,) = [n for n in evaluated.graph.node if n.op_type == "DequantizeLinear"]
    assert {a.name: a.i for a in dequantize_node.attribute} == {"axis": 1, "block_size": BLOCK}
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    weight, scale = state.parameters["W"].data, state.parameters["W_frozen_scale"].data
    assert isinstance(weight, PackedInt4) and weight.shape == (32, 70) and scale.shape == (32, 3)
    w64 = dequantize(weight, scale, 1, BLOCK).astype(np.float64)
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss = module()
    p64, r64 = inits["P"].astype(np.float64), inits["R"].astype(np.float64)
    np.testing.assert_allclose(float(loss), np.sum((p64 @ w64.T) * r64), rtol=1e-5)
    assert np.all(np.abs(state.parameters["P"].grad - r64 @ w64) <= bound(inits["R"], w64))
    assert state.buffer_bytes().frozen_bytes_by_type["int4"] == 32 * 70 // 2

    CheckpointState.save_checkpoint(state, tmp_path / "again")
    again = CheckpointState.load_checkpoint(tmp_path / "again").parameters["W"].data
    assert isinstance(again, PackedInt4) and again.shape == weight.shape
    assert again.packed.tobytes() == weight.packed.tobytes()

    # a whole file whose recorded shape does not fit its packed bytes (what a writer with a bug would leave)
    contents = checkpoint_file.load(tmp_path / "checkpoint")
    mismatched = PackedInt4.__new__(PackedInt4)
    mismatched.__dict__.update(weight.__dict__, shape=(32, 71))
    contents.parameters["W"] = mismatched
    checkpoint_file.save(tmp_path / "mismatched", contents)
    with pytest.raises(CheckpointError, match=r"damaged: 4-bit parameter 'W' of shape \[32, 71\] needs packed uint8 "
                                              r"bytes .* it holds uint8 \[1120\]"):
        CheckpointState.load_checkpoint(tmp_path / "mismatched")


def test_int4_artifacts_train_without_importing_onnx(tmp_path):
    """A training process reads an int4 model's value types through ml_dtypes, not onnx: `import onnx` alone
    adds some 28 MiB to the process, which a 1B model's memory cap has no room for."""
    import os
    import subprocess
    import sys

    model, _ = linear_model(inner=70, outer=32)
    artifacts.generate_artifacts(model, requires_grad=["P"], frozen_params=["W"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path, frozen_dtype="int4")
    probe = ("import sys; from odtrain.api import CheckpointState, Module\n"
             f"state = CheckpointState.load_checkpoint({str(tmp_path / 'checkpoint')!r})\n"
             f"module = Module({str(tmp_path / 'training_model.onnx')!r}, state)\n"
             "assert any(t.dtype.name == 'int4' for t in module.graph().value_types.values())\n"
             "print(float(module()), sorted(m for m in sys.modules if m.split('.')[0] == 'onnx'))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's odtrain
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "[]"


# ---- the test decoder with LoRA ----------------------------------------------------------------------------

DECODER = DATA / "decoders" / "llama"
# Relative differences of the loss after 8 LoRA steps (tests/test_frozen_weights.py's run; the loss falls
# 5.488 -> 5.139). The int4 run against the float32 run on its dequantized weights: measured 0 (the panels hold
# the same float32 values); a 1% larger learning rate moves that run 1.7e-4. The int4 run against the float32
# base: measured 1.2e-3, the quantization's own effect, inside the 1% asked of a 4-bit base.
INT4_TOLERANCE = 2e-5
BASE_TOLERANCE = 1e-2


def lora_loss(directory, model, frozen_dtype, lr=LR):
    """The eval loss after STEPS LoRA steps on the golden batch (test_frozen_weights.lora_run on `model`)."""
    loss, module, _ = lora_run(directory, frozen_dtype, lr, model=model)
    return loss, module


def dequantized_decoder(path):
    """The test decoder with each weight that frozen_dtype="int4" stores (the frozen matrices that LoRA leaves)
    replaced by its dequantized float32 values: the int4 run's numbers in float32."""
    from odtrain.artifacts import _with_adapters
    from odtrain.graph.frozen import restore_frozen, store_frozen
    from odtrain.graph.onnx_io import load_graph, save_graph

    source = str(DECODER / "torchscript17.onnx")
    _, trainable, frozen, _ = _with_adapters(load_graph(source), artifacts.LoraConfig(4, 8.0, LORA_TARGETS), None,
                                             None)
    graph = load_graph(source)
    assert store_frozen(graph, [n for n in frozen if n not in trainable], "int4")
    restore_frozen(graph)
    save_graph(graph, path)
    return path


@pytest.mark.slow
def test_int4_lora_run_lands_on_its_dequantized_float32_run_and_near_the_float32_base(tmp_path):
    """8 LoRA steps on an int4 base give the loss of the float32 run on the int4 weights dequantized (within
    INT4_TOLERANCE; a 1% larger learning rate does not), and stay within BASE_TOLERANCE of the float32 base's."""
    int4, module = lora_loss(tmp_path / "int4", DECODER / "torchscript17.onnx", "int4")
    dequantized = dequantized_decoder(tmp_path / "dequantized.onnx")
    same, _ = lora_loss(tmp_path / "same", dequantized, "float32")
    mutant, _ = lora_loss(tmp_path / "mutant", dequantized, "float32", lr=LR * 1.01)
    base, _ = lora_loss(tmp_path / "float32", DECODER / "torchscript17.onnx", "float32")
    print(f"int4 {int4!r} dequantized float32 {same!r} (1% learning rate {mutant!r}) float32 base {base!r}")
    assert abs(int4 - same) <= INT4_TOLERANCE * same
    assert abs(mutant - same) > 1.5 * INT4_TOLERANCE * same
    assert abs(int4 - base) <= BASE_TOLERANCE * base
    held = module.state.buffer_bytes().frozen_bytes_by_type
    assert held["int4"] > held["float32"]


@pytest.mark.slow
def test_int4_exports_run_in_onnxruntime_like_odtrains_eval(tmp_path):
    """After LoRA steps on an int4 base, the inference model in float32 (adapters merged, the default) and in int4
    (DequantizeLinear with block_size on INT4 initializers at opset 21, adapters beside the weights) give
    odtrain's eval logits in onnxruntime. Measured: 4.6e-7 (float32) and 3.4e-7 (int4) of the largest logit."""
    onnxruntime = pytest.importorskip("onnxruntime")
    _, module, batch = lora_run(tmp_path, "int4", outputs=("logits",))
    _, logits = module(*batch)
    assert {"DequantizedMatMul", "DequantizedGather"} <= {n.op_type for n in module._eval.step_graph.nodes}
    feeds = {"input_ids": batch[0], "attention_mask": batch[1]}
    for frozen_dtype in (None, "int4"):
        path = tmp_path / f"inference_{frozen_dtype}.onnx"
        module.export_model_for_inferencing(path, ["logits"], frozen_dtype=frozen_dtype)
        saved = onnx.load(str(path))
        matrices = {t.data_type for t in saved.graph.initializer if len(t.dims) == 2 and min(t.dims) > 4}
        assert matrices == ({TensorProto.FLOAT} if frozen_dtype is None else {TensorProto.INT4})
        (got,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(got, logits, atol=EXPORT_TOLERANCE * np.abs(logits).max(), rtol=0,
                                   err_msg=str(frozen_dtype))


EXPORT_TOLERANCE = 1e-5


# ---- prepare in bounded memory -------------------------------------------------------------------------------

def chain_model(path, layers: int, width: int):
    """x · W0 → Tanh → ... → · head: `layers` frozen [width, width] float32 products and a small trainable head,
    saved with external data (as an exporter writes a model beyond protobuf's 2 GB)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(7)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"h{i}"])]
        h = f"h{i}"
    inits.append(numpy_helper.from_array(np.full((width, 10), 0.01, np.float32), "head"))
    nodes.append(helper.make_node("MatMul", [h, "head"], ["logits"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    return path


def prepare_peak(model, output) -> tuple[int, str]:
    """(peak RSS (bytes, VmHWM), summary) of `odtrain prepare MODEL --frozen-dtype int4` in a process of its own. Not
    ru_maxrss: a forked child's keeps its parent's peak (this test's, holding the model it wrote) across exec."""
    import subprocess
    import sys

    script = ("import sys\n"
              "from odtrain import cli\n"
              "assert cli.main(sys.argv[1:]) == 0\n"
              "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n")
    done = subprocess.run([sys.executable, "-c", script, "prepare", str(model), "-o", str(output), "--requires-grad",
                           "head", "--frozen-dtype", "int4"], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) * 1024, done.stdout


# prepare's peak above the same process on a model of one small layer, as a share of the float32 weights' file:
# measured 0.26 (16 layers of 2048 x 2048, a 256 MiB file: the packed values and the scales, an eighth of the
# file each, and one weight's temporaries); a prepare reading the float32 weights into memory instead of mapping
# them one at a time adds the whole file (measured 1.06x).
PREPARE_SHARE = 0.4


@pytest.mark.slow
def test_prepare_quantizes_a_model_with_external_data_in_bounded_memory(tmp_path, capsys):
    """prepare --frozen-dtype int4 reads, quantizes and writes the weights one at a time: its peak RSS grows by
    well under the file's bytes. prepare's summary and `odtrain memory` give the 4-bit bytes."""
    from conftest import odtrain_main

    (tmp_path / "large").mkdir()
    (tmp_path / "small").mkdir()
    large = chain_model(tmp_path / "large" / "model.onnx", 16, 2048)
    small = chain_model(tmp_path / "small" / "model.onnx", 1, 64)
    file_bytes = (tmp_path / "large" / "weights.bin").stat().st_size
    (peak, summary), (floor, _) = prepare_peak(large, tmp_path / "large_out"), prepare_peak(small, tmp_path / "small_out")
    grown = peak - floor
    print(f"prepare's peak grows by {grown / file_bytes:.2f}x the {file_bytes / 2 ** 20:.0f} MiB of weights")
    assert grown <= PREPARE_SHARE * file_bytes
    state = CheckpointState.load_checkpoint(tmp_path / "large_out" / "checkpoint")
    packed = 16 * 2048 * 2048 // 2
    assert state.buffer_bytes().frozen_bytes_by_type == {"int4": packed, "float32": packed // 4}  # values, scales
    assert "held as int4 32.00 MiB, float32 8.00 MiB" in summary
    code, report, _ = odtrain_main(capsys, "memory", tmp_path / "large_out", "--batch-size", "2")
    assert code == 0 and "frozen: int4 32.00 MiB, float32 8.00 MiB" in report


def test_a_model_with_int4_weights_is_written_at_opset_21():
    """at_blocked_opset: an opset-17 graph holding 4-bit values comes back at opset 21 with ReduceMean's axes as
    an input (the caller's graph unchanged); an op whose meaning changed since (GridSample) is refused."""
    from odtrain.graph.errors import ModelError
    from odtrain.graph.int4 import at_blocked_opset
    from odtrain.graph.ir import Graph, Node

    packed, scale, _ = int4_weight((4, 32), 1)
    nodes = [Node("DequantizeLinear", ["w", "s"], ["d"], {"axis": 1, "block_size": BLOCK}, "dq"),
             Node("ReduceMean", ["d"], ["m"], {"axes": [-1], "keepdims": 1}, "mean")]
    graph = Graph(nodes, [], ["m"], {"w": packed, "s": scale}, {}, {"": 17})
    raised = at_blocked_opset(graph)
    assert raised.opsets[""] == 21 and graph.opsets[""] == 17 and graph.nodes[1].attrs["axes"] == [-1]
    (mean,) = [n for n in raised.nodes if n.op_type == "ReduceMean"]
    assert "axes" not in mean.attrs and raised.initializers[mean.inputs[1]].tolist() == [-1]
    graph.nodes.append(Node("GridSample", ["m", "m"], ["g"], {}, "sample"))
    with pytest.raises(ModelError, match="GridSample.*export the model at opset 21"):
        at_blocked_opset(graph)
    assert at_blocked_opset(Graph(nodes[1:], [], ["m"], {}, {}, {"": 17})).opsets[""] == 17  # no 4-bit values


def test_a_model_past_protobufs_limit_keeps_its_weights_beside_it(tmp_path, monkeypatch):
    """A model whose weights would pass protobuf's 2 GiB (here a limit made small) is written with its large
    initializers in `<file>.data` (ONNX's external data, float32 and packed int4 alike; a small scale stays
    inside); onnx, onnxruntime and odtrain read it back whole."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from odtrain.graph import onnx_io
    from odtrain.graph.ir import Graph, Node, TensorType

    packed, scale, w64 = int4_weight((64, 96), 1)
    w = np.random.default_rng(8).standard_normal((96, 48)).astype(np.float32)
    nodes = [Node("DequantizeLinear", ["q", "s"], ["d"], {"axis": 1, "block_size": BLOCK}, "dq"),
             Node("MatMul", ["x", "d"], ["h"], {}, "first"), Node("MatMul", ["h", "w"], ["y"], {}, "second")]
    types = {"x": TensorType(np.dtype(np.float32), (2, 64)), "y": TensorType(np.dtype(np.float32), (2, 48))}
    graph = Graph(nodes, ["x"], ["y"], {"q": packed, "s": scale, "w": w}, types, {"": 21})
    monkeypatch.setattr(onnx_io, "PROTOBUF_LIMIT", 10_000)
    path = tmp_path / "model.onnx"
    onnx_io.save_graph(graph, path)
    assert (tmp_path / "model.onnx.data").stat().st_size >= packed.nbytes + w.nbytes
    saved = onnx.load(str(path), load_external_data=False)
    assert {t.name for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL} == {"q", "w"}
    x = np.random.default_rng(9).standard_normal((2, 64)).astype(np.float32)
    (got,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, (x.astype(np.float64) @ w64) @ w, rtol=1e-4, atol=1e-4)
    loaded = onnx_io.load_graph(str(path))
    assert np.asarray(loaded.initializers["w"]).tobytes() == w.tobytes()
    assert loaded.initializers["q"].packed.tobytes() == packed.packed.tobytes()
