"""Tiny Llama- and Qwen2-style causal LMs exported to ONNX, with PyTorch golden trajectories.

Run it in a virtual environment with torch, transformers and onnxscript (the dynamo exporter's
dependency), e.g. the comparison venv of benchmarks/compare.py; odtrain is not needed:

    python benchmarks/decoders/make_models.py            # writes tests/data/decoders/

No weights are downloaded: each model is built from a small config (hidden 64, 2 layers, 4 query
heads, 2 key/value heads, eager attention) with seeded random weights. Written per model folder:

- `torchscript17.onnx`: the TorchScript exporter at opset 17 (`dynamo=False`, training mode, no
  constant folding), `attention_mask` passed explicitly (transformers 5 needs it for this exporter);
- `dynamo18.onnx` (Llama only): the dynamo exporter at opset 18, `optimize=False` (torch names kept);
  the dynamo files are saved without their per-node metadata (FX node text and stack traces);
- `dynamo23.onnx`: the dynamo exporter at opset 23 with RMSNorm, rotary embedding and attention
  written as `F.rms_norm`, `torch.onnx.ops.rotary_embedding` and `torch.onnx.ops.attention`, so the
  file holds the single ONNX ops RMSNormalization, RotaryEmbedding and Attention;
- `golden.npz` and `meta.json` (see tests/data/decoders/README.md; `onnx_names` maps a torch parameter
  name to a file's initializer where they differ): the batches, the losses of 10 SGD
  and 10 AdamW steps (ONNX Runtime's AdamW), step-0 float64 gradients, and the same trajectories in
  float32 with their measured distance from float64, which the tests take as their tolerance.

Every file of a model holds the same weights, so one golden serves them all. The loss is
cross-entropy on logits [batch, seq, vocab] against next-token labels [batch, seq], padding
labelled -100 and ignored. The Llama folder also holds a LoRA golden: adapters on the q and v
projections added by forward hooks, initialised by graph/lora_init.py (loaded by path), trained with
AdamW together with the final norm.

Beside them, `<family>_sdpa` (`--sdpa` writes only these): the family with transformers' default
attention (SDPA), as users load it, its norm weights and biases drawn apart (so that `optimize=True`
does not merge them), exported by TorchScript at opset 17 and by the dynamo exporter's default
`optimize=True` at opsets 18 and 23 (module paths kept in the node metadata; `onnx_transposed` lists
the weights stored transposed), with AdamW and LoRA goldens of its own. transformers here needs
torchaudio only if it loads; where it is broken, stub `transformers.utils.is_torchaudio_available`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the optimizers as PyTorch
from torch_optimizers import ADAMW, SGD, AdamWLikeOnnxRuntime  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
IGNORE_INDEX = -100
STEPS, BATCH, SEQ = 10, 4, 16
SGD_LR, ADAMW_LR = 0.05, 1e-3
LORA = {"rank": 4, "alpha": 8.0, "seed": 0, "target_params": ["*q_proj.weight", "*v_proj.weight"],
        "requires_grad": ["model.norm.weight"], "lr": 1e-2}
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
BENCHMARK_SIZES = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
# Released models' shapes (their configs; random weights, nothing downloaded): (family, config entries)
SHAPED = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)),
    "qwen2-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # 1.24B parameters, 4.9 GB in float32: the exporter writes them as external data (about 9 GiB at its peak)
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                                   tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
}


def _load_lora_init():
    spec = importlib.util.spec_from_file_location("lora_init", REPO / "graph" / "lora_init.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- models --------------------------------------------------------------------------------------------


def _causal_lm(base):
    """`base` whose forward takes (input_ids, attention_mask) and returns the logits alone."""

    class CausalLM(base):
        def forward(self, input_ids, attention_mask):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    CausalLM.__name__ = base.__name__
    return CausalLM


FAMILIES = {
    "llama": (LlamaConfig, _causal_lm(LlamaForCausalLM), dict(tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, _causal_lm(Qwen2ForCausalLM), dict(tie_word_embeddings=True)),
}


def build(family: str, attention: str = "eager", sizes=None, seed: int = 0):
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**{**extra, **(sizes or SIZES)})
    config._attn_implementation = attention
    torch.manual_seed(seed)
    return model_class(config).eval()


def _onnx_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Grouped-query attention as the opset-23 Attention op (query [b, h, s, d], key/value [b, kv, s, d])."""
    y = torch.onnx.ops.attention(query, key, value, attention_mask, scale=scaling,
                                 q_num_heads=query.shape[1], kv_num_heads=key.shape[1])[0]
    return y.transpose(1, 2).contiguous(), None


def _onnx_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' rotate-half rotary as the opset-23 RotaryEmbedding op (caches [b, s, d/2])."""
    half = cos.shape[-1] // 2
    cos_cache = cos[..., :half].expand(q.shape[0], -1, -1)
    sin_cache = sin[..., :half].expand(q.shape[0], -1, -1)
    return (torch.onnx.ops.rotary_embedding(q, cos_cache, sin_cache),
            torch.onnx.ops.rotary_embedding(k, cos_cache, sin_cache))


def _rms_norm(self, hidden_states):
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


@contextlib.contextmanager
def single_ops(family: str):
    """Within: the family's RMSNorm, rotary and attention as the opset-23 ops (attention 'onnx_attention')."""
    modeling = {"llama": transformers.models.llama.modeling_llama,
                "qwen2": transformers.models.qwen2.modeling_qwen2}[family]
    norm = getattr(modeling, {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm"}[family])
    AttentionInterface.register("onnx_attention", _onnx_attention)
    AttentionMaskInterface.register("onnx_attention", eager_mask)  # the same additive float mask as eager
    saved = modeling.apply_rotary_pos_emb, norm.forward
    modeling.apply_rotary_pos_emb, norm.forward = _onnx_rotary, _rms_norm
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb, norm.forward = saved


def _example(vocab: int, batch: int = 2, seq: int = 8):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return ids, torch.ones_like(ids)


def export_torchscript(model, path, opset: int = 17) -> None:
    axes = {"batch": 0, "seq": 1}
    torch.onnx.export(model, _example(model.config.vocab_size), str(path), dynamo=False, opset_version=opset,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_axes={"input_ids": {v: k for k, v in axes.items()},
                                    "attention_mask": {v: k for k, v in axes.items()},
                                    "logits": {v: k for k, v in axes.items()}})


def export_dynamo(model, path, opset: int) -> None:
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", min=2)}
    torch.onnx.export(model, _example(model.config.vocab_size), str(path), dynamo=True, optimize=False,
                      opset_version=opset, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_shapes={"input_ids": dims, "attention_mask": dims}, external_data=False)
    _strip_node_metadata(path)


def export_dynamo_optimized(model, path, opset: int) -> None:
    """The dynamo exporter as users call it: `optimize=True` (Linear transposes folded into new `val_N`
    initializers, torch names lost)."""
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", min=2)}
    torch.onnx.export(model, _example(model.config.vocab_size), str(path), dynamo=True, optimize=True,
                      opset_version=opset, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_shapes={"input_ids": dims, "attention_mask": dims}, external_data=False)
    _strip_node_metadata(path, keep=("pkg.torch.onnx.name_scopes",))


SDPA_FILES = {"torchscript17.onnx": ("TorchScript exporter, opset 17, default (SDPA) attention",
                                     lambda model, path: export_torchscript(model, path, 17)),
              "dynamo18.onnx": ("dynamo exporter, opset 18, optimize=True, default (SDPA) attention",
                                lambda model, path: export_dynamo_optimized(model, path, 18)),
              "dynamo23.onnx": ("dynamo exporter, opset 23, optimize=True, default (SDPA) attention",
                                lambda model, path: export_dynamo_optimized(model, path, 23))}


def build_sdpa(family: str, seed: int = 0):
    """The family with transformers' default attention (SDPA), as `from_pretrained` loads it, with norm
    weights drawn around one and biases around zero: `optimize=True` merges initializers of equal values,
    which would tie the freshly initialised (all-one, all-zero) vectors that PyTorch trains apart."""
    model = build(family, attention="sdpa", seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def write_sdpa(family: str, out_dir: pathlib.Path, seed: int) -> dict:
    """The folder `<family>_sdpa`: build_sdpa's model in SDPA_FILES' exports (an exporter that fails is
    reported and skipped), with its goldens, AdamW with and without LoRA. Returns meta.json's content."""
    folder = out_dir / f"{family}_sdpa"
    folder.mkdir(parents=True, exist_ok=True)
    model = build_sdpa(family, seed)
    state = model.state_dict()
    files, errors, renamed, flipped = {}, {}, {}, {}
    for name, (what, export) in SDPA_FILES.items():
        try:
            export(model, folder / name)
        except Exception as error:  # recorded: an exporter that fails is a fact about it
            print(family, name, "export failed:", type(error).__name__, str(error).splitlines()[0][:300])
            continue
        files[name] = what
        errors[name] = _check_export(model, folder / name, family)
        flipped[name] = []
        renamed[name] = onnx_names(model, folder / name, flipped[name])
    data = batches(model.config.vocab_size, seed)

    def fresh():
        m = build_sdpa(family, seed)
        m.load_state_dict(state)
        return m

    golden, meta_runs = golden_trajectories(fresh, data, lambda m: {n: p for n, p in parameters(m).items()},
                                            optimizers=(("adamw", ADAMW_LR),))
    lora_arrays, lora_meta = lora_golden(fresh, data)
    golden.update(lora_arrays)
    meta = {"family": family, "attention": "sdpa", "files": files, "config": {**SIZES, **FAMILIES[family][2]},
            "inputs": ["input_ids", "attention_mask"], "output": "logits", "labels": "labels [batch, seq], next token",
            "ignore_index": IGNORE_INDEX, "steps": STEPS, "batch": BATCH, "seq": SEQ,
            "requires_grad": list(parameters(model)), "onnx_names": {k: v for k, v in renamed.items() if v},
            "onnx_transposed": {k: v for k, v in flipped.items() if v}, "adamw_settings": ADAMW, **meta_runs,
            "lora": lora_meta, "export_max_abs_error": errors, "versions": {
                "torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__}}
    np.savez_compressed(folder / "golden.npz", input_ids=data[0], attention_mask=data[1], labels=data[2], **golden)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _strip_node_metadata(path, keep=()) -> None:
    """Drop the dynamo exporter's per-node metadata (FX node text, stack traces): two thirds of the file;
    the entries named in `keep` stay (the module path, by which LoRA targets find `val_N` weights)."""
    model = onnx.load(str(path))
    for node in model.graph.node:
        kept = [(p.key, p.value) for p in node.metadata_props if p.key in keep]
        del node.metadata_props[:]
        for key, value in kept:
            node.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def onnx_names(model, path, transposed: list | None = None) -> dict[str, str]:
    """torch parameter name -> the file's initializer name, where they differ (the dynamo exporter names a
    tied embedding after lm_head): a parameter missing by name is found by its values. With a `transposed`
    list, a parameter may also be found by its transpose (`optimize=True` folds a Linear's transpose into
    a `val_N` initializer); its torch name joins the list."""
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    named = parameters(model)
    names = {}
    for name, parameter in named.items():
        value = parameter.detach().numpy()
        if name in arrays and np.array_equal(arrays[name], value):
            continue
        found = [n for n, a in arrays.items() if n not in named and a.shape == value.shape and np.array_equal(a, value)]
        if not found and transposed is not None and value.ndim == 2:
            found = [n for n, a in arrays.items() if a.shape == value.T.shape and np.array_equal(a, value.T)]
            transposed += [name] if len(found) == 1 else []
        if len(found) != 1:
            raise ValueError(f"{path}: {len(found)} initializers hold the values of {name}: {found}")
        names[name] = found[0]
    return names


def _check_export(model, path, family: str) -> float:
    """The largest difference between the file's logits (onnx.reference) and the model's, on a padded batch."""
    from onnx.reference import ReferenceEvaluator

    ids, mask = _example(model.config.vocab_size, batch=2, seq=6)
    mask[1, -2:] = 0
    with torch.no_grad():
        expected = model(ids, mask).numpy()
    (got,) = ReferenceEvaluator(str(path)).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    return float(np.abs(got - expected).max())


# ---- data, losses and trajectories ---------------------------------------------------------------------


def batches(vocab: int, seed: int):
    """STEPS batches of token ids [BATCH, SEQ], right-padded masks and next-token labels (-100 on padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(STEPS, BATCH, SEQ)).astype(np.int64)
    lengths = rng.integers(SEQ // 2, SEQ + 1, size=(STEPS, BATCH))
    lengths[:, 0] = SEQ  # one full row per batch
    mask = (np.arange(SEQ)[None, None, :] < lengths[:, :, None]).astype(np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[:, :, :-1] = np.where(mask[:, :, 1:] == 1, ids[:, :, 1:], IGNORE_INDEX)
    return ids, mask, labels


def sequence_loss(logits, labels):
    """Mean cross-entropy over the non-ignored positions of logits [b, s, V] and labels [b, s]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def trajectory(model, data, optimizer: str, lr: float, trainable: dict):
    """(losses of STEPS steps, step-0 gradients) training `trainable` (name -> tensor) of `model`."""
    ids, mask, labels = (torch.from_numpy(a) for a in data)
    params = list(trainable.values())
    opt = (SGD if optimizer == "sgd" else AdamWLikeOnnxRuntime)(params, lr)
    losses, grads = [], None
    for step in range(STEPS):
        for p in params:
            p.grad = None
        loss = sequence_loss(model(ids[step], mask[step]), labels[step])
        loss.backward()
        losses.append(float(loss))
        if step == 0:
            grads = {name: p.grad.detach().double().numpy().copy() for name, p in trainable.items()}
        opt.step()
    return np.array(losses), grads


def parameters(model):
    """The trainable parameters under their ONNX names (buffers such as rotary inv_freq are not parameters;
    a tied lm_head shares the embedding's parameter and name)."""
    return dict(model.named_parameters())


def gradient_error(grads, grads64) -> float:
    """max over parameters of ‖g − g64‖ / max(‖g64‖, 1e-4·‖all of g64‖), as tests/data/README.md measures."""
    total = np.sqrt(sum(np.sum(g ** 2) for g in grads64.values()))
    return max(float(np.linalg.norm(grads[n] - g) / max(np.linalg.norm(g), 1e-4 * total)) for n, g in grads64.items())


def relative_error(values, reference) -> float:
    return float(np.max(np.abs(np.asarray(values) - reference) / np.abs(reference)))


def golden_trajectories(make_model, data, select, prefix="", optimizers=(("sgd", SGD_LR), ("adamw", ADAMW_LR))):
    """The optimizers in float64 (the golden) and float32 (to measure float32's distance from float64)."""
    out, meta = {}, {}
    for optimizer, lr in optimizers if not prefix else (("adamw", LORA["lr"]),):
        runs = {}
        for dtype in (torch.float64, torch.float32):
            model = make_model().to(dtype)
            runs[dtype] = trajectory(model, data, optimizer, lr, select(model))
        (losses64, grads64), (losses32, grads32) = runs[torch.float64], runs[torch.float32]
        out[f"{prefix}{optimizer}_losses"] = losses64
        out[f"{prefix}{optimizer}_losses_float32"] = losses32.astype(np.float32)
        if optimizer == "adamw":
            out.update({f"{prefix}grad64/{n}": g for n, g in grads64.items()})
        meta[f"{optimizer}"] = {"lr": lr, "float32_loss_error": relative_error(losses32, losses64),
                                **({"float32_grad_error": gradient_error(grads32, grads64)} if optimizer == "adamw" else {})}
    return out, meta


# ---- LoRA by forward hooks ------------------------------------------------------------------------------


def add_lora(model, seed: int):
    """Adapters on every Linear whose weight matches LORA's patterns: y + (alpha/rank)·(x·A)·B. Returns
    the adapters as {ONNX name: parameter}, A from graph/lora_init.py (so the artifacts start alike)."""
    from fnmatch import fnmatchcase

    init = _load_lora_init()
    rank, scale = LORA["rank"], LORA["alpha"] / LORA["rank"]
    dtype = next(model.parameters()).dtype
    adapters = {}
    for name, module in model.named_modules():
        weight = f"{name}.weight"
        if not isinstance(module, torch.nn.Linear) or not any(fnmatchcase(weight, p) for p in LORA["target_params"]):
            continue
        a = torch.nn.Parameter(torch.from_numpy(init.lora_a(weight, module.in_features, rank, seed)).to(dtype))
        b = torch.nn.Parameter(torch.from_numpy(init.lora_b(rank, module.out_features)).to(dtype))
        module.register_forward_hook(lambda mod, inputs, output, a=a, b=b: output + scale * (inputs[0] @ a) @ b)
        adapters[f"{weight}.lora_A"], adapters[f"{weight}.lora_B"] = a, b
    return adapters


def lora_golden(make_model, data):
    def select(model):
        for p in model.parameters():
            p.requires_grad_(False)
        adapters = add_lora(model, LORA["seed"])
        named = dict(model.named_parameters())
        for name in LORA["requires_grad"]:
            named[name].requires_grad_(True)
        return {**adapters, **{name: named[name] for name in LORA["requires_grad"]}}

    out, meta = golden_trajectories(make_model, data, select, prefix="lora/")
    adapted = sorted({n[len("lora/grad64/"):].rsplit(".lora_", 1)[0] for n in out if n.startswith("lora/grad64/")
                      and ".lora_" in n})
    return out, {**LORA, **meta["adamw"], "adapted": adapted}


# ---- the files ------------------------------------------------------------------------------------------


def write_family(family: str, out_dir: pathlib.Path, seed: int, dynamo18: bool, lora: bool) -> dict:
    folder = out_dir / family
    folder.mkdir(parents=True, exist_ok=True)
    model = build(family, seed=seed)
    state = model.state_dict()
    files = {"torchscript17.onnx": "TorchScript exporter, opset 17"}
    export_torchscript(model, folder / "torchscript17.onnx")
    if dynamo18:
        export_dynamo(model, folder / "dynamo18.onnx", 18)
        files["dynamo18.onnx"] = "dynamo exporter, opset 18, optimize=False"
    with single_ops(family):
        single = build(family, attention="onnx_attention", seed=seed)
        single.load_state_dict(state)
        export_dynamo(single, folder / "dynamo23.onnx", 23)
        files["dynamo23.onnx"] = "dynamo exporter, opset 23: RMSNormalization, RotaryEmbedding, Attention"
        export_error = {name: _check_export(single if name == "dynamo23.onnx" else model, folder / name, family)
                        for name in files}
    renamed = {name: onnx_names(model, folder / name) for name in files}
    data = batches(model.config.vocab_size, seed)

    def fresh():
        m = build(family, seed=seed)
        m.load_state_dict(state)
        return m

    golden, meta_runs = golden_trajectories(fresh, data, lambda m: {n: p for n, p in parameters(m).items()})
    meta = {"family": family, "files": files, "config": {**SIZES, **FAMILIES[family][2]},
            "inputs": ["input_ids", "attention_mask"], "output": "logits", "labels": "labels [batch, seq], next token",
            "ignore_index": IGNORE_INDEX, "steps": STEPS, "batch": BATCH, "seq": SEQ,
            "requires_grad": list(parameters(model)), "onnx_names": {k: v for k, v in renamed.items() if v},
            "adamw_settings": ADAMW, **meta_runs,
            "export_max_abs_error": export_error,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__}}
    if lora:
        lora_arrays, meta["lora"] = lora_golden(fresh, data)
        golden.update(lora_arrays)
    np.savez_compressed(folder / "golden.npz", input_ids=data[0], attention_mask=data[1], labels=data[2], **golden)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "tests" / "data" / "decoders")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sdpa", action="store_true",
                        help="only write the default-attention (SDPA) folders, <family>_sdpa")
    parser.add_argument("--benchmark", type=pathlib.Path, metavar="MODEL.onnx",
                        help="instead, export BENCHMARK_SIZES' Llama (TorchScript, opset 17) for lora_step.py")
    parser.add_argument("--shaped", nargs=2, metavar=("NAME", "MODEL.onnx"),
                        help=f"instead, export a model of a released model's shape ({', '.join(SHAPED)}; TorchScript, "
                        "opset 17) for memory_stages.py and lora_step.py")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.benchmark:
        export_torchscript(build("llama", sizes=BENCHMARK_SIZES, seed=args.seed), args.benchmark)
        return
    if args.shaped:
        family, sizes = SHAPED[args.shaped[0]]
        export_torchscript(build(family, sizes=sizes, seed=args.seed), args.shaped[1])
        return
    if args.sdpa:
        for family in FAMILIES:
            meta = write_sdpa(family, args.out, args.seed)
            print(family, "sdpa", json.dumps({k: meta[k] for k in ("adamw", "lora", "export_max_abs_error")}))
        return
    for family in FAMILIES:
        meta = write_family(family, args.out, args.seed, dynamo18=family == "llama", lora=family == "llama")
        print(family, json.dumps({k: meta[k] for k in ("sgd", "adamw", "export_max_abs_error")}))
        meta = write_sdpa(family, args.out, args.seed)
        print(family, "sdpa", json.dumps({k: meta[k] for k in ("adamw", "lora", "export_max_abs_error")}))


if __name__ == "__main__":
    main()
