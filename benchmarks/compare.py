"""Side-by-side training benchmark: odtrain, ONNX Runtime training 1.19.2 and PyTorch.

Each measurement runs in a fresh subprocess, systems alternating; one run prints a table with the
ratios odtrain / ONNX Runtime and odtrain / PyTorch.

Reference venv, outside the project, never a dependency of odtrain (do not add the `onnxruntime`
inference package to it: it overwrites the training build's files):

    python3 -m venv /work/ortref
    /work/ortref/bin/pip install numpy onnx onnxruntime-training-cpu==1.19.2 torch==2.13.0

From the repository root, with odtrain installed in the current python (`pip install -e .`):

    python benchmarks/compare.py --workload mlp --steps 50 --ort-python /work/ortref/bin/python
    python benchmarks/compare.py --workload cnn --systems ort,torch --repeat 3 \\
        --ort-python /work/ortref/bin/python --json cnn.json

--workload names a folder of shared/models (mlp, cnn, transformer, mobilenetv2_personalize,
mobilenetv2_full): forward.onnx, meta.json (input dtype, requires_grad, frozen_params, AdamW) and
golden.npz (x/y, one batch per step, reused cyclically; x cast to meta's input dtype).

--systems, any of:
  odtrain    odtrain.artifacts/api; a run with a fresh NUMBA_CACHE_DIR (cold), then runs reusing
             it (warm); the ratios use the warm runs.
  odtrain_lib  the same artifacts with their kernel library (`odtrain compile`, at the workload's batch,
             built in the prepare phase and timed there): no kernel compiles, Numba is not imported.
  ort        onnxruntime.training with `torch` blocked: the runtime alone.
  ort_torch  the same with a plain `import onnxruntime.training.api`, which imports torch.
  torch      eager PyTorch running the ONNX graph op by op (torch_ops covers all five workloads),
             torch.optim.AdamW (meta's lr, betas, eps 1e-6, no decay) and cross-entropy.
odtrain and ort share the worker code; only the imported package differs. Artifacts are made in a
separate process first; for ONNX Runtime with its workarounds (a ModelProto instead of a path,
Mean/InvStdDev outputs on LayerNormalization; ir_version=8 and single-output inference-mode
BatchNormalization in the generated files).

ONNX Runtime's Module is given a fresh `onnxruntime.SessionOptions()` (every option at its default). Without
one, ONNX Runtime training 1.19.2 ran the cnn step at 93-97 ms here, pinned to one core the same; once a
SessionOptions object exists in the process, 50 ms (9 of 9 runs, whether it is passed or not). Its fast state
is the fair reference; earlier figures of this script (e.g. cnn 52.8 ms) mixed both states.

Threads: ONNX Runtime keeps its default pool (one thread per physical core), PyTorch gets
torch.set_num_threads(--threads, default 2), odtrain keeps its default (every core the process may
run on) unless --odtrain-threads N sets ODTRAIN_NUM_THREADS.

Reported: import time (torch's includes the one-off import its first AdamW() triggers); session
creation (checkpoint + Module + Optimizer); first step once the session is ready; process start to
first completed step; median step after --warmup (forward, backward, optimizer); peak RSS
(ru_maxrss); RSS added by training (peak after checkpoint and data are loaded, reset through
/proc/self/clear_refs, minus the RSS then); the floor, RSS after the import (for odtrain, the
import and `odtrain.jit.load()`, Numba's CPU target and BLAS, which ONNX Runtime's import of
its native library corresponds to; without it they load at the first step and count as training);
anonymous RSS, the private part (peak RSS minus the file-backed pages at the end: those are
library code read from disk, which the kernel drops under memory pressure and shares between
processes; LLVM's alone is ~65 MiB of odtrain's floor); largest relative loss difference to golden.npz's
adamw_losses (ONNX Runtime's AdamW; torch's puts eps elsewhere, so ~1e-4..1e-2 off).
"""
import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"


# ---------------------------------------------------------------- workers
def rss_kib(field="VmRSS"):
    """A line of /proc/self/status in KiB: VmRSS, or its parts RssAnon (private memory) and RssFile
    (pages of mapped files: library code, clean, which the kernel can drop and read again)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def checkpoint_loaded(state):
    """Call right after loading the checkpoint: note RSS and peak so far, then reset the peak."""
    state["base"] = rss_kib()
    state["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
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
    batches = [(np.ascontiguousarray(x, meta["input_dtype"]), np.ascontiguousarray(y, np.int64))
               for x, y in zip(g["x"], g["y"])]
    return meta, batches, [float(v) for v in g["adamw_losses"]]


def train_loop(args, t_import, golden, open_session, step):
    """open_session(state) loads the checkpoint, calls checkpoint_loaded(state) and creates the
    session; step(session, i) runs one training step and returns the loss."""
    state, t0 = {}, time.perf_counter()
    session = open_session(state)
    t_session = time.perf_counter() - t0
    losses, times, t_first = [], [], None
    for i in range(args.steps):
        t = time.perf_counter()
        loss = step(session, i)
        times.append(time.perf_counter() - t)
        t_first = t_first or time.time()
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "import_s": t_import, "session_s": t_session, "first_step_s": times[0],
        "start_to_first_step_s": t_first - args.t0,
        "median_step_ms": 1e3 * statistics.median(times[args.warmup:] or times),
        "peak_rss_mib": max(peak, state["peak"]) / 1024, "base_rss_mib": state["base"] / 1024,
        "peak_anon_mib": (max(peak, state["peak"]) - rss_kib("RssFile")) / 1024,
        "train_rss_mib": (peak - state["base"]) / 1024 if state["reset"] else None,
        "loss0": losses[0], "loss_last": losses[-1],
        "golden_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, golden)),
    }


def prepare_api(args, pkg):
    import onnx
    artifacts = importlib.import_module(pkg + ".artifacts")
    folder = Path(args.models) / args.workload
    meta = json.loads((folder / "meta.json").read_text())
    model, is_ort = str(folder / "forward.onnx"), pkg.startswith("onnxruntime")
    if is_ort:  # a path fails; its LayerNorm gradient needs the optional outputs
        model = onnx.load(model)
        for node in model.graph.node:
            if node.op_type == "LayerNormalization" and len(node.output) == 1:
                node.output.extend([node.output[0] + "_mean", node.output[0] + "_invstddev"])
    artifacts.generate_artifacts(
        model, requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=args.artifacts)
    if args.system == "odtrain_lib":
        from odtrain.library_build import compile_artifacts

        t = time.perf_counter()
        compile_artifacts(args.artifacts, batch_size=meta["input_shape"][0], input_shapes={meta["input_name"]: meta["input_shape"]},
                          out=lambda line: print(line, file=sys.stderr))
        print(f"library built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
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
    if block_torch:  # onnxruntime/training/__init__.py imports torch: load only its api package
        import types
        from importlib.util import find_spec
        sys.modules["torch"] = None
        stub = types.ModuleType(pkg)
        stub.__path__ = list(find_spec(pkg).submodule_search_locations)
        sys.modules[pkg] = stub
    api = importlib.import_module(pkg + ".api")
    if pkg == "odtrain" and args.system == "odtrain_lib":  # the kernel library: what ORT's native library is
        assert importlib.import_module("odtrain.kernel_library").find(args.artifacts) is not None
    elif pkg == "odtrain":  # Numba's CPU target and BLAS: what ORT's import of its native library is
        importlib.import_module("odtrain.jit").load()
    t_import = time.perf_counter() - t_start
    floor = {"floor_rss_mib": rss_kib() / 1024, "floor_anon_mib": rss_kib("RssAnon") / 1024}
    meta, batches, golden = load_workload(args)
    art = Path(args.artifacts)

    def open_session(state):
        ckpt = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
        checkpoint_loaded(state)
        extra = {}
        if pkg != "odtrain":  # see the module docstring: ORT training runs its steps twice as fast once a
            extra["session_options"] = importlib.import_module("onnxruntime").SessionOptions()  # SessionOptions exists
        module = api.Module(str(art / "training_model.onnx"), ckpt, str(art / "eval_model.onnx"), **extra)
        optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(meta["adamw"]["lr"])
        return module.train(), optimizer

    def step(session, i):
        module, optimizer = session
        loss = module(*batches[i % len(batches)])
        optimizer.step()
        module.lazy_reset_grad()
        return loss

    return {**train_loop(args, t_import, golden, open_session, step), **floor}


def torch_program(args):
    """The forward graph as data: nodes, initializers and constants, what to free after each node."""
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
    last = {i: k for k, (_, ins, _, _) in enumerate(nodes) for i in ins}
    keep = set(consts) | {g.input[0].name, g.output[0].name, ""}
    drop = [[i for i in dict.fromkeys(ins) if last[i] == k and i not in keep]
            for k, (_, ins, _, _) in enumerate(nodes)]
    return {"nodes": nodes, "drop": drop, "consts": consts, "input": g.input[0].name, "output": g.output[0].name}


def torch_ops():
    """ONNX op -> torch, for the ops of the reference models (2-D convolutions, symmetric pads)."""
    import torch
    import torch.nn.functional as F

    def gemm(a, A, B, C=None):
        A, B = A.t() if a.get("transA") else A, B if a.get("transB") else B.t()
        if a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0:
            return F.linear(A, B, C)
        return a.get("alpha", 1.0) * F.linear(A, B) + (0 if C is None else a.get("beta", 1.0) * C)

    def pads(a):
        p = a.get("pads", [0] * 4)
        assert p[:2] == p[2:], "asymmetric padding is not supported"
        return p[:2]

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
        "Conv": lambda a, x, w, b=None: F.conv2d(x, w, b, a.get("strides", 1), pads(a),
                                                 a.get("dilations", 1), a.get("group", 1)),
        "MaxPool": lambda a, x: F.max_pool2d(x, a["kernel_shape"], a.get("strides", 1), pads(a),
                                             a.get("dilations", 1), bool(a.get("ceil_mode", 0))),
        "BatchNormalization": lambda a, x, s, b, m, v: F.batch_norm(
            x, m, v, s, b, bool(a.get("training_mode")), 1 - a.get("momentum", 0.9), a.get("epsilon", 1e-5)),
        "LayerNormalization": lambda a, x, s, b=None: F.layer_norm(
            x, x.shape[a.get("axis", -1) % x.dim():], s, b, a.get("epsilon", 1e-5)),
        "Reshape": lambda a, x, s: x.reshape([x.shape[k] if v == 0 else v for k, v in enumerate(s.tolist())]),
        "Div": lambda a, x, y: x / y if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc"),
        "Clip": lambda a, x, lo=None, hi=None: F.hardtanh(x, -inf if lo is None else float(lo),
                                                          inf if hi is None else float(hi)),
        "MatMul": lambda a, x, y: torch.matmul(x, y), "Add": lambda a, x, y: x + y,
        "Mul": lambda a, x, y: x * y, "Relu": lambda a, x: F.relu(x), "Erf": lambda a, x: torch.erf(x),
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
    floor = {"floor_rss_mib": rss_kib() / 1024, "floor_anon_mib": rss_kib("RssAnon") / 1024}
    torch.set_num_threads(args.threads)
    ops = torch_ops()
    meta, np_batches, golden = load_workload(args)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in np_batches]
    program = torch_program(args)  # parsed before timing, as the ONNX systems parse while preparing

    def open_session(state):
        g = dict(program)
        trainable = meta["requires_grad"]
        g["consts"] = {k: torch.from_numpy(v).requires_grad_(k in trainable) for k, v in g["consts"].items()}
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

    return {**train_loop(args, t_import, golden, open_session, step), **floor}


def worker(args):
    pkg = "odtrain" if args.system.startswith("odtrain") else "onnxruntime.training"
    try:
        if args.phase == "prepare":
            if args.system != "torch":  # torch parses the ONNX graph itself when it runs
                prepare_api(args, pkg)
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
def spawn(args, system, phase, artifacts, numba_cache=None):
    """Run one worker in a fresh process; return its JSON result, or {"error": ...}."""
    python = {"odtrain": args.odtrain_python, "odtrain_lib": args.odtrain_python,
              "torch": args.torch_python}.get(system, args.ort_python)
    cmd = [python, os.path.abspath(__file__), "--worker", "--phase", phase, "--system", system,
           "--workload", args.workload, "--models", str(args.models), "--artifacts", artifacts,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed packages run: byte code compiled once, not per process
    if system.startswith("odtrain"):
        env["NUMBA_CACHE_DIR"] = numba_cache
        if args.odtrain_threads:
            env["ODTRAIN_NUM_THREADS"] = str(args.odtrain_threads)
    try:
        p = subprocess.run(cmd + ["--t0", repr(time.time())], capture_output=True, text=True, env=env,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": f"exit code {p.returncode}, no result"}
    if "error" in res:
        hint = f" (is odtrain's API importable by {python}? pip install -e .)" * (system == "odtrain")
        print(f"[{system} {phase}] FAILED: {res['error']}{hint}" + ("\n" + p.stderr) * args.verbose)
    return res


ROWS = [("median step (ms)", "median_step_ms", "{:.2f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
        ("RSS added by training (MiB)", "train_rss_mib", "{:.0f}"),
        ("RSS after checkpoint+data (MiB)", "base_rss_mib", "{:.0f}"),
        ("RSS after import, the floor (MiB)", "floor_rss_mib", "{:.0f}"),
        ("peak anonymous RSS (MiB)", "peak_anon_mib", "{:.0f}"),
        ("anonymous RSS of the floor (MiB)", "floor_anon_mib", "{:.0f}"),
        ("import (s)", "import_s", "{:.3f}"), ("session creation (s)", "session_s", "{:.3f}"),
        ("first step, session ready (s)", "first_step_s", "{:.3f}"),
        ("process start -> first step (s)", "start_to_first_step_s", "{:.3f}"),
        ("loss at step 0", "loss0", "{:.5f}"), ("max rel. loss diff to golden", "golden_rel", "{:.1e}")]
NO_RATIO = ("loss0", "golden_rel")


def driver(args):
    args.torch_python = args.torch_python or args.ort_python
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ("odtrain", "odtrain_lib", "ort", "ort_torch", "torch"):
            sys.exit(f"unknown system {s!r}: choose from odtrain, odtrain_lib, ort, ort_torch, torch")
        if s != "odtrain" and not args.ort_python and not (s == "torch" and args.torch_python):
            sys.exit(f"{s} needs --ort-python (see the module docstring for the venv)")
    tmp = tempfile.mkdtemp(prefix="odtrain-compare-")
    arts = {}  # one artifact set per system, ort_torch uses ort's
    for s in dict.fromkeys("ort" if s == "ort_torch" else s for s in systems):
        arts[s] = os.path.join(tmp, "art-" + s)
        os.makedirs(arts[s])  # artifact generation gets its own Numba cache, so run 1 is cold
        if "error" in spawn(args, s, "prepare", arts[s], os.path.join(tmp, "numba-prepare")):
            arts[s] = None
    arts["ort_torch"] = arts.get("ort")
    runs = []  # alternating rounds; odtrain's first run is cold, later ones reuse its Numba cache
    for r in range(args.repeat):
        for s in systems:
            cold = s == "odtrain" and r == 0
            runs += [("odtrain cold", s)] * cold + [(s + " warm" * (s == "odtrain"), s)]
    results = {}
    for label, s in runs:
        if arts[s]:
            res = spawn(args, s, "run", arts[s], os.path.join(tmp, "numba"))
            if "error" not in res:
                print(f"[{label}] {res['median_step_ms']:.2f} ms/step", flush=True)
                results.setdefault(label, []).append(res)
    merged = {k: {m: None if v[0][m] is None else statistics.median(r[m] for r in v) for m in v[0]}
              for k, v in results.items()}
    report(args, merged)
    if not args.keep:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, res):
    ours = res.get("odtrain_lib") or res.get("odtrain warm") or res.get("odtrain cold")
    cols = [c for c in ("odtrain cold", "odtrain warm", "odtrain_lib", "ort", "ort_torch", "torch") if c in res]
    ratios = {f"odtrain/{c}": {k: ours[k] / res[c][k] for _, k, _ in ROWS
                               if k not in NO_RATIO and ours[k] is not None and res[c][k]}
              for c in ("ort", "torch") if c in res and ours}
    print(f"\nworkload {args.workload}: {args.steps} steps, median after {args.warmup}; "
          f"{os.cpu_count()} CPUs; torch threads {args.threads}; odtrain threads {args.odtrain_threads or 'default'}; "
          f"repeat {args.repeat}")
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
    p.add_argument("--odtrain-threads", type=int, default=0,
                   help="odtrain's threads (ODTRAIN_NUM_THREADS); default: odtrain's own, every core")
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
