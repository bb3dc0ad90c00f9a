"""Text and sequence models train: the PyTorch-exported transformer along its golden losses, recurrent
layers with sequence lengths against their references, and small models built with onnx.helper (GRU and
bidirectional LSTM next-token predictors, an attention keyword spotter, a padded-sequence encoder at
opsets 14 and 18, causal attention as scaled_dot_product_attention exports it) that learn synthetic tasks
and export inference models that onnxruntime runs with the same outputs. Their steps allocate nothing.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from conftest import reference_model
from oracles import LEARNING_RATE_RATIO_TOLERANCE, gradient_check, learning_rate_ratio, numeric_gradient
from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.inference import InferenceSession

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")

INT64, FLOAT = TensorProto.INT64, TensorProto.FLOAT


def node(op, inputs, outputs, **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def build(nodes, initializers: dict, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, "text", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), name=k) for k, v in initializers.items()])
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model)
    return model


def train(model, directory, batches, lr=1e-2, loss=artifacts.LossType.CrossEntropyLoss, extra_outputs=("output",),
          loss_input_names=None):
    """Generate AdamW artifacts, train on `batches` (tuples of feeds), return (module, losses)."""
    params = [t.name for t in model.graph.initializer if t.data_type == FLOAT and t.dims]
    artifacts.generate_artifacts(model, requires_grad=params, loss=loss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory, additional_output_names=list(extra_outputs),
                                 loss_input_names=loss_input_names)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    opt.set_learning_rate(lr)
    losses = []
    for feeds in batches:
        result = module(*feeds)
        losses.append(float(result[0] if isinstance(result, list) else result))
        opt.step()
        module.lazy_reset_grad()
    return module, losses


def assert_exports_like_onnxruntime(module, directory, feeds: dict, output="output"):
    """The exported inference model runs in onnxruntime (and odtrain's own InferenceSession) alike."""
    path = directory / "inference.onnx"
    module.export_model_for_inferencing(path, [output])
    exported = onnx.load(str(path))
    onnx.checker.check_model(exported)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    (ours,) = InferenceSession(path).run(None, feeds)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    return ours


# ---- the PyTorch-exported transformer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def transformer():
    return reference_model("transformer")


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_transformer_matches_golden_losses(optimizer, threads, transformer, tmp_path):
    path, meta, golden = transformer
    kind = artifacts.OptimType.SGD if optimizer == "sgd" else artifacts.OptimType.AdamW
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=kind, artifact_directory=tmp_path,
                                 additional_output_names=["output"])
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx", num_threads=threads)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    opt.set_learning_rate(meta[optimizer]["lr"])
    losses = []
    before = {n: state.parameters[n].data.astype(np.float64) for n in meta["requires_grad"]}
    for step in range(meta["steps"]):
        loss, _ = module(golden["x"][step], golden["y"][step])
        losses.append(float(loss))
        if step == 0:
            grads = {name: state.parameters[name].grad for name in meta["requires_grad"]}
        opt.step()
        module.lazy_reset_grad()
        if step == 0:  # the losses of SGD move less under a 1% learning-rate error than float32 spreads them
            ratio = learning_rate_ratio(before, {n: state.parameters[n].data for n in before}, optimizer,
                                        meta[optimizer], golden)
    np.testing.assert_allclose(losses, golden[f"{optimizer}_losses"], rtol=1e-4)
    assert abs(ratio - 1) < LEARNING_RATE_RATIO_TOLERANCE, ratio
    # step-0 gradients against float64, as models/README.md measures them
    total = np.sqrt(sum(np.sum(golden[f"grad64/{n}"] ** 2) for n in meta["requires_grad"]))
    for name, g in grads.items():
        expected = golden[f"grad64/{name}"]
        error = np.linalg.norm(g - expected) / max(np.linalg.norm(expected), 1e-4 * total)
        assert error < 1e-4, (name, error)
    if optimizer == "adamw":
        module.eval()
        x = golden["x"][3]
        _, logits = module(x, golden["y"][3])
        ours = assert_exports_like_onnxruntime(module, tmp_path, {"input": x})
        np.testing.assert_allclose(ours, logits, rtol=1e-4, atol=1e-5)
        small = assert_exports_like_onnxruntime(module, tmp_path, {"input": x[:5]})  # the batch axis stays symbolic
        np.testing.assert_allclose(small, logits[:5], rtol=1e-4, atol=1e-5)


# ---- recurrent layers with sequence lengths ------------------------------------------------------------


def _recurrent_model(kind, direction, layout, lens, steps=4, batch=3, features=2, hidden=3, seed=0, lbr=1):
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = 3 if kind == "GRU" else 4
    params = {"W": rng.uniform(-1, 1, (dirs, gates * hidden, features)), "R": rng.uniform(-1, 1, (dirs, gates * hidden, hidden)),
              "B": rng.uniform(-1, 1, (dirs, 2 * gates * hidden))}
    state = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    params["h0"] = rng.uniform(-1, 1, state)
    names = ["X", "W", "R", "B", "lens", "h0"]
    outputs = ["Y", "Yh"]
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout}
    if kind == "GRU":
        attrs["linear_before_reset"] = lbr
    else:
        params["c0"] = rng.uniform(-1, 1, state)
        params["P"] = rng.uniform(-1, 1, (dirs, 3 * hidden))
        names += ["c0", "P"]
        outputs.append("Yc")
    params = {k: v.astype(np.float32) for k, v in params.items()}
    x_shape = (steps, batch, features) if layout == 0 else (batch, steps, features)
    x = rng.uniform(-1, 1, x_shape).astype(np.float32)
    y_shape = (steps, dirs, batch, hidden) if layout == 0 else (batch, steps, dirs, hidden)
    shapes = [y_shape, state, state]
    model = build([node(kind, names, outputs, **attrs)], {**params, "lens": np.asarray(lens, np.int32)},
                  [("X", FLOAT, list(x_shape))], [(o, FLOAT, list(s)) for o, s in zip(outputs, shapes)])
    return model, x, params


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_recurrent_sequence_lengths_match_onnxruntime(kind, direction):
    layout = 0  # onnxruntime runs batch-first (layout 1) recurrent layers only on CUDA
    model, x, _ = _recurrent_model(kind, direction, layout, lens=[4, 2, 1])
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})
    got = InferenceSession(model).run(None, {"X": x})
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


class PerSampleReference:
    """Σ weights·outputs in float64, each sample run alone on its own length by ONNX's reference GRU/LSTM
    (which ignores sequence_lens)."""

    def __init__(self, kind, model, lens, layout, weights):
        attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
        attrs["layout"] = 0
        self.kind, self.lens, self.layout, self.weights = kind, lens, layout, weights
        self.names = ["X", "W", "R", "B", "", "h0"] + (["c0", "P"] if kind == "LSTM" else [])
        outputs = ["Y", "Yh"] + (["Yc"] if kind == "LSTM" else [])
        graph = helper.make_graph([node(kind, self.names, outputs, **attrs)], "single",
                                  [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in self.names if n],
                                  [helper.make_tensor_value_info(o, TensorProto.DOUBLE, None) for o in outputs])
        self.evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))

    def __call__(self, values):
        total, layout = 0.0, self.layout
        for n, length in enumerate(self.lens):
            x = values["X"]
            feeds = {k: v for k, v in values.items() if k in self.names}
            feeds["X"] = (x[:, n] if layout == 0 else x[n])[:length][:, None]
            for k in ("h0", "c0"):
                if k in feeds:
                    feeds[k] = feeds[k][:, n:n + 1] if layout == 0 else np.swapaxes(feeds[k][n:n + 1], 0, 1)
            result = self.evaluator.run(None, feeds)
            wy = self.weights[0][:length, :, n] if layout == 0 else self.weights[0][n, :length]
            total += float(np.sum(result[0][:, :, 0] * wy))
            for r, w in zip(result[1:], self.weights[1:]):
                total += float(np.sum(r[:, 0] * (w[:, n] if layout == 0 else w[n])))
        return total


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("direction,layout", [("forward", 0), ("bidirectional", 1)])
def test_recurrent_gradients_with_sequence_lengths(kind, direction, layout, tmp_path):
    """Backpropagation through time with ragged lengths, against float64 finite differences of the
    per-sample reference (ONNX's reference evaluator ignores sequence_lens, so each sample runs alone)."""
    lens = [3, 1, 4]
    model, x, params = _recurrent_model(kind, direction, layout, lens=lens)
    rng = np.random.default_rng(1)
    outputs = [o.name for o in model.graph.output]
    shapes = [np.asarray(r).shape for r in InferenceSession(model).run(None, {"X": x})]
    weights = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    # the training model: loss = Σ weights·outputs, every parameter and X trained
    nodes = list(model.graph.node)
    terms = []
    for o, w in zip(outputs, weights):
        nodes += [node("Mul", [o, f"{o}_w"], [f"{o}_m"]), node("ReduceSum", [f"{o}_m"], [f"{o}_s"], keepdims=0)]
        terms.append(f"{o}_s")
    nodes.append(node("Sum", terms, ["loss"]))
    inits = {**params, "X": x, "lens": np.asarray(lens, np.int32), **{f"{o}_w": w for o, w in zip(outputs, weights)}}
    loss_model = build(nodes, inits, [], [("loss", FLOAT, [])])
    trained = ["X"] + list(params)
    artifacts.generate_artifacts(loss_model, requires_grad=trained, loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    Module(tmp_path / "training_model.onnx", state)()
    values64 = {k: v.astype(np.float64) for k, v in inits.items() if k in trained}
    loss64 = PerSampleReference(kind, model, lens, layout, [w.astype(np.float64) for w in weights])

    for name in trained:
        numeric = numeric_gradient(loss64, values64, name)
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(state.parameters[name].grad, numeric, rtol=2e-3, atol=2e-3 * scale,
                                   err_msg=f"gradient of {name}")


def test_cast_passes_gradients_between_float_types(tmp_path):
    """x → Cast(double) · w → Cast(float) → sum: d/dx = w, computed through float64 kernels."""
    w = np.array([0.5, -2.0, 3.0])
    nodes = [node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE), node("Mul", ["x64", "w"], ["m"]),
             node("Cast", ["m"], ["m32"], to=FLOAT), node("ReduceSum", ["m32"], ["loss"], keepdims=0)]
    model = build(nodes, {"x": np.ones(3, np.float32), "w": w}, [], [("loss", FLOAT, [])])
    artifacts.generate_artifacts(model, requires_grad=["x"], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert float(Module(tmp_path / "training_model.onnx", state)()) == pytest.approx(1.5)
    np.testing.assert_allclose(state.parameters["x"].grad, w.astype(np.float32))


# ---- small models that learn -------------------------------------------------------------------------


def recurrent_predictor(kind="GRU", direction="forward", vocab=8, embed=8, hidden=16, seed=0):
    """tokens [batch, seq] → embedding → GRU or LSTM (as PyTorch exports a batch-first layer: transposed
    to [seq, batch, ...], directions merged by Transpose + Reshape; GRU with linear_before_reset=1) →
    logits [batch, vocab, seq], for CrossEntropyLoss over every position."""
    rng = np.random.default_rng(seed)
    init = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    dirs = 2 if direction == "bidirectional" else 1
    gates = 3 if kind == "GRU" else 4
    params = {"emb": init(vocab, embed), "W": init(dirs, gates * hidden, embed),
              "R": init(dirs, gates * hidden, hidden), "B": np.zeros((dirs, 2 * gates * hidden), np.float32),
              "head": init(dirs * hidden, vocab), "head_b": np.zeros(vocab, np.float32),
              "merged": np.array([0, 0, -1], np.int64)}
    attrs = {"hidden_size": hidden, "direction": direction}
    if kind == "GRU":
        attrs["linear_before_reset"] = 1
    nodes = [node("Gather", ["emb", "tokens"], ["e"]), node("Transpose", ["e"], ["e_t"], perm=[1, 0, 2]),
             node(kind, ["e_t", "W", "R", "B"], ["Y", ""], **attrs),  # Y [seq, dirs, batch, hidden]
             node("Transpose", ["Y"], ["Y_t"], perm=[0, 2, 1, 3]),
             node("Reshape", ["Y_t", "merged"], ["h_t"]),  # [seq, batch, dirs·hidden]
             node("Transpose", ["h_t"], ["h"], perm=[1, 0, 2]),
             node("MatMul", ["h", "head"], ["l"]), node("Add", ["l", "head_b"], ["lb"]),
             node("Transpose", ["lb"], ["output"], perm=[0, 2, 1])]
    return build(nodes, params, [("tokens", INT64, ["batch", "seq"])], [("output", FLOAT, ["batch", vocab, "seq"])])


def gru_predictor():
    return recurrent_predictor("GRU")


@pytest.mark.parametrize("kind,direction", [("GRU", "forward"), ("LSTM", "bidirectional")])
def test_recurrent_predictor_learns_to_repeat_the_previous_token(kind, direction, tmp_path):
    """Next-token targets that need memory: the label at t is the token at t-1. Sequences change length."""
    rng = np.random.default_rng(0)
    batches = []
    for step in range(80):
        seq = 8 if step % 2 else 11
        tokens = rng.integers(1, 8, (16, seq))
        labels = np.concatenate([np.zeros((16, 1), np.int64), tokens[:, :-1]], axis=1)
        batches.append((tokens, labels))
    module, losses = train(recurrent_predictor(kind, direction), tmp_path, batches, lr=2e-2)
    assert np.mean(losses[-6:]) < 0.35 * np.mean(losses[:4]), losses
    tokens = rng.integers(1, 8, (5, 9))
    assert_exports_like_onnxruntime(module, tmp_path, {"tokens": tokens})


def keyword_spotter(frames=8, hidden=24, classes=4, seed=0):
    """Conv-free keyword spotter: stacked neighbouring frames (Slice + Concat), MatMul + Gelu, LayerNorm,
    attention pooling over time (Softmax along the sequence), and a Gemm head. Batch and length symbolic."""
    rng = np.random.default_rng(seed)
    init = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    params = {"w1": init(3 * frames, hidden), "b1": np.zeros(hidden, np.float32), "ln_s": np.ones(hidden, np.float32),
              "ln_b": np.zeros(hidden, np.float32), "query": init(hidden, 1), "head": init(classes, hidden),
              "head_b": np.zeros(classes, np.float32),
              "s0": i64(0), "s1": i64(1), "s2": i64(2), "e0": i64(-2), "e1": i64(-1), "e2": i64(2 ** 62), "ax": i64(1),
              "zero": np.array(0, np.int64), "axis0": i64(0), "minus1": i64(-1)}
    nodes = [node("Slice", ["x", "s0", "e0", "ax"], ["x0"]), node("Slice", ["x", "s1", "e1", "ax"], ["x1"]),
             node("Slice", ["x", "s2", "e2", "ax"], ["x2"]), node("Concat", ["x0", "x1", "x2"], ["ctx"], axis=2),
             node("MatMul", ["ctx", "w1"], ["h0"]), node("Add", ["h0", "b1"], ["h1"]),
             node("Gelu", ["h1"], ["h2"]),
             node("LayerNormalization", ["h2", "ln_s", "ln_b"], ["h"], axis=-1),
             node("MatMul", ["h", "query"], ["scores"]),  # [batch, T, 1]
             node("Transpose", ["scores"], ["scores_t"], perm=[0, 2, 1]),
             node("Softmax", ["scores_t"], ["attention"], axis=-1),
             node("MatMul", ["attention", "h"], ["pooled3"]),  # [batch, 1, hidden]
             node("Shape", ["x"], ["shape"]), node("Gather", ["shape", "zero"], ["batch"], axis=0),
             node("Unsqueeze", ["batch", "axis0"], ["batch1"]),
             node("Concat", ["batch1", "minus1"], ["flat_shape"], axis=0),
             node("Reshape", ["pooled3", "flat_shape"], ["pooled"]),
             node("Gemm", ["pooled", "head", "head_b"], ["output"], transB=1)]
    return build(nodes, params, [("x", FLOAT, ["batch", "time", frames])], [("output", FLOAT, ["batch", classes])],
                 opset=20)


def spotting_batch(rng, templates, batch=32, time=20):
    labels = rng.integers(0, len(templates) + 1, batch)
    x = rng.standard_normal((batch, time, templates.shape[2])).astype(np.float32) * 0.5
    for n, label in enumerate(labels):
        if label < len(templates):
            start = rng.integers(0, time - 3)
            x[n, start:start + 3] += templates[label]
    return x, labels.astype(np.int64)


def test_keyword_spotter_learns(tmp_path):
    rng = np.random.default_rng(0)
    templates = rng.standard_normal((3, 3, 8)).astype(np.float32) * 1.5
    batches = [spotting_batch(rng, templates, time=20 if step % 3 else 16) for step in range(70)]
    module, losses = train(keyword_spotter(), tmp_path, batches, lr=1e-2)
    assert np.mean(losses[-8:]) < 0.4 * np.mean(losses[:4]), losses
    module.eval()
    x, labels = spotting_batch(rng, templates, batch=64)
    _, logits = module(x, labels)
    assert np.mean(np.argmax(logits, axis=1) == labels) > 0.8
    ours = assert_exports_like_onnxruntime(module, tmp_path, {"x": x})
    np.testing.assert_allclose(ours, logits, rtol=1e-4, atol=1e-4)


def _layer_norm_nodes(x, scale, bias, out, opset):
    """LayerNormalization from opset 17; before it, PyTorch's decomposition (ReduceMean axes attribute)."""
    if opset >= 17:
        return [node("LayerNormalization", [x, scale, bias], [out], axis=-1, epsilon=1e-5)]
    return [node("ReduceMean", [x], [f"{out}_mean"], axes=[-1]), node("Sub", [x, f"{out}_mean"], [f"{out}_c"]),
            node("Pow", [f"{out}_c", "two"], [f"{out}_sq"]), node("ReduceMean", [f"{out}_sq"], [f"{out}_var"], axes=[-1]),
            node("Add", [f"{out}_var", "ln_eps"], [f"{out}_ve"]), node("Sqrt", [f"{out}_ve"], [f"{out}_std"]),
            node("Div", [f"{out}_c", f"{out}_std"], [f"{out}_n"]), node("Mul", [f"{out}_n", scale], [f"{out}_s"]),
            node("Add", [f"{out}_s", bias], [out])]


def padded_encoder(vocab=12, width=16, classes=2, pad=0, seed=0, opset=18):
    """One attention layer over padded token sequences, as PyTorch exports it at opset 14 to 18: positions
    from Shape → Gather → Range, a key-padding mask from Equal → Where, LayerNormalization (decomposed
    before opset 17), ReduceMean with its axes as an attribute (an input from opset 18), an RMS norm from
    Pow/ReduceMean/Sqrt/Div, Erf GELU, and a masked count. The model returns its own loss
    (SoftmaxCrossEntropyLoss) with labels padded by ignore_index."""
    rng = np.random.default_rng(seed)
    init = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    params = {"emb": init(vocab, width), "pos": init(32, width) * 0.1, "wq": init(width, width), "wk": init(width, width),
              "wv": init(width, width), "ln_s": np.ones(width, np.float32), "ln_b": np.zeros(width, np.float32),
              "ff1": init(width, 2 * width), "ff2": init(2 * width, width), "rms_s": np.ones(width, np.float32),
              "tag": init(width, classes), "tag_b": np.zeros(classes, np.float32),
              "pad": np.array(pad, np.int64), "one_i": np.array(1, np.int64), "zero_i": np.array(0, np.int64),
              "axis1": i64(1), "axis_last": i64(-1),
              "neg": f32(-1e4), "zero_f": f32(0.0), "scale": f32(width ** -0.5), "two": f32(2.0), "eps": f32(1e-6),
              "root2": f32(np.sqrt(2.0)), "one_f": f32(1.0), "half": f32(0.5), "ln_eps": f32(1e-5)}
    nodes = [
        node("Shape", ["tokens"], ["shape"]), node("Gather", ["shape", "one_i"], ["seq"], axis=0),
        node("Range", ["zero_i", "seq", "one_i"], ["positions"]),
        node("Gather", ["emb", "tokens"], ["e"]), node("Gather", ["pos", "positions"], ["p"]),
        node("Add", ["e", "p"], ["x"]),
        node("Equal", ["tokens", "pad"], ["is_pad"]),  # [batch, seq]
        node("Unsqueeze", ["is_pad", "axis1"], ["is_pad3"]),  # [batch, 1, seq]
        node("Where", ["is_pad3", "neg", "zero_f"], ["bias"]),
        node("MatMul", ["x", "wq"], ["q"]), node("MatMul", ["x", "wk"], ["k"]), node("MatMul", ["x", "wv"], ["v"]),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["s"]),
        node("Mul", ["s", "scale"], ["ss"]), node("Add", ["ss", "bias"], ["sb"]),
        node("Softmax", ["sb"], ["a"], axis=-1), node("MatMul", ["a", "v"], ["att"]),
        node("Add", ["x", "att"], ["r1"]),
        *_layer_norm_nodes("r1", "ln_s", "ln_b", "n1", opset),
        node("MatMul", ["n1", "ff1"], ["f1"]), node("Div", ["f1", "root2"], ["f2"]), node("Erf", ["f2"], ["f3"]),
        node("Add", ["f3", "one_f"], ["f4"]), node("Mul", ["f1", "f4"], ["f5"]), node("Mul", ["f5", "half"], ["f6"]),
        node("MatMul", ["f6", "ff2"], ["f7"]), node("Add", ["n1", "f7"], ["r2"]),
        node("Pow", ["r2", "two"], ["sq"]),
        node("ReduceMean", ["sq", "axis_last"], ["ms"], keepdims=1) if opset >= 18 else
        node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        node("Add", ["ms", "eps"], ["ms_eps"]), node("Sqrt", ["ms_eps"], ["rms"]), node("Div", ["r2", "rms"], ["n2"]),
        node("Mul", ["n2", "rms_s"], ["h"]),  # [batch, seq, width]
        node("MatMul", ["h", "tag"], ["t1"]), node("Add", ["t1", "tag_b"], ["t2"]),
        node("Transpose", ["t2"], ["output"], perm=[0, 2, 1]),  # [batch, classes, seq]
        node("SoftmaxCrossEntropyLoss", ["output", "labels"], ["loss"], ignore_index=-100, reduction="mean"),
        node("Not", ["is_pad"], ["real"]), node("Cast", ["real"], ["real_f"], to=FLOAT),
        node("ReduceSum", ["real_f", "axis1"], ["count"], keepdims=0),
    ]
    return build(nodes, params, [("tokens", INT64, ["batch", "seq"]), ("labels", INT64, ["batch", "seq"])],
                 [("loss", FLOAT, []), ("output", FLOAT, ["batch", classes, "seq"]), ("count", FLOAT, ["batch"])],
                 opset=opset)


def encoder_batch(rng, batch=16, pad=0, marker=5):
    """Token tagging on padded sequences: a token is class 1 if the marker appears before it. Padding
    positions are labelled -100 (ignored)."""
    seq = int(rng.integers(6, 12))
    lengths = rng.integers(3, seq + 1, batch)
    tokens = rng.integers(1, 12, (batch, seq))
    labels = np.zeros((batch, seq), np.int64)
    for n, length in enumerate(lengths):
        tokens[n, length:] = pad
        seen = np.cumsum(tokens[n] == marker) > 0
        labels[n] = np.where(np.arange(seq) < length, seen.astype(np.int64), -100)
    return tokens, labels


@pytest.mark.parametrize("opset", [14, 18])
def test_padded_encoder_learns_and_matches_the_reference(opset, tmp_path):
    rng = np.random.default_rng(0)
    model = padded_encoder(opset=opset)
    tokens, labels = encoder_batch(rng)
    expected = ReferenceEvaluator(model).run(None, {"tokens": tokens, "labels": labels})
    got = InferenceSession(model).run(None, {"tokens": tokens, "labels": labels})
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    batches = [encoder_batch(rng) for _ in range(70)]
    module, losses = train(model, tmp_path, batches, lr=1e-2, loss=None, extra_outputs=["output"],
                           loss_input_names=["loss"])
    assert np.mean(losses[-6:]) < 0.5 * np.mean(losses[:4]), losses
    tokens, labels = encoder_batch(rng)
    assert_exports_like_onnxruntime(module, tmp_path, {"tokens": tokens})


def test_causal_attention_as_scaled_dot_product_attention_exports_it(tmp_path):
    """F.scaled_dot_product_attention(is_causal=True) as exported: the scale from Shape → Slice → Cast(Like) →
    Sqrt → Div (folded once shapes are bound), √scale applied to q and k, a causal mask from
    ConstantOfShape → Trilu → Equal → Where, gradients through all of it."""
    rng = np.random.default_rng(3)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [node("Shape", ["q"], ["shape"]), node("Slice", ["shape", "minus1", "end"], ["last"]),
             node("CastLike", ["last", "q"], ["last_f"]), node("Sqrt", ["last_f"], ["root"]),
             node("Div", ["one", "root"], ["scale"]), node("Sqrt", ["scale"], ["root_scale"]),
             node("Mul", ["q", "root_scale"], ["qs"]), node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             node("Mul", ["kt", "root_scale"], ["ks"]), node("MatMul", ["qs", "ks"], ["s"]),
             node("Shape", ["s"], ["s_shape"]), node("Slice", ["s_shape", "minus2", "end"], ["square"]),
             node("ConstantOfShape", ["square"], ["ones"], value=helper.make_tensor("v", INT64, [1], [1])),
             node("Trilu", ["ones"], ["lower"], upper=0), node("Equal", ["lower", "zero"], ["future"]),
             node("Where", ["future", "neg_inf", "s"], ["masked"]), node("Softmax", ["masked"], ["p"], axis=-1),
             node("MatMul", ["p", "v"], ["y"])]
    params = {n: rng.uniform(-1, 1, (2, 2, 4, 3)).astype(np.float32) for n in ("q", "k", "v")}
    constants = {"minus1": i64(-1), "minus2": i64(-2), "end": i64(2 ** 62), "one": np.array(1.0, np.float32),
                 "zero": np.array(0, np.int64), "neg_inf": np.array(-np.inf, np.float32)}
    gradient_check(nodes, params, constants=constants, tmp_path=tmp_path)


def test_transformer_and_gru_steps_allocate_nothing(transformer, tmp_path):
    """Every kernel of a transformer and a GRU training step, counted by Numba's runtime (NUMBA_NRT_STATS=1)
    in a fresh process: passing an array registers it once; a kernel's own allocation would add to that."""
    import os
    import subprocess
    import sys
    import textwrap

    path, meta, golden = transformer
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "transformer")
    artifacts.generate_artifacts(gru_predictor(), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "gru")
    tokens = np.random.default_rng(0).integers(1, 8, (4, 6))
    np.savez(tmp_path / "feeds.npz", x=golden["x"][0], y=golden["y"][0], tokens=tokens, next=np.roll(tokens, -1, 1))
    script = textwrap.dedent(f"""
        import numpy as np
        from numba.core.runtime import rtsys
        from odtrain.api import CheckpointState, Module, Optimizer
        feeds = np.load({str(tmp_path / "feeds.npz")!r})
        for name, inputs in (("transformer", (feeds["x"], feeds["y"])), ("gru", (feeds["tokens"], feeds["next"]))):
            d = {str(tmp_path)!r} + "/" + name
            state = CheckpointState.load_checkpoint(d + "/checkpoint")
            module = Module(d + "/training_model.onnx", state)
            optimizer = Optimizer(d + "/optimizer_model.onnx", module)
            for _ in range(2):
                module(*inputs); optimizer.step(); module.lazy_reset_grad()
            bound = next(iter(module._train.plans.values()))
            for view, value in zip(bound.feed_views, inputs):
                view[...] = value
            extra = []
            for kernel, args in bound.calls:
                before = rtsys.get_allocation_stats().alloc
                kernel(*args)
                arrays = sum(isinstance(a, np.ndarray) for a in args)
                extra.append(rtsys.get_allocation_stats().alloc - before - arrays)
            print(len(extra), max(extra), min(extra))
    """)
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.split("\n")[:2]:
        calls, most, least = (int(v) for v in line.split())
        assert calls > 10 and most == 0 and least == 0, result.stdout
