"""LoRA adapters: gradients against float64 finite differences, frozen weights, export merged into the weights
(onnxruntime agrees with the training model), errors that name the weight, and federated rounds that exchange
the adapters alone."""
import os

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from odtrain import artifacts, federated as fl
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.errors import ArgumentError, ModelError
from odtrain.graph.lora_init import lora_a
from oracles import as_float64, assert_gradients_match, make_model

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")
rng = np.random.default_rng(5)
VOCAB, WIDTH, CLASSES, FEATURES = 11, 6, 3, 5


def tiny_lm():
    """ids -> embedding -> MatMul(h, Transpose(q)) (an exported nn.Linear) -> Relu -> scaled by g -> logits."""
    params = {"embed": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
              "q.weight": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 2,
              "g": np.ones(WIDTH, np.float32),
              "head.weight": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32) / 2}
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["h"]),
             helper.make_node("Transpose", ["q.weight"], ["qt"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "qt"], ["q"]), helper.make_node("Relu", ["q"], ["r"]),
             helper.make_node("Mul", ["r", "g"], ["s"]),
             helper.make_node("Transpose", ["head.weight"], ["ht"], perm=[1, 0]),
             helper.make_node("MatMul", ["s", "ht"], ["logits"])]
    return make_model(nodes, params, inputs=[("ids", np.int64, ["batch", "seq"])],
                      outputs=[("logits", np.float32, ["batch", "seq", VOCAB])]), params


def classifier():
    """Gemm with transB=1 (as torch exports Linear with constant folding) then Gemm with transB=0."""
    params = {"fc1.weight": rng.standard_normal((8, FEATURES)).astype(np.float32) / 2,
              "fc1.bias": np.zeros(8, np.float32),
              "fc2.weight": rng.standard_normal((8, CLASSES)).astype(np.float32) / 2,
              "fc2.bias": np.zeros(CLASSES, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["a"], transB=1),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["logits"])]
    return make_model(nodes, params, inputs=[("x", np.float32, ["batch", FEATURES])],
                      outputs=[("logits", np.float32, ["batch", CLASSES])]), params


def lm_batch(batch=3, seq=4):
    return (rng.integers(0, VOCAB, (batch, seq)).astype(np.int64), rng.integers(0, VOCAB, (batch, seq)).astype(np.int64))


def classifier_batch(batch=16):
    x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    return x, (x[:, :CLASSES].argmax(axis=1)).astype(np.int64)


CASES = {
    "lm": (tiny_lm, lm_batch, ["*.weight"], ["g"], {"class_axis": -1}, ["ids", "labels"]),
    "classifier": (classifier, classifier_batch, ["fc1.weight", "fc2.weight"], [], {}, ["x", "labels"]),
}


def prepared(case, tmp_path, rank=2, alpha=4.0):
    build, batch, targets, extra, options, feeds = CASES[case]
    model, params = build()
    result = artifacts.generate_artifacts(model, requires_grad=extra or None, loss=artifacts.LossType.CrossEntropyLoss,
                                          optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path,
                                          additional_output_names=["logits"],
                                          lora=artifacts.LoraConfig(rank, alpha, targets, seed=3), **options)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    return model, params, result, state, module, batch, feeds


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapters_train_alone_and_their_gradients_match_float64(case, tmp_path):
    model, params, result, state, module, batch, feed_names = prepared(case, tmp_path)
    weights = [n for n in params if n.endswith("weight") and n != "embed"]
    adapters = [f"{w}.lora_{m}" for w in weights for m in "AB"]
    assert sorted(result.trainable) == sorted(adapters + CASES[case][3])
    assert set(result.frozen) == set(params) - set(CASES[case][3])
    for w in weights:  # A as graph/lora_init.py draws it, B zero
        in_features = params[w].shape[1] if case == "lm" or w == "fc1.weight" else params[w].shape[0]
        np.testing.assert_array_equal(state.parameters[f"{w}.lora_A"].data, lora_a(w, in_features, 2, 3))
        assert not state.parameters[f"{w}.lora_B"].data.any()
        state.parameters[f"{w}.lora_B"].data = rng.standard_normal(state.parameters[f"{w}.lora_B"].data.shape
                                                                   ).astype(np.float32)  # A's gradient is 0 at B = 0
    data = batch()
    module(*data)
    reference = ReferenceEvaluator(as_float64(onnx.load(str(tmp_path / "eval_model.onnx"))))
    frozen64 = {n: state.parameters[n].data.astype(np.float64) for n in result.frozen}

    feeds64 = {n: d.astype(np.float64) if d.dtype == np.float32 else d for n, d in zip(feed_names, data)}

    def loss64(values):
        return float(reference.run(None, {**feeds64, **frozen64, **values})[0])

    assert_gradients_match(state, loss64, {n: state.parameters[n].data.astype(np.float64) for n in result.trainable})


@pytest.mark.parametrize("case", sorted(CASES))
def test_frozen_weights_stay_and_the_merged_export_runs_in_onnxruntime(case, tmp_path):
    model, params, result, state, module, batch, feed_names = prepared(case, tmp_path)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.05)
    data = batch()
    first = float(module(*data)[0])
    for _ in range(15):
        module.lazy_reset_grad()
        module(*data)
        optimizer.step()
    module.eval()
    loss, logits = module(*data)
    assert float(loss) < first
    for name in result.frozen:
        np.testing.assert_array_equal(state.parameters[name].data, params[name])
    path = tmp_path / "merged.onnx"
    module.export_model_for_inferencing(path, ["logits"])
    exported = onnx.load(str(path))
    onnx.checker.check_model(exported)
    assert not [t.name for t in exported.graph.initializer if ".lora" in t.name]
    assert not [n.name for n in exported.graph.node if ".lora" in n.name]
    (expected,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {feed_names[0]: data[0]})
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


def test_lora_errors_name_the_weight(tmp_path):
    model, _ = tiny_lm()
    with pytest.raises(ArgumentError, match="'nothing.*' matches no 2-D weight"):
        artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                     artifact_directory=tmp_path, lora=artifacts.LoraConfig(2, 4.0, ["nothing.*"]))
    with pytest.raises(ModelError, match="'embed' cannot be adapted: it feeds Gather node"):
        artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                     artifact_directory=tmp_path, lora=artifacts.LoraConfig(2, 4.0, ["embed"]))
    with pytest.raises(ArgumentError, match="rank must be a positive integer"):
        artifacts.LoraConfig(0, 4.0, ["*"])


@pytest.mark.parametrize("reader", ["proto", "file"])
def test_targets_name_a_weight_or_the_node_that_reads_it(reader, tmp_path):
    """The dynamo exporter's `optimize=True` names Linear weights `val_N` and their nodes `node_linear`, with
    the module path in the node's metadata: a pattern on the reading node's name or module path (directly,
    or through a Transpose) reaches the weight; a pattern matching nothing is refused with examples."""
    from odtrain.graph.onnx_io import graph_from_proto, read_model_proto
    from odtrain.lora import target_weights

    params = {"val_1": rng.standard_normal((FEATURES, 8)).astype(np.float32),
              "val_2": rng.standard_normal((CLASSES, 8)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "val_1"], ["a"], name="node_linear"),
             helper.make_node("Transpose", ["val_2"], ["t"], perm=[1, 0], name="/model/layers.0/self_attn/v_proj/T"),
             helper.make_node("MatMul", ["a", "t"], ["logits"], name="/model/layers.0/self_attn/v_proj/MatMul")]
    nodes[0].metadata_props.add(key="pkg.torch.onnx.name_scopes",
                                value="['', 'model', 'model.layers.0.self_attn.q_proj', 'linear']")
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", FEATURES])],
                       outputs=[("logits", np.float32, ["batch", CLASSES])])
    if reader == "file":
        onnx.save(model, str(tmp_path / "model.onnx"))
        model = read_model_proto(str(tmp_path / "model.onnx"), "model")[0]
    graph = graph_from_proto(model, "model")
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["*q_proj*"])) == ["val_1"]
    # the exact module path, as PyTorch names the layer (model.get_submodule), and the path with its op
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["model.layers.0.self_attn.q_proj"])) == ["val_1"]
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["*.q_proj"])) == ["val_1"]
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["model.layers.0.self_attn.q_proj/linear"])) == ["val_1"]
    with pytest.raises(ArgumentError):
        target_weights(graph, artifacts.LoraConfig(2, 4.0, ["model.layers.0.self_attn"]))  # its parent: no layer
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["*v_proj/MatMul"])) == ["val_2"]
    assert target_weights(graph, artifacts.LoraConfig(2, 4.0, ["val_*"])) == ["val_1", "val_2"]
    with pytest.raises(ArgumentError) as refused:
        target_weights(graph, artifacts.LoraConfig(2, 4.0, ["*proj.weight"]))
    message = str(refused.value)
    assert "'*proj.weight' matches no 2-D weight and no node that reads one" in message
    assert "e.g. weights: val_1, val_2" in message
    assert "model.layers.0.self_attn.q_proj/linear, /model/layers.0/self_attn/v_proj/MatMul" in message


def test_federated_rounds_exchange_adapters_only(tmp_path):
    """Three simulated clients run FedAvg on the flat trainable buffer: the adapters alone."""
    _, params, result, state, module, batch, _ = prepared("classifier", tmp_path)
    trainer = fl.open_artifacts(tmp_path)
    adapter_values = sum(state.parameters[n].data.size for n in result.trainable)
    full_values = adapter_values + sum(p.size for p in params.values())
    global_buffer = fl.get_parameters(trainer.module)
    assert global_buffer.nbytes == 4 * adapter_values < 4 * full_values
    clients = [batch(64) for _ in range(3)]
    test_x, test_y = batch(256)
    before = fl.evaluate(trainer.module, test_x, test_y)["loss"]
    trainer.optimizer.set_learning_rate(0.05)
    for round_ in range(3):
        deltas, counts = [], []
        for k, (x, y) in enumerate(clients):
            fl.set_parameters(trainer.module, global_buffer)
            delta, count, _ = fl.train_local(trainer.module, trainer.optimizer, x, y, epochs=2, batch_size=16,
                                             seed=[0, round_, k])
            assert delta.size == adapter_values  # what the device uploads
            deltas.append(delta)
            counts.append(count)
        global_buffer = fl.apply_difference(global_buffer, fl.fedavg(deltas, counts))
    fl.set_parameters(trainer.module, global_buffer)
    assert fl.evaluate(trainer.module, test_x, test_y)["loss"] < before
    for name in result.frozen:
        np.testing.assert_array_equal(trainer.state.parameters[name].data, params[name])


def test_federated_lora_on_a_decoder_sends_the_adapters_and_feeds_tokens_and_mask(tmp_path):
    """Three clients train LoRA adapters of the Llama-style decoder (tests/data/decoders) on their own token
    batches, fed as input_ids and attention_mask: each uploads the adapters alone, and the round lowers the
    loss on all the clients' data."""
    from conftest import DATA

    model = DATA / "decoders" / "llama" / "torchscript17.onnx"
    golden = np.load(DATA / "decoders" / "llama" / "golden.npz")
    result = artifacts.generate_artifacts(str(model), loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                          ignore_index=-100, optimizer=artifacts.OptimType.AdamW,
                                          artifact_directory=tmp_path, lora=artifacts.LoraConfig(8, 16.0, ["*proj.weight"]))
    trainer = fl.open_artifacts(tmp_path)
    full = sum(trainer.state.parameters[n].data.size for n in result.frozen)  # what full fine-tuning trains
    adapters = sum(trainer.state.parameters[n].data.size for n in result.trainable)
    assert all(n.endswith((".lora_A", ".lora_B")) for n in result.trainable) and 6 * adapters < full
    ids, mask, labels = (golden[k].reshape(-1, golden[k].shape[-1]) for k in ("input_ids", "attention_mask", "labels"))

    def loss():
        trainer.module.eval()
        value = float(trainer.module(ids, mask, labels))  # the eval model's one output: the loss
        trainer.module.train()
        return value

    before, frozen = loss(), {n: trainer.state.parameters[n].data.copy() for n in result.frozen}
    global_buffer = fl.get_parameters(trainer.module)
    trainer.optimizer.set_learning_rate(1e-2)
    deltas, counts = [], []
    for k, part in enumerate(np.array_split(np.arange(len(ids)), 3)):
        fl.set_parameters(trainer.module, global_buffer)
        delta, count, _ = fl.train_local(trainer.module, trainer.optimizer, (ids[part], mask[part]), labels[part],
                                         epochs=2, batch_size=4, seed=[0, k])
        assert delta.size == adapters == global_buffer.size  # what the device uploads
        deltas.append(delta)
        counts.append(count)
    fl.set_parameters(trainer.module, fl.apply_difference(global_buffer, fl.fedavg(deltas, counts)))
    assert loss() < before
    for name, value in frozen.items():
        np.testing.assert_array_equal(trainer.state.parameters[name].data, value)


def test_command_line_prepares_lora_and_exports_adapters_alone(tmp_path, capsys):
    import safetensors.numpy
    from safetensors import safe_open

    from conftest import odtrain_main

    model, params = tiny_lm()
    onnx.save(model, tmp_path / "lm.onnx")
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a", "--lora-rank", "2",
                                  "--lora-targets", "*.weight", "--requires-grad", "g")
    assert code == 0, err
    assert "LoRA adapters of rank 2 (alpha 4) on 2 weights (q.weight, head.weight), and g" in out
    previous = os.umask(0o022)
    try:
        code, out, err = odtrain_main(capsys, "export", tmp_path / "a", "-o", tmp_path / "adapters.safetensors",
                                      "--adapters-only")
    finally:
        os.umask(previous)
    assert code == 0, err
    # readable by another account or service, as the ONNX files are (safetensors' own writer gives 0600)
    assert (tmp_path / "adapters.safetensors").stat().st_mode & 0o777 == 0o644
    tensors = safetensors.numpy.load_file(str(tmp_path / "adapters.safetensors"))
    assert sorted(tensors) == sorted(["g"] + [f"{w}.lora_{m}" for w in ("q.weight", "head.weight") for m in "AB"])
    with safe_open(str(tmp_path / "adapters.safetensors"), "np") as handle:
        assert "q.weight" in handle.metadata()["scales"]
    code, out, err = odtrain_main(capsys, "export", tmp_path / "a", "-o", tmp_path / "m.onnx")
    assert code == 0, err
    assert {t.name for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer} == set(params)
    code, _, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "b", "--lora-rank", "2",
                                "--train-last", "1")
    assert code == 2 and "name parameters to train besides the adapters with --requires-grad" in err
