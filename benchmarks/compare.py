"""Side-by-side training benchmark: odtrain vs ONNX Runtime training 1.19.2 vs PyTorch.

Every measurement runs in a fresh subprocess, systems alternating; one run prints a table with the
ratios odtrain / ONNX Runtime and odtrain / PyTorch.

Reference environment, outside the project and never a dependency of odtrain (do not install the
`onnxruntime` inference package into it: it overwrites the training build's files):

    python3 -m venv /work/ortref
    /work/ortref/bin/pip install numpy onnx onnxruntime-training-cpu==1.19.2 torch==2.13.0

Run from the repository root, with odtrain installed in the current python (`pip install -e .`):

    python benchmarks/compare.py --workload mlp --steps 50 --ort-python /work/ortref/bin/python
    python benchmarks/compare.py --workload cnn --systems ort,torch --repeat 3 \\
        --ort-python /work/ortref/bin/python --json cnn.json

Workloads are the folders of shared/models (mlp, cnn, transformer, mobilenetv2_personalize,
mobilenetv2_full): forward.onnx, meta.json (input dtype, requires_grad, frozen_params, AdamW lr)
and golden.npz (x/y, one batch per step, reused cyclically; x cast to meta's input dtype).

Systems (--systems, comma-separated):
  odtrain    odtrain.artifacts + odtrain.api, run with a fresh NUMBA_CACHE_DIR (cold) and again
             with the same one (warm); the ratios use the warm run.
  ort        onnxruntime.training with `torch` blocked: the runtime alone.
  ort_torch  the same with a plain `import onnxruntime.training.api`, which imports torch.
  torch      PyTorch eager: the ONNX graph interpreted with torch ops (_torch_ops, enough for all
             five workloads), torch.optim.AdamW(lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0),
             CrossEntropyLoss. Its "checkpoint" is a pickle of the graph and initializers.
odtrain and ort run the same worker code; only the imported package differs. Artifacts are made
in a separate process first, for ONNX Runtime with its workarounds: a ModelProto instead of a path,
Mean/InvStdDev outputs on LayerNormalization nodes, ir_version=8 on the generated files.

Threads: ONNX Runtime keeps its default intra-op pool (one thread per physical core), PyTorch gets
torch.set_num_threads(--threads, default 2), odtrain keeps its defaults. On the 2-core reference
machine that is 2 threads for each.

Per run: import time (for torch including the one-off import that the first AdamW() triggers);
session creation (load checkpoint + Module + Optimizer); the first step once the session is ready;
process start to first completed step; median step after --warmup steps (forward + backward +
optimizer); peak RSS (ru_maxrss); RSS added by training (peak from Module creation to the end,
reset through /proc/self/clear_refs, minus the RSS after loading the checkpoint and the data);
and the largest relative loss difference to golden.npz's adamw_losses, as a sanity check.
"""
import argparse
import importlib
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"


# ---------------------------------------------------------------- worker side
def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def checkpoint_loaded(state):
    """Right after the checkpoint is loaded: note RSS and peak so far, then reset the peak."""
    state["base"], state["peak"] = rss_kib(), peak_kib()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        state["reset"] = True
    except OSError:
        state["reset"] = False


def load_workload(args):
    import numpy as np
    folder = Path(args.models) / args.workload
    meta = json.loads((folder / "meta.json").read_text())
    g = np.load(folder / "golden.npz")
    batches = [(np.ascontiguousarray(x, dtype=meta["input_dtype"]), np.ascontiguousarray(y, np.int64))
               for x, y in zip(g["x"], g["y"])]
    return folder, meta, batches, [float(v) for v in g["adamw_losses"]]


def train_loop(args, t_import, golden, open_session, step):
    """open_session() loads the checkpoint, calls checkpoint_loaded(state) and returns the session;
    step(session, i) runs one training step and returns the loss."""
    state = {}
    t0 = time.perf_counter()
    session = open_session(state)
    t_session = time.perf_counter() - t0
    losses, times, t_first = [], [], None
    for i in range(args.steps):
        t = time.perf_counter()
        loss = step(session, i)
        times.append(time.perf_counter() - t)
        t_first = t_first or time.time()
        losses.append(float(loss))
    peak = peak_kib()
    warm = times[args.warmup:] or times
    return {
        "import_s": t_import, "session_s": t_session, "first_step_s": times[0],
        "start_to_first_step_s": t_first - args.t0, "median_step_ms": 1e3 * statistics.median(warm),
        "peak_rss_mib": max(peak, state["peak"]) / 1024, "base_rss_mib": state["base"] / 1024,
        "train_rss_mib": (peak - state["base"]) / 1024 if state["reset"] else None,
        "loss0": losses[0], "loss_last": losses[-1],
        "golden_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, golden)),
    }


def prepare_api(args, pkg):
    """Generate artifacts with `pkg`.artifacts (odtrain or onnxruntime.training)."""
    import onnx
    artifacts = importlib.import_module(pkg + ".artifacts")
    folder = Path(args.models) / args.workload
    meta = json.loads((folder / "meta.json").read_text())
    model, is_ort = str(folder / "forward.onnx"), pkg.startswith("onnxruntime")
    if is_ort:  # ONNX Runtime: ModelProto, LayerNorm gradient needs the optional outputs
        model = onnx.load(model)
        for node in model.graph.node:
            if node.op_type == "LayerNormalization" and len(node.output) == 1:
                node.output.extend([node.output[0] + "_mean", node.output[0] + "_invstddev"])
    artifacts.generate_artifacts(
        model, requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=args.artifacts)
    for f in Path(args.artifacts).glob("*.onnx") if is_ort else ():
        m = onnx.load(str(f))
        m.ir_version = 8  # it refuses IR > 10
        for node in m.graph.node:  # its eval model keeps 3 outputs on inference-mode BatchNorms
            if node.op_type == "BatchNormalization" and not any(
                    a.name == "training_mode" and a.i for a in node.attribute):
                del node.output[1:]
        onnx.save(m, str(f))


def run_api(args, pkg, block_torch):
    t_start = time.perf_counter()
    if block_torch:  # onnxruntime/training/__init__.py imports torch: load only its api subpackage
        import types
        from importlib.util import find_spec
        sys.modules["torch"] = None
        stub = types.ModuleType(pkg)
        stub.__path__ = list(find_spec(pkg).submodule_search_locations)
        sys.modules[pkg] = stub
    api = importlib.import_module(pkg + ".api")
    t_import = time.perf_counter() - t_start
    _, meta, batches, golden = load_workload(args)
    art = Path(args.artifacts)

    def open_session(state):
        ckpt = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
        checkpoint_loaded(state)
        module = api.Module(str(art / "training_model.onnx"), ckpt, str(art / "eval_model.onnx"))
        optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(meta["adamw"]["lr"])
        return module.train(), optimizer

    def step(session, i):
        module, optimizer = session
        loss = module(*batches[i % len(batches)])
        optimizer.step()
        module.lazy_reset_grad()
        return loss

    return train_loop(args, t_import, golden, open_session, step)


def prepare_torch(args):
    import onnx
    from onnx import helper, numpy_helper
    g = onnx.load(str(Path(args.models) / args.workload / "forward.onnx")).graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes = []
    for n in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        attrs = {k: numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v
                 for k, v in attrs.items()}
        if n.op_type == "Constant":
            consts[n.output[0]] = attrs["value"]
        else:
            nodes.append((n.op_type, list(n.input), n.output[0], attrs))
    with open(Path(args.artifacts) / "torch_model.pkl", "wb") as f:
        pickle.dump({"nodes": nodes, "consts": consts, "input": g.input[0].name,
                     "output": g.output[0].name}, f)


def _torch_ops():
    """ONNX op -> torch, for the ops of the reference models (2-D convolutions, symmetric pads)."""
    import torch
    import torch.nn.functional as F

    def gemm(a, A, B, C=None):
        A, B = A.t() if a.get("transA") else A, B if a.get("transB") else B.t()
        if a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0:
            return F.linear(A, B, C)
        return a.get("alpha", 1.0) * F.linear(A, B) + (0 if C is None else a.get("beta", 1.0) * C)

    def pads(a, n):
        p = a.get("pads", [0] * 2 * n)
        assert p[:n] == p[n:], "asymmetric padding is not supported"
        return p[:n]

    def gather(a, x, i):
        ax = a.get("axis", 0) % x.dim()
        return torch.index_select(x, ax, i.reshape(-1)).reshape(x.shape[:ax] + i.shape + x.shape[ax + 1:])

    def unsqueeze(a, x, axes):
        for ax in sorted(v % (x.dim() + len(axes)) for v in axes.tolist()):
            x = x.unsqueeze(ax)
        return x

    inf = float("inf")
    return {
        "Gemm": gemm, "Gather": gather, "Unsqueeze": unsqueeze,
        "Conv": lambda a, x, w, b=None: F.conv2d(x, w, b, a.get("strides", 1), pads(a, 2),
                                                 a.get("dilations", 1), a.get("group", 1)),
        "MaxPool": lambda a, x: F.max_pool2d(x, a["kernel_shape"], a.get("strides", 1), pads(a, 2),
                                             a.get("dilations", 1), bool(a.get("ceil_mode", 0))),
        "BatchNormalization": lambda a, x, s, b, m, v: F.batch_norm(
            x, m, v, s, b, bool(a.get("training_mode", 0)), 1.0 - a.get("momentum", 0.9),
            a.get("epsilon", 1e-5)),
        "LayerNormalization": lambda a, x, s, b=None: F.layer_norm(
            x, x.shape[a.get("axis", -1) % x.dim():], s, b, a.get("epsilon", 1e-5)),
        "Reshape": lambda a, x, s: x.reshape([x.shape[k] if v == 0 else v for k, v in enumerate(s.tolist())]),
        "Div": lambda a, x, y: x / y if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc"),
        "Clip": lambda a, x, lo=None, hi=None: F.hardtanh(x, -inf if lo is None else float(lo),
                                                          inf if hi is None else float(hi)),
        "MatMul": lambda a, x, y: torch.matmul(x, y), "Add": lambda a, x, y: x + y,
        "Sub": lambda a, x, y: x - y, "Mul": lambda a, x, y: x * y,
        "Relu": lambda a, x: F.relu(x), "Erf": lambda a, x: torch.erf(x),
        "Sqrt": lambda a, x: torch.sqrt(x), "Identity": lambda a, x: x,
        "Transpose": lambda a, x: x.permute(a.get("perm", list(range(x.dim()))[::-1])),
        "Concat": lambda a, *xs: torch.cat(xs, a["axis"]),
        "Shape": lambda a, x: torch.tensor(x.shape, dtype=torch.int64),
        "Softmax": lambda a, x: F.softmax(x, a.get("axis", -1)),
        "Flatten": lambda a, x: x.reshape(x.shape[:a.get("axis", 1)].numel(), -1),
        "GlobalAveragePool": lambda a, x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True),
        "ReduceMean": lambda a, x: x.mean(dim=a.get("axes"), keepdim=bool(a.get("keepdims", 1))),
    }


def run_torch(args):
    t_start = time.perf_counter()
    import torch
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # one-off: imports torch._dynamo, sympy
    t_import = time.perf_counter() - t_start
    torch.set_num_threads(args.threads)
    ops = _torch_ops()
    _, meta, np_batches, golden = load_workload(args)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in np_batches]

    def open_session(state):
        with open(Path(args.artifacts) / "torch_model.pkl", "rb") as f:
            g = pickle.load(f)
        trainable = meta["requires_grad"]
        g["consts"] = {k: torch.from_numpy(v).requires_grad_(k in trainable) for k, v in g["consts"].items()}
        last = {i: k for k, (_, ins, _, _) in enumerate(g["nodes"]) for i in ins}
        g["drop"] = [[i for i in dict.fromkeys(ins) if last[i] == k and i not in g["consts"]
                      and i not in (g["input"], g["output"], "")] for k, (_, ins, _, _) in enumerate(g["nodes"])]
        checkpoint_loaded(state)
        a = meta["adamw"]
        opt = torch.optim.AdamW([g["consts"][k] for k in trainable], lr=a["lr"],
                                betas=(a["beta1"], a["beta2"]), eps=a["eps"], weight_decay=a["weight_decay"])
        return g, opt

    def forward(g, x):
        env = dict(g["consts"], **{g["input"]: x})
        for (op, ins, out, attrs), drop in zip(g["nodes"], g["drop"]):
            env[out] = ops[op](attrs, *[env[i] if i else None for i in ins])
            for name in drop:  # free intermediates after their last use, as eager code does
                del env[name]
        return env[g["output"]]

    def step(session, i):
        g, opt = session
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(forward(g, x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return train_loop(args, t_import, golden, open_session, step)


def worker(args):
    pkg = "odtrain" if args.system == "odtrain" else "onnxruntime.training"
    try:
        if args.phase == "prepare":
            prepare_torch(args) if args.system == "torch" else prepare_api(args, pkg)
            res = {"ok": True}
        else:
            res = run_torch(args) if args.system == "torch" else run_api(args, pkg, args.system == "ort")
    except Exception as e:  # reported by the driver, which goes on with the other systems
        import traceback
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res), flush=True)
    return "error" in res


# ---------------------------------------------------------------- driver
def spawn(args, python, system, phase, artifacts, cache_dir=None):
    cmd = [python, os.path.abspath(__file__), "--worker", "--phase", phase, "--system", system,
           "--workload", args.workload, "--models", str(args.models), "--artifacts", artifacts,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = dict(os.environ, **({"NUMBA_CACHE_DIR": cache_dir} if cache_dir else {}))
    t0 = time.time()
    try:
        p = subprocess.run(cmd + ["--t0", repr(t0)], capture_output=True, text=True, env=env,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": f"exit code {p.returncode}, no result"}
    if "error" in res:
        res["stderr"] = p.stderr
    return res


def failed(label, python, res, verbose):
    hint = (f" (is odtrain's API written and installed for {python}? `pip install -e .`)"
            if label.startswith("odtrain") else "")
    print(f"[{label}] FAILED: {res['error']}{hint}")
    if verbose:
        print(res.get("stderr", ""))


ROWS = [("median step (ms)", "median_step_ms", "{:.2f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
        ("RSS added by training (MiB)", "train_rss_mib", "{:.0f}"),
        ("RSS after checkpoint+data (MiB)", "base_rss_mib", "{:.0f}"),
        ("import (s)", "import_s", "{:.3f}"), ("session creation (s)", "session_s", "{:.3f}"),
        ("first step, session ready (s)", "first_step_s", "{:.3f}"),
        ("process start -> first step (s)", "start_to_first_step_s", "{:.3f}"),
        ("loss at step 0", "loss0", "{:.5f}"), ("max rel. loss diff to golden", "golden_rel", "{:.1e}")]
NO_RATIO = ("loss0", "golden_rel")


def driver(args):
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    pythons = {"odtrain": args.odtrain_python, "ort": args.ort_python, "ort_torch": args.ort_python,
               "torch": args.torch_python or args.ort_python}
    for s in systems:
        if s not in pythons:
            sys.exit(f"unknown system {s!r}; choose from {', '.join(pythons)}")
        if not pythons[s]:
            sys.exit(f"{s} needs --ort-python or --torch-python (see the docstring for the venv)")
    tmp = tempfile.mkdtemp(prefix="odtrain-compare-")
    arts = {}
    for s in dict.fromkeys("ort" if s == "ort_torch" else s for s in systems):
        arts[s] = os.path.join(tmp, "art-" + s)
        os.makedirs(arts[s])  # odtrain's artifact generation gets its own Numba cache: run 1 is cold
        res = spawn(args, pythons[s], s, "prepare", arts[s],
                    os.path.join(tmp, "numba-prepare") if s == "odtrain" else None)
        if "error" in res:
            failed(f"{s} artifacts", pythons[s], res, args.verbose)
            arts[s] = None
    runs = []  # alternating rounds; odtrain's first run is cold, later ones reuse its Numba cache
    for r in range(args.repeat):
        for s in systems:
            runs += [("odtrain cold", s)] * (s == "odtrain" and r == 0) + [(s + " warm" * (s == "odtrain"), s)]
    results = {}
    for label, s in runs:
        art = arts["ort" if s == "ort_torch" else s]
        if art is None:
            continue
        res = spawn(args, pythons[s], s, "run", art, os.path.join(tmp, "numba") if s == "odtrain" else None)
        if "error" in res:
            failed(label, pythons[s], res, args.verbose)
            continue
        print(f"[{label}] {res['median_step_ms']:.2f} ms/step", flush=True)
        results.setdefault(label, []).append(res)
    merged = {k: {m: None if v[0][m] is None else statistics.median(r[m] for r in v) for m in v[0]}
              for k, v in results.items()}
    report(args, merged)
    if not args.keep:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, res):
    ours = res.get("odtrain warm") or res.get("odtrain cold")
    cols = [c for c in ("odtrain cold", "odtrain warm", "ort", "ort_torch", "torch") if c in res]
    ratio_cols = [c for c in ("ort", "torch") if c in res and ours]
    ratios = {f"odtrain/{c}": {k: ours[k] / res[c][k] for _, k, _ in ROWS if k not in NO_RATIO
                               and ours[k] is not None and res[c][k]} for c in ratio_cols}
    print(f"\nworkload {args.workload}: {args.steps} steps, median after {args.warmup}; "
          f"{os.cpu_count()} CPUs; torch threads {args.threads}; repeat {args.repeat}")
    table = [["metric"] + cols + list(ratios)]
    for name, key, fmt in ROWS:
        table.append([name] + ["-" if res[c][key] is None else fmt.format(res[c][key]) for c in cols]
                     + [f"{r[key]:.2f}x" if key in r else "" for r in ratios.values()])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"workload": args.workload, "steps": args.steps, "warmup": args.warmup, "repeat": args.repeat,
             "cpus": os.cpu_count(), "threads": args.threads, "results": res, "ratios": ratios}, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="mlp", help="a folder of --models")
    p.add_argument("--models", type=Path, default=DEFAULT_MODELS)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the table shows per-metric medians")
    p.add_argument("--systems", default="odtrain,ort,torch", help="from odtrain,ort,ort_torch,torch")
    p.add_argument("--odtrain-python", default=sys.executable)
    p.add_argument("--ort-python", help="python of the onnxruntime-training venv")
    p.add_argument("--torch-python", help="default: --ort-python")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per subprocess")
    p.add_argument("--json", help="also write the results and ratios here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--verbose", action="store_true", help="show a failing worker's stderr")
    for hidden in ("--phase", "--system", "--artifacts"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.exit(worker(args) if args.worker else driver(args))


if __name__ == "__main__":
    main()
