"""Llama- and Qwen2-style causal LMs exported by PyTorch's exporters train along PyTorch's golden trajectories,
fully and with LoRA adapters.

The models and goldens are tests/data/decoders (benchmarks/decoders/make_models.py). Each file trains 10 SGD
and 10 AdamW steps on logits [batch, seq, vocab] against next-token labels with padding ignored; the losses
must stay within TOLERANCE times PyTorch's own float32 distance from the float64 golden (measured by the
generator and stored in meta.json), and so must the step-0 gradients. Measured here: odtrain's losses
3.7e-8..4.2e-8 relative (PyTorch float32: 0.9e-7..2.0e-7), gradients 5.2e-7..7.0e-7 (PyTorch: 4.9e-7..5.5e-7).
The opset-23 files train with RMSNormalization, RotaryEmbedding and Attention as single ops; the others with
the exported RMSNorm and rotary patterns fused onto the same kernels.
"""
import json

import numpy as np
import pytest

from conftest import DATA
from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.ops import OPS
from odtrain.graph.planner import SCRATCH_SUFFIX
from odtrain.graph.schedule import RECOMPUTE_SUFFIX

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")
pytestmark = pytest.mark.skipif(("", "Sin") not in OPS or ("", "Cos") not in OPS,
                                reason="the exported rotary tables need the Sin and Cos kernels")

TOLERANCE = 4  # times PyTorch's own float32-vs-float64 distance
FILES = [("llama", "torchscript17"), ("llama", "dynamo18"), ("llama", "dynamo23"), ("qwen2", "torchscript17"),
         ("qwen2", "dynamo23")]
SINGLE_OPS = {"dynamo23": {("", "RMSNormalization"), ("", "RotaryEmbedding"), ("", "Attention")}}
FUSED_OPS = {("ai.odtrain", "RMSNormalization"), ("ai.odtrain", "RotaryEmbedding")}
SILU = ("ai.odtrain", "Swish")  # every export's MLP gate, Mul(x, Sigmoid(x)) before opset 24


def decoder(family: str):
    folder = DATA / "decoders" / family
    return folder, json.loads((folder / "meta.json").read_text()), np.load(folder / "golden.npz")


def gradient_error(grads: dict, golden, names: dict, prefix: str = "") -> float:
    """max over parameters of ‖g − g64‖ / max(‖g64‖, 1e-4·‖all of g64‖), as the generator measures PyTorch's."""
    expected = {n: golden[f"{prefix}grad64/{n}"] for n in names}
    total = np.sqrt(sum(np.sum(g ** 2) for g in expected.values()))
    return max(np.linalg.norm(grads[names[n]] - g) / max(np.linalg.norm(g), 1e-4 * total) for n, g in expected.items())


def exports_like_onnxruntime(module, golden, directory):
    """The trained model's inference export runs in onnxruntime with the training model's logits."""
    path = directory / "inference.onnx"
    module.export_model_for_inferencing(path, ["logits"])
    feeds = {"input_ids": golden["input_ids"][0], "attention_mask": golden["attention_mask"][0]}
    module.eval()
    _, logits = module(*feeds.values(), golden["labels"][0])
    (expected,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    return path


def train_along_golden(path, golden, optimizer: str, lr: float, directory, names, outputs=("logits",), **options):
    """(losses of the golden's steps, step-0 gradients of `names`, module) for artifacts of `path` that also
    output `outputs`."""
    kind = artifacts.OptimType.SGD if optimizer == "sgd" else artifacts.OptimType.AdamW
    artifacts.generate_artifacts(str(path), loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                 ignore_index=-100, optimizer=kind, artifact_directory=directory,
                                 additional_output_names=list(outputs), **options)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    opt.set_learning_rate(lr)
    losses, grads = [], None
    for step in range(len(golden["input_ids"])):
        results = module(golden["input_ids"][step], golden["attention_mask"][step], golden["labels"][step])
        losses.append(float(results[0] if outputs else results))
        if step == 0:
            grads = {name: state.parameters[name].grad.copy() for name in names}
        opt.step()
        module.lazy_reset_grad()
    return np.array(losses), grads, module


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("family, export", FILES, ids=["-".join(f) for f in FILES])
def test_decoder_matches_pytorch(family, export, optimizer, tmp_path):
    folder, meta, golden = decoder(family)
    renamed = meta.get("onnx_names", {}).get(f"{export}.onnx", {})
    names = {n: renamed.get(n, n) for n in meta["requires_grad"]}
    losses, grads, module = train_along_golden(folder / f"{export}.onnx", golden, optimizer, meta[optimizer]["lr"],
                                               tmp_path, names.values(), requires_grad=list(names.values()))
    ops = {node.key for node in module.graph(training=True).nodes}
    assert SINGLE_OPS.get(export, FUSED_OPS) <= ops
    assert SILU in ops and ("", "Sigmoid") not in ops
    (bound,) = module._train.plans.values()  # the fused SiLU stays cheap: run again before its gradient
    assert any(n.key == SILU and n.name.endswith(RECOMPUTE_SUFFIX) for n in bound.plan.order)
    np.testing.assert_allclose(losses, golden[f"{optimizer}_losses"],
                               rtol=TOLERANCE * meta[optimizer]["float32_loss_error"])
    assert gradient_error(grads, golden, names) < TOLERANCE * meta["adamw"]["float32_grad_error"]
    if optimizer == "adamw":
        exports_like_onnxruntime(module, golden, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("export", ["torchscript17", "dynamo23"])
def test_decoder_split_into_parallel_parts_matches_pytorch(export, tmp_path, monkeypatch):
    """At 2 threads with every kernel split into parts (kernels/parallel_split.py, forced on these small shapes): the
    fused and the opset-23 RMSNorm, rotary and attention kernels run their parallel twins along the golden."""
    import odtrain.threads as thread_policy
    from odtrain.kernels import parallel_split

    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    thread_policy.set_num_threads(2)
    try:
        folder, meta, golden = decoder("llama")
        names = {n: n for n in meta["requires_grad"]}
        losses, grads, module = train_along_golden(folder / f"{export}.onnx", golden, "adamw", meta["adamw"]["lr"],
                                                   tmp_path, names.values(), requires_grad=list(names.values()))
    finally:
        thread_policy._process_default = None
    split = {getattr(kernel, "__name__", "") for plan in module._train.plans.values() for kernel, _ in plan.calls}
    assert {"_rms_norm_parts", "_rms_norm_grad_parts"} <= split
    assert ({"_attention_parts", "_attention_grad_parts", "_rotate_pairs_parts"} if export == "dynamo23" else
            {"_rotate_half_parts"}) <= split
    np.testing.assert_allclose(losses, golden["adamw_losses"], rtol=TOLERANCE * meta["adamw"]["float32_loss_error"])
    assert gradient_error(grads, golden, names) < TOLERANCE * meta["adamw"]["float32_grad_error"]


@pytest.mark.slow
def test_lora_matches_pytorch_lora(tmp_path):
    """Adapters on every q and v projection (PyTorch adds them by forward hooks from graph/lora_init.py's values)
    and the final norm train along PyTorch's trajectory; the export merges them into the weights."""
    folder, meta, golden = decoder("llama")
    lora = meta["lora"]
    names = {n: n for n in (k[len("lora/grad64/"):] for k in golden.files if k.startswith("lora/grad64/"))}
    config = artifacts.LoraConfig(lora["rank"], lora["alpha"], lora["target_params"], seed=lora["seed"])
    losses, grads, module = train_along_golden(folder / "torchscript17.onnx", golden, "adamw", lora["lr"], tmp_path,
                                               names, requires_grad=lora["requires_grad"], lora=config)
    assert sorted(module.graph().outputs[2:]) == sorted(f"{n}_grad" for n in names)  # adapters and norm only
    np.testing.assert_allclose(losses, golden["lora/adamw_losses"], rtol=TOLERANCE * lora["float32_loss_error"])
    assert gradient_error(grads, golden, names, "lora/") < TOLERANCE * lora["float32_grad_error"]
    exports_like_onnxruntime(module, golden, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_vocabulary_loss_fused_matches_pytorch_and_shrinks_the_arena(family, tmp_path, monkeypatch):
    """Without a logits output the vocabulary product and the loss train as one op (graph/fusion.py), a chunk of
    logits at a time: the losses and gradients stay on PyTorch's trajectory (qwen2 ties lm_head to the embedding,
    whose gradient then sums the fused op's and the Gather's), and the arena does not grow. While the unfused
    logits' gradient is alive (the loss's gradient, then the head's products), the fused op holds at least the
    logits' bytes less. Tied (qwen2), the embedding's gradient is a value of the arena there: the unfused graph
    holds the logits' gradient, the fused one its chunk of scratch and the labels (which the unfused loss's
    gradient has read by then). With the layers' cheap activations recomputed, the arena's peak of this small
    decoder lies elsewhere (tied: at the same step with and without the fusion)."""
    from odtrain.graph import fusion
    from odtrain.kernels import training as loss_kernels

    folder, meta, golden = decoder(family)
    names = {n: n for n in meta["requires_grad"]}
    monkeypatch.setattr(loss_kernels, "CHUNK_MIN_ROWS", 24)  # three chunks of the 64 tokens, the last one short
    monkeypatch.setattr(loss_kernels, "CHUNK_BYTES", 0)
    losses, grads, fused = train_along_golden(folder / "torchscript17.onnx", golden, "adamw", meta["adamw"]["lr"],
                                              tmp_path / "fused", names.values(), outputs=(),
                                              requires_grad=list(names.values()))
    assert ("ai.odtrain", "LinearCrossEntropyGrad") in {node.key for node in fused.graph(training=True).nodes}
    np.testing.assert_allclose(losses, golden["adamw_losses"], rtol=TOLERANCE * meta["adamw"]["float32_loss_error"])
    assert gradient_error(grads, golden, names) < TOLERANCE * meta["adamw"]["float32_grad_error"]

    monkeypatch.setattr(fusion, "TRAINING_PASSES", tuple(p for p in fusion.TRAINING_PASSES
                                                         if p is not fusion.vocabulary_loss_pass))
    _, _, unfused = train_along_golden(folder / "torchscript17.onnx", golden, "adamw", meta["adamw"]["lr"],
                                       tmp_path / "unfused", (), outputs=(), requires_grad=list(names.values()))
    (before,), (after,) = unfused._train.plans.values(), fused._train.plans.values()
    logits = next(t for t in before.types.values() if t.shape == (meta["batch"], meta["seq"],
                                                                  meta["config"]["vocab_size"]))
    gradient = next(node for node in after.plan.order if node.op_type == "LinearCrossEntropyGrad")
    chunk = after.types[gradient.name + SCRATCH_SUFFIX].nbytes
    assert chunk == 4 * 24 * meta["config"]["vocab_size"]
    labels = after.types[gradient.inputs[3]].nbytes
    saved = logits.nbytes - (chunk + labels if meta["config"]["tie_word_embeddings"] else 0)
    # while the unfused logits' gradient is alive (written by the loss's gradient, read by the head's products)
    logits_gradient = next(node for node in before.plan.order if node.op_type == "SoftmaxCrossEntropyLossGrad").outputs[0]
    alive = before.plan.groups[before.plan.group_of[logits_gradient]]
    unfused_live = before.plan.live_profile()[before.plan.written[logits_gradient]:alive.end + 1].max()
    fused_live = after.plan.live_profile()[after.plan.order.index(gradient) + 1]
    assert fused_live <= unfused_live - saved
    assert after.plan.arena_bytes <= before.plan.arena_bytes
