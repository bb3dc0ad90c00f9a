"""Models that loop, exported from PyTorch as users export them, with PyTorch's golden loss trajectories.

Run it in a virtual environment with torch 2.13, onnx and onnxscript (the dynamo exporter's dependency);
odtrain is not needed:

    python3 -m venv /work/torchref && /work/torchref/bin/pip install torch==2.13.0 onnx onnxscript numpy
    /work/torchref/bin/python benchmarks/loop_goldens.py          # writes tests/data/loops/<model>/

Each model folder holds `forward.onnx`, `golden.npz` and `meta.json` (tests/data/loops/README.md says
what is in them); tests/test_loop_goldens.py trains odtrain along them without torch. The script also
runs README's "Exporting one from PyTorch" block as written and keeps the two files it writes in
tests/data/loops/readme/, which the tests load and train. The models, with how each export gives its
control flow:

- `gru_scan`: a `nn.GRUCell` run over the time axis by `torch._higher_order_ops.scan`, exported with
  `torch.onnx.export(..., dynamo=True)`: an ONNX `Scan` whose body is PyTorch's GRU cell;
  `gru_scan_unoptimized` the same with `optimize=False`: the gates' chunks are `SplitToSequence` and
  `SequenceAt` in the body;
- `mamba_scan`: a Mamba-style selective scan (input-dependent Δ, B, C; A = −exp(A_log); projections
  before and after), its recurrence a `scan`, exported as above: a `Scan`;
- `mamba_loop`: the same model as a Python `for` loop appending to a list, `torch.jit.script`-ed and
  exported by the TorchScript exporter (`dynamo=False`): a `Loop` that inserts each step's output into
  a sequence, `ConcatFromSequence` after it (how users export a Mamba block's loop today);
- `cond`: `torch.cond` on the sign of the batch's mean, exported with `dynamo=True`: an `If` whose
  branches read weights from outside; the batches alternate signs, so both branches train;
- `frozen_loop`: a scripted `for`-loop RNN encoder (a `Loop`) whose weights stay frozen, under a
  trainable head (`frozen_params` in meta.json).

Every model trains 5 SGD and 5 AdamW steps (ONNX Runtime's AdamW, odtrain's default settings: betas
0.9/0.999, eps 1e-6 added to √v, bias correction, no weight decay) on an MSE loss, from the weights
the file holds. The golden is the float64 run from those float32 weights; the float32 run measures how
far PyTorch's own float32 arithmetic lands from it (`float32_loss_error` in meta.json). The reference
runs evaluate the models eagerly (the `scan` model's Python-loop twin: one function, checked equal
before export), so the golden does not depend on how torch lowers a higher-order op.
"""
from __future__ import annotations

import json
import pathlib
import warnings
from typing import List

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

from torch_optimizers import ADAMW, SGD, AdamWLikeOnnxRuntime  # benchmarks/, this script's folder

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "loops"
STEPS = 5
SGD_LR, ADAMW_LR = 0.1, 1e-2
T, BATCH, INPUT, HIDDEN, STATE, OUTPUT = 6, 4, 3, 5, 3, 2


class GRUHead(torch.nn.Module):
    """hT of a GRU cell over x [T, B, INPUT] (its recurrence a scan, or the same cell in a Python loop), then
    a Linear head: [B, OUTPUT]."""

    def __init__(self, use_scan: bool = True):
        super().__init__()
        self.cell = torch.nn.GRUCell(INPUT, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUTPUT)
        self.use_scan = use_scan

    def forward(self, x):
        h = torch.zeros(x.shape[1], HIDDEN, dtype=x.dtype)
        if self.use_scan:
            def step(carry, x_t):
                carry = self.cell(x_t, carry)
                return carry, carry.clone()  # scan's outputs may not alias its carry

            h, _ = scan(step, h, x)
        else:
            for t in range(x.shape[0]):
                h = self.cell(x[t], h)
        return self.head(h)


class Mamba(torch.nn.Module):
    """A Mamba-style selective scan over x [B, T, INPUT] -> [B, OUTPUT] (the mean over time of the output
    projection): u = x·W_in, Δ = softplus(u·W_Δ + b_Δ), B = u·W_B, C = u·W_C, A = −exp(A_log),
    h_t = exp(Δ_t·A)·h_{t−1} + Δ_t·B_t·u_t, y_t = Σ_n h_t·C_t."""

    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(INPUT, HIDDEN)
        self.dt_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.B_proj = torch.nn.Linear(HIDDEN, STATE, bias=False)
        self.C_proj = torch.nn.Linear(HIDDEN, STATE, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, STATE + 1, dtype=torch.float32).repeat(HIDDEN, 1)))
        self.out_proj = torch.nn.Linear(HIDDEN, OUTPUT)

    def projections(self, x):
        u = self.in_proj(x)
        return u, F.softplus(self.dt_proj(u)), self.B_proj(u), self.C_proj(u), -torch.exp(self.A_log)


class MambaScan(Mamba):
    def forward(self, x):
        u, dt, b, c, a = self.projections(x)

        def step(h, rows):
            u_t, dt_t, b_t, c_t = rows
            h = torch.exp(dt_t.unsqueeze(-1) * a) * h + dt_t.unsqueeze(-1) * b_t.unsqueeze(1) * u_t.unsqueeze(-1)
            return h, (h * c_t.unsqueeze(1)).sum(-1)

        h0 = torch.zeros(x.shape[0], HIDDEN, STATE, dtype=x.dtype)
        _, y = scan(step, h0, [r.transpose(0, 1) for r in (u, dt, b, c)])  # scan runs over the first axis
        return self.out_proj(y.transpose(0, 1)).mean(1)


class MambaLoop(Mamba):
    def forward(self, x):
        u, dt, b, c, a = self.projections(x)
        h = torch.zeros(x.shape[0], self.A_log.shape[0], self.A_log.shape[1], dtype=x.dtype)  # script: no globals
        ys: List[torch.Tensor] = []
        for t in range(x.shape[1]):
            dt_t = dt[:, t].unsqueeze(-1)
            h = torch.exp(dt_t * a) * h + dt_t * b[:, t].unsqueeze(1) * u[:, t].unsqueeze(-1)
            ys.append((h * c[:, t].unsqueeze(1)).sum(-1))
        return self.out_proj(torch.stack(ys, 1)).mean(1)


class Cond(torch.nn.Module):
    """x [B, INPUT]: tanh(x·W_a) when the batch's mean is positive, else 2·relu(x·W_b); a Linear head."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(INPUT, HIDDEN)
        self.b = torch.nn.Linear(INPUT, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUTPUT)

    def forward(self, x):
        hidden = torch.cond(x.mean() > 0, lambda v: torch.tanh(self.a(v)), lambda v: torch.relu(self.b(v)) * 2, (x,))
        return self.head(hidden)


class FrozenLoop(torch.nn.Module):
    """An Elman RNN encoder over x [B, T, INPUT] as a scripted for loop (frozen), then a trainable head."""

    def __init__(self):
        super().__init__()
        self.encoder_in = torch.nn.Linear(INPUT, HIDDEN)
        self.encoder_rec = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = torch.nn.Linear(HIDDEN, OUTPUT)

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.encoder_rec.weight.shape[0], dtype=x.dtype)  # script: no globals
        for t in range(x.shape[1]):
            h = torch.tanh(self.encoder_in(x[:, t]) + self.encoder_rec(h))
        return self.head(h)


def batches(shape, seed: int, alternate_sign: bool = False):
    """STEPS inputs of `shape` and targets [.., OUTPUT]; with `alternate_sign`, even steps' means positive, odd
    negative (well away from 0, so float32 and float64 take the same branch)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS, *shape)).astype(np.float32)
    if alternate_sign:
        x += np.where(np.arange(STEPS) % 2 == 0, 0.5, -0.5).astype(np.float32).reshape(-1, *[1] * len(shape))
    batch = shape[1] if len(shape) == 3 and shape[0] == T else shape[0]
    return x, rng.standard_normal((STEPS, batch, OUTPUT)).astype(np.float32)


def trajectory(model, x, y, optimizer: str, trainable: list[str]) -> np.ndarray:
    """The losses of STEPS steps (each before its update) training the parameters named `trainable`."""
    params = dict(model.named_parameters())
    chosen = [params[n] for n in trainable]
    for name, p in params.items():
        p.requires_grad_(name in trainable)
    opt = SGD(chosen, SGD_LR) if optimizer == "sgd" else AdamWLikeOnnxRuntime(chosen, ADAMW_LR)
    dtype = next(model.parameters()).dtype
    losses = []
    for step in range(STEPS):
        for p in chosen:
            p.grad = None
        out = model(torch.from_numpy(x[step]).to(dtype))
        loss = F.mse_loss(out, torch.from_numpy(y[step]).to(dtype))
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return np.array(losses)


def goldens(make_reference, x, y, trainable) -> tuple[dict, dict]:
    """golden.npz's arrays and meta.json's per-optimizer entries: float64 losses (the golden), float32
    losses, and the float32 run's largest relative distance from the float64 one."""
    arrays, meta = {"x": x, "y": y}, {}
    for optimizer, lr in (("sgd", SGD_LR), ("adamw", ADAMW_LR)):
        runs = {dtype: trajectory(make_reference().to(dtype), x, y, optimizer, trainable)
                for dtype in (torch.float64, torch.float32)}
        arrays[f"{optimizer}_losses"] = runs[torch.float64]
        arrays[f"{optimizer}_losses_float32"] = runs[torch.float32].astype(np.float32)
        error = float(np.max(np.abs(runs[torch.float32] - runs[torch.float64]) / np.abs(runs[torch.float64])))
        meta[optimizer] = {"lr": lr, "float32_loss_error": error}
    return arrays, meta


def export_dynamo(model, x, path, optimize: bool = True) -> None:
    """torch.onnx.export(..., dynamo=True), at its default optimize=True unless told."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), dynamo=True, verbose=False, optimize=optimize).save(str(path))


def export_dynamo_unoptimized(model, x, path) -> None:
    """The dynamo exporter with optimize=False: its optimizer would fold A = −exp(A_log) into a constant (A_log
    would leave the parameters)."""
    export_dynamo(model, x, path, optimize=False)


def export_scripted(model, x, path) -> None:
    """torch.jit.script, then the TorchScript exporter at opset 17 in training mode, parameters kept by name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(model), (torch.from_numpy(x),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["out"], do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING)


def strip_metadata(path) -> None:
    """Drop each node's doc string and metadata (the dynamo exporter's FX text and stack traces): kilobytes, not
    tens of them."""
    proto = onnx.load(str(path))

    def strip(graph):
        for node in graph.node:
            node.doc_string = ""
            del node.metadata_props[:]
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    strip(attribute.g)

    strip(proto.graph)
    onnx.save(proto, str(path))


def onnx_names(model, path) -> dict[str, str]:
    """torch parameter name -> the file's initializer holding its value (the same name, or the exporter's)."""
    found = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    names = {}
    for name, p in model.named_parameters():
        value = p.detach().numpy()
        match = [k for k, v in found.items() if v.shape == value.shape and np.array_equal(v, value) or
                 v.ndim == 2 and v.shape == value.T.shape and np.array_equal(v, value.T)]  # a Linear's, transposed
        if name in found:
            match = [name]
        if len(match) != 1:
            raise SystemExit(f"{path}: {name} is not one initializer of the file ({match})")
        names[name] = match[0]
    return names


def export_error(model, path, x) -> float:
    """The largest distance of onnx.reference's outputs of the file from torch's, on every batch."""
    from onnx.reference import ReferenceEvaluator

    proto = onnx.load(str(path))
    session = ReferenceEvaluator(proto)
    with torch.no_grad():
        return max(float(np.max(np.abs(session.run(None, {proto.graph.input[0].name: batch})[0] -
                                       model(torch.from_numpy(batch)).numpy()))) for batch in x)


MODELS = {
    # name: (make the exported module, make its eager twin for the goldens, export, input shape, trainable: None
    # for every parameter, else the trained ones, the rest frozen)
    "gru_scan": (GRUHead, lambda: GRUHead(use_scan=False), export_dynamo, (T, BATCH, INPUT), None),
    "mamba_scan": (MambaScan, MambaLoop, export_dynamo_unoptimized, (BATCH, T, INPUT), None),
    "mamba_loop": (MambaLoop, MambaLoop, export_scripted, (BATCH, T, INPUT), None),
    "cond": (Cond, Cond, export_dynamo, (BATCH, INPUT), None),
    "frozen_loop": (FrozenLoop, FrozenLoop, export_scripted, (BATCH, T, INPUT), ["head.weight", "head.bias"]),
    "gru_scan_unoptimized": (GRUHead, lambda: GRUHead(use_scan=False), export_dynamo_unoptimized, (T, BATCH, INPUT),
                             None),
}


def write_model(name: str, seed: int) -> dict:
    make, make_reference, export, shape, trainable = MODELS[name]
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def reference():
        twin = make_reference()
        twin.load_state_dict(state)
        return twin

    x, y = batches(shape, seed, alternate_sign=name == "cond")
    path = folder / "forward.onnx"
    export(model, x[0], path)
    strip_metadata(path)
    names = onnx_names(model, path)
    trainable = trainable or list(names)
    arrays, runs = goldens(reference, x, y, trainable)
    with torch.no_grad():  # the eager twin is the exported function
        twin_error = max(float(torch.max(torch.abs(model(torch.from_numpy(b)) - reference()(torch.from_numpy(b)))))
                         for b in x)
    proto = onnx.load(str(path))
    meta = {"name": name, "export": export.__name__, "input": proto.graph.input[0].name,
            "output": proto.graph.output[0].name, "input_shape": list(shape), "steps": STEPS,
            "loss": "MSELoss (mean)", "requires_grad": [names[n] for n in trainable],
            "frozen_params": [v for k, v in names.items() if k not in trainable],
            "onnx_names": {k: v for k, v in names.items() if k != v}, "adamw_settings": ADAMW, **runs,
            "export_max_abs_error": export_error(model, path, x), "twin_max_abs_error": twin_error,
            "control_flow": sorted({n.op_type for n in proto.graph.node if n.op_type in ("If", "Loop", "Scan")}),
            "torch": torch.__version__, "onnx": onnx.__version__}
    np.savez_compressed(folder / "golden.npz", **arrays)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def readme_exports() -> list[str]:
    """Runs README's "Exporting one from PyTorch" block as written, in a scratch folder, and keeps the files it
    writes in tests/data/loops/readme/ (tests/test_loop_goldens.py runs them); returns their control-flow ops."""
    import contextlib
    import os
    import re
    import runpy
    import tempfile

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class Encoder(torch.nn.Module)" in b]
    folder = OUT / "readme"
    folder.mkdir(parents=True, exist_ok=True)
    found = []
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        pathlib.Path("readme_block.py").write_text(block)  # torch.jit.script reads a module's source from its file
        runpy.run_path("readme_block.py")
        for name in ("loop.onnx", "cond.onnx"):
            strip_metadata(name)
            proto = onnx.load(name)
            found.append(f"{name}: {sorted({n.op_type for n in proto.graph.node} & {'If', 'Loop', 'Scan'})}")
            os.replace(name, folder / name)
    return found


def main() -> None:
    for seed, name in enumerate(MODELS):
        meta = write_model(name, seed)
        print(name, json.dumps({k: meta[k] for k in ("control_flow", "sgd", "adamw", "export_max_abs_error",
                                                     "twin_max_abs_error")}))
    print("README:", ", ".join(readme_exports()))


if __name__ == "__main__":
    main()
