"""Decoders as users build and export them: transformers' default attention (SDPA, its softmax guarded by
IsNaN), exported by TorchScript at opset 17 and by the dynamo exporter's default `optimize=True` at opsets
18 and 23 (projections renamed `val_N` and stored transposed), train along PyTorch's goldens, fully and
with LoRA adapters targeted by their layer ('*q_proj*').

The models and goldens are tests/data/decoders/<family>_sdpa (benchmarks/decoders/make_models.py --sdpa);
the helpers and tolerances are tests/test_decoders.py's. Measured on llama_sdpa/dynamo18.onnx: losses
4.1e-8 relative from the golden (allowed 6.0e-7); with the learning rate 1% off, 6.4e-5.
"""
import numpy as np
import pytest

from odtrain import artifacts
from odtrain.graph import lora as graph_lora
from test_decoders import TOLERANCE, decoder, gradient_error, pytestmark, train_along_golden  # noqa: F401

SDPA_FILES = [("llama", "torchscript17"), ("llama", "dynamo18"), ("llama", "dynamo23"), ("qwen2", "torchscript17"),
              ("qwen2", "dynamo18"), ("qwen2", "dynamo23")]


def as_exported(grads: dict, meta, export: str) -> tuple[dict, dict]:
    """(torch name -> file name, gradients by file name with `optimize=True`'s transposed weights turned back)."""
    renamed = meta.get("onnx_names", {}).get(f"{export}.onnx", {})
    flipped = set(meta.get("onnx_transposed", {}).get(f"{export}.onnx", []))
    names = {n: renamed.get(n, n) for n in meta["requires_grad"]}
    return names, {names[n]: grads[names[n]].T if n in flipped else grads[names[n]] for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("family, export", SDPA_FILES, ids=["-".join(f) for f in SDPA_FILES])
def test_sdpa_decoder_matches_pytorch(family, export, tmp_path):
    """The SDPA model (IsNaN guards its softmax) from TorchScript at opset 17 and from the dynamo exporter with
    `optimize=True` (weights renamed val_N and stored transposed) trains 10 AdamW steps along PyTorch's."""
    folder, meta, golden = decoder(f"{family}_sdpa")
    renamed = meta.get("onnx_names", {}).get(f"{export}.onnx", {})
    trainable = [renamed.get(n, n) for n in meta["requires_grad"]]
    losses, grads, module = train_along_golden(folder / f"{export}.onnx", golden, "adamw", meta["adamw"]["lr"],
                                               tmp_path, trainable, requires_grad=trainable)
    assert ("", "IsNaN") in {node.key for node in module.graph(training=True).nodes} or export == "dynamo23"
    np.testing.assert_allclose(losses, golden["adamw_losses"], rtol=TOLERANCE * meta["adamw"]["float32_loss_error"])
    names, grads = as_exported(grads, meta, export)
    assert gradient_error(grads, golden, names) < TOLERANCE * meta["adamw"]["float32_grad_error"]


LORA_FILES = [("llama", "torchscript17"), ("llama", "dynamo18"), ("qwen2", "dynamo18"), ("qwen2", "dynamo23")]


@pytest.mark.slow
@pytest.mark.parametrize("family, export", LORA_FILES, ids=["-".join(f) for f in LORA_FILES])
def test_sdpa_lora_targets_projections_by_their_layer(family, export, tmp_path, monkeypatch):
    """LoRA with its q and v projections named by their layer: '*q_proj*' matches TorchScript's node names and
    the module path of the node reading an `optimize=True` export's `val_N`. It trains along PyTorch's LoRA
    run; A starts from the values graph/lora_init.py draws for the torch names, as the generator's do."""
    folder, meta, golden = decoder(f"{family}_sdpa")
    lora = meta["lora"]
    renamed = meta.get("onnx_names", {}).get(f"{export}.onnx", {})
    torch_name = {renamed.get(n, n): n for n in lora["adapted"]}
    drawn = graph_lora.lora_a  # A drawn for the torch name of each weight, as the generator draws it
    monkeypatch.setattr(graph_lora, "lora_a", lambda weight, *shape: drawn(torch_name.get(weight, weight), *shape))

    config = artifacts.LoraConfig(lora["rank"], lora["alpha"], ["*q_proj*", "*v_proj*"], seed=lora["seed"])
    names = {n: n for n in (k[len("lora/grad64/"):] for k in golden.files if k.startswith("lora/grad64/"))}
    bases = {n: n.rsplit(".lora_", 1)[0] for n in names}  # an adapter's weight; the norm's own name
    onnx_names = {n: renamed.get(base, base) + n[len(base):] for n, base in bases.items()}
    losses, grads, module = train_along_golden(folder / f"{export}.onnx", golden, "adamw", lora["lr"], tmp_path,
                                               onnx_names.values(), requires_grad=lora["requires_grad"], lora=config)
    assert sorted(module.graph().outputs[2:]) == sorted(f"{n}_grad" for n in onnx_names.values())
    np.testing.assert_allclose(losses, golden["lora/adamw_losses"], rtol=TOLERANCE * lora["float32_loss_error"])
    assert gradient_error(grads, golden, onnx_names, "lora/") < TOLERANCE * lora["float32_grad_error"]
