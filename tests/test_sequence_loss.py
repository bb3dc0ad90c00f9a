"""Language-model losses and default parameters: cross-entropy on logits [batch, seq, vocab] against labels
[batch, seq] with padding ignored (values and gradients against float64 references, ONNX's [N, C, ...] meaning
unchanged), token accuracy and perplexity in evaluate, detection in `odtrain prepare`, and the default selection
leaving out position tables, single values and initializers no gradient reaches, saying why."""
import math

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from conftest import DATA, odtrain_main
from odtrain import artifacts
from odtrain.api import CheckpointState, Module
from odtrain.graph.errors import ArgumentError
from odtrain.graph.onnx_io import load_graph
from odtrain.graph.parameters import NO_GRADIENT, SHAPE_TABLE, SINGLE_VALUE, default_selection
from odtrain.training import evaluate
from oracles import as_float64, assert_gradients_match, make_model

VOCAB, WIDTH, BATCH, SEQ = 7, 4, 3, 5


def tiny_lm(seed=0):
    """Embedding then a projection to the vocabulary: logits [batch, seq, VOCAB] with a symbolic seq."""
    rng = np.random.default_rng(seed)
    params = {"embed": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
              "head": rng.standard_normal((WIDTH, VOCAB)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["h"]), helper.make_node("MatMul", ["h", "head"], ["logits"])]
    model = make_model(nodes, params, inputs=[("ids", np.int64, ["batch", "seq"])],
                       outputs=[("logits", np.float32, ["batch", "seq", VOCAB])])
    return model, params


def batch(seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    labels = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    labels[1, 3:] = -100  # padding
    labels[2, 4] = -100
    return ids, labels


def test_classes_last_loss_and_gradients_match_float64(tmp_path):
    model, params = tiny_lm()
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=artifacts.LossType.CrossEntropyLoss,
                                 class_axis=-1, ignore_index=-100, artifact_directory=tmp_path,
                                 additional_output_names=["logits"])
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    types = module.input_types(training=True)
    assert types["labels"].shape == ("batch", "seq")
    ids, labels = batch()
    loss, logits = module(ids, labels)

    log_probs = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    counted = labels != -100
    expected = -np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0][counted].mean()
    assert float(loss) == pytest.approx(expected, rel=1e-5)

    reference = ReferenceEvaluator(as_float64(onnx.load(str(tmp_path / "eval_model.onnx"))))

    def loss64(values):
        return float(reference.run(None, {"ids": ids, "labels": labels, **values})[0])

    assert_gradients_match(state, loss64, {k: v.astype(np.float64) for k, v in params.items()})


def test_onnx_meaning_stays_the_default(tmp_path):
    """Without class_axis the classes are axis 1, as in ONNX Runtime: labels [batch, VOCAB] for this output."""
    model, params = tiny_lm()
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
    assert module.input_types(training=True)["labels"].shape == ("batch", VOCAB)


@pytest.mark.parametrize("options, message", [
    ({"loss": artifacts.LossType.MSELoss, "class_axis": -1}, "apply to CrossEntropyLoss"),
    ({"loss": artifacts.LossType.CrossEntropyLoss, "class_axis": 2}, "class_axis must be 1"),
])
def test_loss_options_are_checked(tmp_path, options, message):
    model, params = tiny_lm()
    with pytest.raises(ArgumentError, match=message):
        artifacts.generate_artifacts(model, requires_grad=list(params), artifact_directory=tmp_path, **options)


def test_evaluate_gives_token_accuracy_and_perplexity_over_counted_labels(tmp_path):
    model, params = tiny_lm()
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=artifacts.LossType.CrossEntropyLoss,
                                 class_axis=-1, ignore_index=-100, artifact_directory=tmp_path,
                                 additional_output_names=["logits"], optimizer=artifacts.OptimType.SGD)
    ids, labels = batch()
    metrics = evaluate(tmp_path, {"ids": ids, "labels": labels}, batch_size=2)  # batches of unequal label counts
    logits = np.asarray(ReferenceEvaluator(model).run(None, {"ids": ids})[0], np.float64)
    counted = labels != -100
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0][counted]
    assert metrics["labels"] == counted.sum()
    assert metrics["loss"] == pytest.approx(nll.mean(), rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(((logits.argmax(-1) == labels) & counted).sum() / counted.sum())


def test_prepare_detects_classes_last_and_says_so(tmp_path, capsys):
    model, _ = tiny_lm()
    onnx.save(model, tmp_path / "lm.onnx")
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a")
    assert code == 0, err
    assert "classes on the last axis (detected: axis 1 ('seq') is symbolic" in out
    assert "labels equal to -100 are ignored" in out
    assert "labels int64[batch, seq]" in out
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "b", "--class-axis", "1")
    assert code == 0, err
    assert "classes on axis 1 (--class-axis)" in out and f"labels int64[batch, {VOCAB}]" in out
    code, _, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "c", "--loss", "mse",
                                "--ignore-index", "0")
    assert code == 2 and "apply to --loss ce" in err


def test_prepared_training_step_returns_the_loss_and_fuses_the_vocabulary_product(tmp_path, capsys):
    """`odtrain prepare` gives the eval model the logits (eval scores them, export writes them) and the training
    model the loss alone, so the training step fuses the vocabulary product with the loss: no [batch, seq, V]
    logits in its arena. Its losses are the eval model's on the same batch."""
    model, _ = tiny_lm()
    onnx.save(model, tmp_path / "lm.onnx")
    code, _, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a")
    assert code == 0, err
    training, evaluation = (onnx.load(tmp_path / "a" / f"{kind}_model.onnx") for kind in ("training", "eval"))
    assert [o.name for o in training.graph.output if not o.name.endswith("_grad")] == ["loss"]
    assert [o.name for o in evaluation.graph.output] == ["loss", "logits"]
    state = CheckpointState.load_checkpoint(str(tmp_path / "a" / "checkpoint"))
    module = Module(str(tmp_path / "a" / "training_model.onnx"), state, str(tmp_path / "a" / "eval_model.onnx"))
    ids, labels = batch()
    trained = float(module(ids, labels))
    (plan,) = module._train.plans.values()
    assert "LinearCrossEntropy" in {node.op_type for node in plan.plan.order}
    assert all(t.shape != (BATCH, SEQ, VOCAB) for t in plan.types.values())
    module.eval()
    loss, logits = module(ids, labels)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    np.testing.assert_allclose(trained, float(loss), rtol=1e-6)


def positional_model():
    """x [batch, seq, F] times a table of positions (Range over the input's shape) and inv_freq, then a weight;
    an epsilon as a one-element initializer; a float threshold that only feeds a comparison."""
    rng = np.random.default_rng(3)
    features = 4
    inits = {"inv_freq": np.array([1.0, 0.5, 0.25, 0.125], np.float32), "eps": np.array([1e-6], np.float32),
             "threshold": np.full((1, 1, features), 0.5, np.float32),
             "weight": rng.standard_normal((features, 3)).astype(np.float32),
             "zero": np.array(0, np.int64), "one": np.array(1, np.int64), "one_axis": np.array([1], np.int64),
             "axis_1": np.array([1], np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
             helper.make_node("Cast", ["positions"], ["positions_f"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["positions_f", "axis_1"], ["column"]),
             helper.make_node("Mul", ["column", "inv_freq"], ["angles"]),
             helper.make_node("Sigmoid", ["angles"], ["table"]),
             helper.make_node("Mul", ["x", "table"], ["mixed"]),
             helper.make_node("Add", ["mixed", "eps"], ["shifted"]),
             helper.make_node("Greater", ["x", "threshold"], ["big"]),
             helper.make_node("Where", ["big", "shifted", "x"], ["chosen"]),
             helper.make_node("MatMul", ["chosen", "weight"], ["y"])]
    return make_model(nodes, inits, inputs=[("x", np.float32, ["batch", "seq", features])],
                      outputs=[("y", np.float32, ["batch", "seq", 3])])


def test_default_selection_leaves_out_tables_single_values_and_what_no_gradient_reaches(tmp_path):
    model = positional_model()
    from odtrain.graph.onnx_io import graph_from_proto

    selection = default_selection(graph_from_proto(model, "model"))
    assert selection.trainable == ["threshold", "weight"]
    assert selection.left_out == {"inv_freq": SHAPE_TABLE, "eps": SINGLE_VALUE}
    result = artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    assert result.trainable == ["weight"]
    assert result.left_out == {"inv_freq": SHAPE_TABLE, "eps": SINGLE_VALUE, "threshold": NO_GRADIENT}
    assert list(CheckpointState.load_checkpoint(tmp_path / "checkpoint").parameters) == ["weight"]


def test_check_says_what_it_leaves_out_and_names_train_it(tmp_path, capsys):
    onnx.save(positional_model(), tmp_path / "m.onnx")
    code, out, err = odtrain_main(capsys, "check", tmp_path / "m.onnx", "--loss", "mse", "--requires-grad", "weight")
    assert code == 0, err
    assert f"left out: inv_freq: {SHAPE_TABLE}" in out and f"left out: eps: {SINGLE_VALUE}" in out
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "m.onnx", "-o", tmp_path / "a", "--loss", "mse",
                                  "--requires-grad", "weight", "inv_freq")
    assert code == 0, err
    assert "trainable: 16 values in 2 tensors (inv_freq, weight)" in out and "left out: inv_freq" not in out


def test_dynamo_export_leaves_out_rotary_inv_freq_only():
    graph = load_graph(DATA / "decoders" / "llama" / "dynamo18.onnx", "model")
    selection = default_selection(graph)
    assert selection.left_out == {"model.rotary_emb.inv_freq": SHAPE_TABLE}
    assert len(selection.trainable) == 21 and not selection.state


def _trained_once(directory, fused: bool, monkeypatch, outputs=(), trained=("embed", "head"), ignore_index=-100,
                  feeds=None):
    """(loss, gradients, the step's kernels, training op types) of one step of tiny_lm training `trained`, its
    vocabulary loss fused or not, on `feeds` (default: batch())."""
    from odtrain.graph import fusion

    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(fusion, "TRAINING_PASSES", tuple(p for p in fusion.TRAINING_PASSES
                                                           if p is not fusion.vocabulary_loss_pass))
        model, params = tiny_lm()
        artifacts.generate_artifacts(model, requires_grad=list(trained), loss=artifacts.LossType.CrossEntropyLoss,
                                     class_axis=-1, ignore_index=ignore_index, artifact_directory=directory,
                                     additional_output_names=list(outputs))
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    results = module(*(feeds or batch()))
    kernels = {getattr(k, "__name__", "") for plan in module._train.plans.values() for k, _ in plan.calls}
    return (float(results[0] if outputs else results), {k: state.parameters[k].grad.copy() for k in trained}, kernels,
            {n.op_type for n in module.graph(training=True).nodes})


@pytest.mark.parametrize("threads, trained", [(1, ("embed", "head")), (2, ("embed", "head")), (2, ("embed",))])
def test_fused_vocabulary_loss_in_chunks_and_parts_equals_the_unfused_one(threads, trained, tmp_path, monkeypatch):
    """LinearCrossEntropy a chunk of 4 of the 15 tokens at a time (the last chunk short), serial and split into
    parts of the vocabulary and of the chunk's rows, gives the unfused graph's loss and gradients: the hidden
    states' gradient made by the forward from its own logits, the head's by the backward forming them again;
    with the head frozen there is no backward op. A model that also outputs the logits keeps them."""
    import odtrain.threads as thread_policy
    from odtrain.kernels import parallel_split
    from odtrain.kernels import training as loss_kernels

    monkeypatch.setattr(loss_kernels, "CHUNK_MIN_ROWS", 4)
    monkeypatch.setattr(loss_kernels, "CHUNK_BYTES", 0)
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    thread_policy.set_num_threads(threads)
    try:
        loss, grads, kernels, ops = _trained_once(tmp_path / "fused", True, monkeypatch, trained=trained)
        reference, expected, _, reference_ops = _trained_once(tmp_path / "unfused", False, monkeypatch,
                                                              trained=trained)
        _, _, _, with_logits = _trained_once(tmp_path / "logits", True, monkeypatch, outputs=["logits"],
                                             trained=trained)
    finally:
        thread_policy._process_default = None
    assert "LinearCrossEntropy" in ops and "LinearCrossEntropy" not in reference_ops | with_logits
    assert ("LinearCrossEntropyGrad" in ops) == ("head" in trained)
    name = "_linear_cross_entropy" + ("_parts" if threads > 1 else "")
    assert name in kernels and (name.replace("entropy", "entropy_grad") in kernels) == ("head" in trained)
    assert loss == pytest.approx(reference, rel=1e-6)
    for key, value in expected.items():  # float32 sums in another order: measured 3e-8 of 0.27
        np.testing.assert_allclose(grads[key], value, rtol=0, atol=1e-6 * np.abs(value).max(), err_msg=key)


def test_the_fused_vocabulary_loss_ignores_padding_label_0(tmp_path, monkeypatch):
    """A padding id of 0 is common: with ignore_index=0 the fusion pass hands 0 to LinearCrossEntropy (a value
    that is falsy, not absent), so the fused step counts the same labels as the unfused one."""
    ids, labels = batch()
    labels[labels == -100] = 0  # the padding, now id 0
    assert (labels == 0).sum() >= 4 and (labels != 0).any()
    loss, grads, _, ops = _trained_once(tmp_path / "fused", True, monkeypatch, ignore_index=0, feeds=(ids, labels))
    reference, expected, _, _ = _trained_once(tmp_path / "unfused", False, monkeypatch, ignore_index=0,
                                              feeds=(ids, labels))
    assert "LinearCrossEntropy" in ops
    fused = [n for n in load_graph(str(tmp_path / "fused" / "training_model.onnx")).nodes
             if n.op_type == "LinearCrossEntropy"]
    assert fused and all(n.attrs.get("ignore_index") == 0 for n in fused)
    assert loss == pytest.approx(reference, rel=1e-6)
    for key, value in expected.items():
        np.testing.assert_allclose(grads[key], value, rtol=0, atol=1e-6 * np.abs(value).max(), err_msg=key)


def stored_head_lm(tied: bool):
    """tiny_lm with a trained layer between the embedding and the head; `tied`: the head is the embedding's
    transpose (a weight [V, H] read with transB), else its own [H, V] weight."""
    rng = np.random.default_rng(2)
    params = {"embed": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
              "w": (rng.standard_normal((WIDTH, WIDTH)) / 2).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["z"]),
             helper.make_node("Add", ["z", "h"], ["hidden"])]
    if tied:
        nodes += [helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["hidden", "embed_t"], ["logits"])]
    else:
        params["head"] = rng.standard_normal((WIDTH, VOCAB)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", ["hidden", "head"], ["logits"]))
    return make_model(nodes, params, inputs=[("ids", np.int64, ["batch", "seq"])],
                      outputs=[("logits", np.float32, ["batch", "seq", VOCAB])])


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_vocabulary_loss_reads_a_stored_head_as_the_unfused_product(kind, tied, threads, tmp_path, monkeypatch):
    """With the head stored as int8 or bfloat16 (frozen_dtype), the vocabulary loss still fuses: LinearCrossEntropy
    reads the stored weight a panel at a time (here panels of 8 floats and chunks of 4 tokens, serial and in
    parts) and gives the loss and the trained layer's gradient of the unfused DequantizedMatMul and loss."""
    import odtrain.threads as thread_policy
    from odtrain.graph import fusion
    from odtrain.kernels import parallel_split
    from odtrain.kernels import training as loss_kernels

    monkeypatch.setattr(loss_kernels, "CHUNK_MIN_ROWS", 4)
    monkeypatch.setattr(loss_kernels, "CHUNK_BYTES", 0)
    monkeypatch.setattr(loss_kernels, "PANEL_ELEMENTS", 8)
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    thread_policy.set_num_threads(threads)
    results = {}
    try:
        for fused in (True, False):
            with monkeypatch.context() as patch:
                if not fused:
                    patch.setattr(fusion, "TRAINING_PASSES", tuple(p for p in fusion.TRAINING_PASSES
                                                                   if p is not fusion.vocabulary_loss_pass))
                directory = tmp_path / str(fused)
                artifacts.generate_artifacts(stored_head_lm(tied), requires_grad=["w"],
                                             frozen_params=["embed"] if tied else ["embed", "head"],
                                             loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                             ignore_index=-100, artifact_directory=directory, frozen_dtype=kind)
            state = CheckpointState.load_checkpoint(directory / "checkpoint")
            module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
            loss = float(module(*batch()))
            (plan,) = module._train.plans.values()
            kernels = {getattr(k, "__name__", "") for k, _ in plan.calls}
            results[fused] = loss, state.parameters["w"].grad.copy(), plan, kernels
    finally:
        thread_policy._process_default = None
    loss, grad, plan, kernels = results[True]
    (node,) = [n for n in plan.plan.order if n.op_type == "LinearCrossEntropy"]
    assert plan.types[node.inputs[1]].dtype.name == kind and len(node.inputs) == (4 if kind == "int8" else 3)
    assert "_stored_linear_cross_entropy" + ("_parts" if threads > 1 else "") in kernels
    assert all(t.shape != (BATCH, SEQ, VOCAB) for t in plan.types.values())
    reference, expected, _, _ = results[False]
    assert loss == pytest.approx(reference, rel=1e-6)
    np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def _fused_loss_model(transposed: bool, ignore_index: int, loss_scale: float, rows: int, width: int, vocab: int,
                      seed: int = 3):
    """hidden = x · A (A trained), then ai.odtrain's LinearCrossEntropy(hidden, W, labels) (W trained, [V, H]
    with transB=1 or [H, V]) times `loss_scale`: the fused op's backward sees a dLoss other than 1. The last
    vocabulary column's weights are large: that column holds every row's largest logit, in the hundreds."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((width, width)) / 2).astype(np.float32)
    w = rng.standard_normal((vocab, width)).astype(np.float32)
    x = np.abs(rng.standard_normal((rows, width))).astype(np.float32) + 0.5
    w[-1] = 60.0 * np.sign(np.abs(x).mean(axis=0) @ a + 1e-3)  # the last column's logit: the largest, ~hundreds
    weight = w if transposed else np.ascontiguousarray(w.T)
    nodes = [helper.make_node("MatMul", ["x", "a"], ["hidden"]),
             helper.make_node("LinearCrossEntropy", ["hidden", "w", "labels"], ["unscaled"], domain="ai.odtrain",
                              transB=int(transposed), reduction="mean", ignore_index=ignore_index),
             helper.make_node("Mul", ["unscaled", "scale"], ["loss"])]
    model = make_model(nodes, {"a": a, "w": weight, "scale": np.array(loss_scale, np.float32)},
                       inputs=[("x", np.float32, [rows, width]), ("labels", np.int64, [rows])],
                       outputs=[("loss", np.float32, [])])
    model.opset_import.append(helper.make_opsetid("ai.odtrain", 1))
    return model, x, a, w


def _fused_loss_reference(x, a, w, labels, ignore_index, loss_scale):
    """(loss, dA, dW [V, H]) in float64."""
    x, a, w = (v.astype(np.float64) for v in (x, a, w))
    hidden = x @ a
    logits = hidden @ w.T
    shifted = logits - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    counted = labels != ignore_index
    count = counted.sum()
    rows = np.arange(len(labels))
    losses = -np.log(probabilities[rows, np.where(counted, labels, 0)])
    loss = loss_scale * losses[counted].sum() / count
    dlogits = probabilities.copy()
    dlogits[rows[counted], labels[counted]] -= 1
    dlogits[~counted] = 0
    dlogits *= loss_scale / count
    return loss, x.T @ (dlogits @ w), dlogits.T @ hidden


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("transposed", [True, False])
def test_fused_vocabulary_loss_against_float64_at_large_last_column_logits_ignore_index_0_and_a_scaled_loss(
        threads, transposed, tmp_path, monkeypatch):
    """LinearCrossEntropy on its own against float64: every row's largest logit (in the hundreds) in the last
    vocabulary column (a row maximum that misses a column overflows exp to inf), labels 0 ignored
    (`ignore_index=0`: a value that is falsy), the loss scaled by 0.37 after the op (a dLoss other than 1 reaches
    both gradients). In chunks of 4 rows, serial and in parts of the vocabulary and the rows."""
    import odtrain.threads as thread_policy
    from odtrain.kernels import parallel_split
    from odtrain.kernels import training as loss_kernels

    monkeypatch.setattr(loss_kernels, "CHUNK_MIN_ROWS", 4)
    monkeypatch.setattr(loss_kernels, "CHUNK_BYTES", 0)
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    rows, width, vocab, scale = 11, 6, 9, 0.37
    model, x, a, w = _fused_loss_model(transposed, 0, scale, rows, width, vocab)
    labels = np.random.default_rng(5).integers(1, vocab, rows).astype(np.int64)
    labels[[1, 4, 5]] = 0  # ignored
    labels[[2, 7]] = vocab - 1  # the largest logit's own class
    artifacts.generate_artifacts(model, requires_grad=["a", "w"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    thread_policy.set_num_threads(threads)
    try:
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state)
        loss = float(module(x, labels))
    finally:
        thread_policy._process_default = None
    expected, grad_a, grad_w = _fused_loss_reference(x, a, w, labels, 0, scale)
    assert np.isfinite(loss) and loss == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(state.parameters["a"].grad, grad_a, rtol=1e-4, atol=1e-5 * np.abs(grad_a).max())
    grad = state.parameters["w"].grad if transposed else state.parameters["w"].grad.T
    np.testing.assert_allclose(grad, grad_w, rtol=1e-4, atol=1e-5 * np.abs(grad_w).max())
