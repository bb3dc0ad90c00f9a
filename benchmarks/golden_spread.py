"""The measured bounds behind the golden tests' tolerances: how far float32 runs of the reference models'
training trajectories stray from float64 and from each other, and how far a 1% learning-rate change
moves them.

For every model of tests/data and both optimizers of its golden trajectory (SGD; ONNX Runtime's AdamW:
eps added to sqrt(v), bias correction; settings from meta.json), the golden batches are replayed
- in PyTorch, the ONNX graph run op by op by compare.py's `torch_ops`, in float64 and in float32 (one and
  two threads), with the learning rate as given and 1% higher (float64 and float32);
- in odtrain (a separate python, `--odtrain-python`), once per OPENBLAS_CORETYPE of `--core-types` and
  thread count of `--threads` (ODTRAIN_NUM_THREADS), and once with the learning rate 1% higher.
Each run is measured three ways, the three checks of the golden tests:
- loss: the largest relative difference, over the steps, of its losses from golden.npz's (PyTorch float32)
  and from the float64 run's;
- grad: step 0's gradients against golden.npz's grad64, per parameter ‖g - g64‖ / max(‖g64‖, 1e-4·‖all of
  g64‖) (tests/data's README measure), the worst parameter;
- update: the first optimizer update Δw = w1 - w0 against the float64 update computed from grad64 by the
  same optimizer, ‖Δw - Δw64‖ / ‖Δw64‖ over all trainable parameters. A learning rate 1% off moves it by
  1e-2 whatever the model; a loss moves by far less under SGD.

`--attribute MODEL` finds which parameters' float32 gradient noise moves a trajectory: it runs the float64
trajectory, takes at every step the float32 gradient at the same parameters, then reruns the float64
trajectory once per parameter with only that parameter's float32-minus-float64 gradient difference added,
for SGD and AdamW, and prints how far each rerun's losses move.

From the repository root (REFERENCE_VENV holds torch and onnx, as ../shared/COMPARE.md sets it up; odtrain runs
in its own venv):

    REFERENCE_VENV/bin/python benchmarks/golden_spread.py --odtrain-python .venv/bin/python --json spread.json
    REFERENCE_VENV/bin/python benchmarks/golden_spread.py --attribute cnn
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
MODELS = ("mlp", "cnn", "transformer", "mobilenetv2_personalize", "mobilenetv2_full")
OPTIMIZERS = ("sgd", "adamw")
LR_MUTANT = 1.01  # the learning rate 1% too high, which every golden test must be able to fail


def load(name):
    """(meta, golden) of a reference model in tests/data."""
    return json.loads((DATA / name / "meta.json").read_text()), np.load(DATA / name / "golden.npz")


def batch(meta, golden, step):
    """Step's (x, y): image batches are stored as float16, the goldens were computed from their float32 cast."""
    return np.ascontiguousarray(golden["x"][step], meta["input_dtype"]), np.asarray(golden["y"][step], np.int64)


def optimizer_step(kind, settings, lr, t, w, g, m, v, sqrt):
    """(w, m, v) after optimizer step t (1-based) on numpy arrays or torch tensors (`sqrt` of that library):
    SGD w - lr·g; ONNX Runtime's AdamW w - lr·√(1-β2ᵗ)/(1-β1ᵗ)·m/(√v + ε), then w - lr·λ·w."""
    if kind == "sgd":
        return w - lr * g, m, v
    b1, b2, eps, decay = settings["beta1"], settings["beta2"], settings["eps"], settings["weight_decay"]
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if settings["bias_correction"] else lr
    w = w - step_size * m / (sqrt(v) + eps)
    return w - lr * decay * w, m, v


# ---------------------------------------------------------------- measures
def loss_difference(losses, reference):
    """The largest relative difference of a trajectory's losses from a reference's, over the steps."""
    losses, reference = np.asarray(losses, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(losses - reference) / np.abs(reference)))


def gradient_error(grads, golden, names):
    """(worst parameter, its error): ‖g - g64‖ / max(‖g64‖, 1e-4·‖all of g64‖) against golden's grad64."""
    expected = {n: golden[f"grad64/{n}"].astype(np.float64) for n in names}
    floor = 1e-4 * math.sqrt(sum(float(np.sum(g ** 2)) for g in expected.values()))
    errors = {n: float(np.linalg.norm(grads[n] - g) / max(np.linalg.norm(g), floor)) for n, g in expected.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def expected_first_update(kind, meta, golden, initial):
    """Δw64 of the first step from golden's float64 gradients, every trainable parameter concatenated."""
    names = meta["requires_grad"]
    w0 = np.concatenate([initial[n].astype(np.float64).ravel() for n in names])
    g64 = np.concatenate([golden[f"grad64/{n}"].astype(np.float64).ravel() for n in names])
    zeros = np.zeros_like(w0)
    w1, _, _ = optimizer_step(kind, meta[kind], meta[kind]["lr"], 1, w0, g64, zeros, zeros, np.sqrt)
    return w1 - w0


def update_error(update, expected):
    return float(np.linalg.norm(update - expected) / np.linalg.norm(expected))


# ---------------------------------------------------------------- PyTorch
class TorchModel:
    """A reference model's ONNX graph as a PyTorch function of its trainable parameters, in one dtype."""

    def __init__(self, name, dtype, threads=1):
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from compare import torch_ops, torch_program

        torch.set_num_threads(threads)
        self.torch, self.dtype = torch, getattr(torch, dtype)
        self.meta, self.golden = load(name)
        self.program = torch_program(SimpleNamespace(models=DATA, workload=name))
        self.ops = torch_ops()
        self.env = {k: self._tensor(v) for k, v in self.program["consts"].items()}  # copies: BatchNorm updates its running statistics in place
        self.names = self.meta["requires_grad"]
        for n in self.names:
            self.env[n].requires_grad_(True)

    def _tensor(self, value):
        t = self.torch.tensor(np.asarray(value))
        return t.to(self.dtype) if t.is_floating_point() else t

    def parameters(self):
        """The trainable parameters as float64 numpy arrays."""
        return {n: self.env[n].detach().to(self.torch.float64).numpy().copy() for n in self.names}

    def assign(self, values):
        with self.torch.no_grad():
            for n in self.names:
                self.env[n].copy_(self.torch.from_numpy(np.asarray(values[n])))

    def loss_and_gradients(self, step):
        """Step's loss (float) and the gradients of the trainable parameters (float64 numpy arrays)."""
        torch = self.torch
        x, y = batch(self.meta, self.golden, step)
        env = dict(self.env, **{self.program["input"]: self._tensor(x)})
        for op, ins, out, attrs in self.program["nodes"]:
            env[out] = self.ops[op](attrs, *[env[i] if i else None for i in ins])
        loss = torch.nn.functional.cross_entropy(env[self.program["output"]], torch.from_numpy(y))
        grads = torch.autograd.grad(loss, [self.env[n] for n in self.names])
        return float(loss.detach()), {n: g.to(torch.float64).numpy() for n, g in zip(self.names, grads)}

    def replay(self, kind, lr_scale=1.0, gradient_noise=None):
        """The golden batches trained with `kind`: {losses, gradients of step 0, first update (float64)}.
        `gradient_noise(step, gradients)` may change each step's gradients before the update."""
        torch, settings = self.torch, self.meta[kind]
        lr = settings["lr"] * lr_scale
        moments = {n: (torch.zeros_like(self.env[n]), torch.zeros_like(self.env[n])) for n in self.names}
        losses, first, before = [], None, None
        for step in range(len(self.golden[f"{kind}_losses"])):
            loss, grads = self.loss_and_gradients(step)
            losses.append(loss)
            if gradient_noise is not None:
                grads = gradient_noise(step, grads)
            if step == 0:
                first, before = grads, self.parameters()
            with torch.no_grad():
                for n in self.names:
                    g = torch.from_numpy(grads[n]).to(self.dtype)
                    w, m, v = optimizer_step(kind, settings, lr, step + 1, self.env[n], g, *moments[n], torch.sqrt)
                    self.env[n].copy_(w)
                    moments[n] = (m, v)
            if step == 0:
                after = self.parameters()
                update = np.concatenate([(after[n] - before[n]).ravel() for n in self.names])
        return {"losses": losses, "gradients": first, "update": update, "initial": before}


def torch_run(name, kind, dtype, lr_scale=1.0, threads=1):
    return TorchModel(name, dtype, threads).replay(kind, lr_scale)


# ---------------------------------------------------------------- odtrain (runs in --odtrain-python)
def odtrain_worker(name, kind, lr_scale, out):
    """Train the golden batches with odtrain's generated artifacts; save losses, step-0 gradients and the
    first update to `out` (npz)."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer

    meta, golden = load(name)
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        artifacts.generate_artifacts(str(DATA / name / "forward.onnx"), requires_grad=meta["requires_grad"],
                                     frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=getattr(artifacts.OptimType, "SGD" if kind == "sgd" else "AdamW"),
                                     artifact_directory=directory)
        state = CheckpointState.load_checkpoint(directory / "checkpoint")
        module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
        optimizer = Optimizer(directory / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(meta[kind]["lr"] * lr_scale)
        module.train()
        names, losses, saved = meta["requires_grad"], [], {}
        for step in range(len(golden[f"{kind}_losses"])):
            losses.append(float(module(*batch(meta, golden, step))))
            if step == 0:
                before = {n: state.parameters[n].data.astype(np.float64) for n in names}
                saved = {f"grad/{n}": state.parameters[n].grad for n in names}
            optimizer.step()
            module.lazy_reset_grad()
            if step == 0:
                saved["update"] = np.concatenate([(state.parameters[n].data - before[n]).ravel() for n in names])
    np.savez(out, losses=np.array(losses), **saved)


def odtrain_run(args, name, kind, core_type, threads, lr_scale=1.0):
    """One odtrain run in a fresh process under OPENBLAS_CORETYPE and ODTRAIN_NUM_THREADS."""
    env = dict(os.environ, OPENBLAS_CORETYPE=core_type, ODTRAIN_NUM_THREADS=str(threads), OPENBLAS_VERBOSE="2")
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):  # odtrain leaves BLAS alone when these are set
        env.pop(variable, None)
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "run.npz"
        p = subprocess.run([args.odtrain_python, __file__, "--worker", name, kind, repr(lr_scale), str(out)],
                           capture_output=True, text=True, env=env, timeout=args.timeout)
        if p.returncode:
            raise RuntimeError(f"odtrain {name} {kind} {core_type}/{threads}: exit {p.returncode}\n{p.stderr[-3000:]}")
        kernels = sorted({line.split(":", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("Core:")})
        with np.load(out) as run:
            return {"losses": list(run["losses"]), "update": run["update"].astype(np.float64),
                    "gradients": {n[5:]: run[n].astype(np.float64) for n in run.files if n.startswith("grad/")},
                    "blas": ",".join(kernels)}


# ---------------------------------------------------------------- the table
def measure(args, name, kind):
    """Every run of one golden trajectory and its three measures, as rows."""
    meta, golden = load(name)
    golden_losses = golden[f"{kind}_losses"]
    runs = {"torch float64": torch_run(name, kind, "float64", threads=2),
            "torch float64 lr+1%": torch_run(name, kind, "float64", LR_MUTANT, threads=2)}
    for threads in (1, 2):
        runs[f"torch float32 {threads} thread"] = torch_run(name, kind, "float32", threads=threads)
    runs["torch float32 lr+1%"] = torch_run(name, kind, "float32", LR_MUTANT)
    expected = expected_first_update(kind, meta, golden, runs["torch float64"]["initial"])
    if args.odtrain_python:
        for core_type in args.core_types.split(","):
            for threads in map(int, args.threads.split(",")):
                runs[f"odtrain {core_type} {threads} thread"] = odtrain_run(args, name, kind, core_type, threads)
        core_type, threads = args.core_types.split(",")[0], int(args.threads.split(",")[0])
        runs[f"odtrain {core_type} {threads} thread lr+1%"] = odtrain_run(args, name, kind, core_type, threads, LR_MUTANT)
    reference = runs["torch float64"]["losses"]
    rows = [{"model": name, "optimizer": kind, "run": "golden (PyTorch float32)", "loss_vs_golden": 0.0,
             "loss_vs_float64": loss_difference(golden_losses, reference)}]
    for label, run in runs.items():
        worst, grad = gradient_error(run["gradients"], golden, meta["requires_grad"])
        rows.append({"model": name, "optimizer": kind, "run": label, "blas": run.get("blas", ""),
                     "loss_vs_golden": loss_difference(run["losses"], golden_losses),
                     "loss_vs_float64": loss_difference(run["losses"], reference),
                     "grad": grad, "grad_worst": worst, "update": update_error(run["update"], expected),
                     "losses": [float(v) for v in run["losses"]]})
        if label.endswith("lr+1%"):  # the mutant against the same system at the right learning rate
            base = runs["torch float64" if "float64" in label else "torch float32 1 thread" if "torch" in label
                        else label[:-len(" lr+1%")]]
            rows[-1]["loss_vs_same_system"] = loss_difference(run["losses"], base["losses"])
        print(format_row(rows[-1]), flush=True)
    return rows


COLUMNS = [("model", "{}", 24), ("optimizer", "{}", 6), ("run", "{}", 34), ("loss_vs_golden", "{:.1e}", 9),
           ("loss_vs_float64", "{:.1e}", 9), ("loss_vs_same_system", "{:.1e}", 9), ("grad", "{:.1e}", 8),
           ("update", "{:.1e}", 8), ("grad_worst", "{}", 28), ("blas", "{}", 10)]
HEADER = ["model", "opt", "run", "loss/gold", "loss/f64", "loss/base", "grad", "update", "worst gradient", "BLAS"]


def format_row(row):
    return " ".join((fmt.format(row[key]) if row.get(key) not in (None, "") else "-").ljust(width)
                    for key, fmt, width in COLUMNS)


# ---------------------------------------------------------------- attribution
def attribute(name):
    """Which parameters' float32 gradient noise moves the trajectory, under SGD and AdamW."""
    for kind in OPTIMIZERS:
        model64, model32 = TorchModel(name, "float64", 2), TorchModel(name, "float32", 2)
        noise = []

        def record(step, grads):  # the float32 gradient at the float64 run's parameters
            model32.assign(model64.parameters())
            _, grads32 = model32.loss_and_gradients(step)
            noise.append({n: grads32[n] - grads[n] for n in grads})
            return grads

        reference = model64.replay(kind, gradient_noise=record)
        float32 = TorchModel(name, "float32", 2).replay(kind)["losses"]
        print(f"\n{name} {kind}: float32 run vs float64 {loss_difference(float32, reference['losses']):.1e}")
        rows = []
        for target in [None] + model64.names:
            def add_noise(step, grads, target=target):
                return {n: g + noise[step][n] if target in (None, n) else g for n, g in grads.items()}

            losses = TorchModel(name, "float64", 2).replay(kind, gradient_noise=add_noise)["losses"]
            g0, e0 = reference["gradients"][target or model64.names[0]], noise[0][target or model64.names[0]]
            rows.append((target or "(every parameter)", loss_difference(losses, reference["losses"]),
                         g0.size, float(np.median(np.abs(g0))), float(np.linalg.norm(e0) / np.linalg.norm(g0))))
        print(f"{'float32 gradient noise on':34} {'moves loss':>10} {'size':>8} {'median |g0|':>11} {'noise/|g0|':>10}")
        for target, moved, size, median, relative in rows[:1] + sorted(rows[1:], key=lambda r: -r[1]):
            print(f"{target:34} {moved:10.1e} {size:8d} {median:11.1e} {relative:10.1e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--odtrain-python", help="a python with odtrain installed; without it only PyTorch runs")
    p.add_argument("--core-types", default="Haswell,Zen,Sandybridge", help="OPENBLAS_CORETYPE values")
    p.add_argument("--threads", default="1,2", help="ODTRAIN_NUM_THREADS values")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per odtrain process")
    p.add_argument("--json", help="write every row, losses included, here")
    p.add_argument("--attribute", metavar="MODEL", help="attribute a model's float32 spread to its parameters")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        name, kind, lr_scale, out = args.worker
        return odtrain_worker(name, kind, float(lr_scale), out)
    if args.attribute:
        return attribute(args.attribute)
    print(" ".join(h.ljust(w) for h, (_, _, w) in zip(HEADER, COLUMNS)))
    rows, start = [], time.time()
    for name in args.models.split(","):
        for kind in args.optimizers.split(","):
            rows += measure(args, name, kind)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
