"""Time to the first training step in a fresh process, phase by phase, and what the kernels cost.

    python first_step.py --artifacts DIR [--batch-size 64] [--json] [--expect-no-compile]
    python first_step.py --demo              # the built-in demo classifier (what `odtrain warmup` warms)

Phases: imports (numpy, numba, odtrain.api), the runtime (`odtrain.jit.load()`: scipy's BLAS
table that Numba's np.dot reaches, and Numba's one-off set-up of its typing and lowering registries,
which it otherwise does at the first kernel it compiles or loads), CheckpointState + Module +
Optimizer (the models are read without the onnx package), the first training step
(kernels compiled or loaded from the cache, the memory plan bound), the optimizer step, the first eval step, and a second training step
(warm, for scale). The kernel counts come from Numba's per-kernel cache statistics. The cache folder
is ODTRAIN_CACHE_DIR (or NUMBA_CACHE_DIR) as set by the caller.
With --expect-no-compile, exits 1 if any kernel was compiled (a warm cache should serve them all).
"""
import argparse
import json
import sys
import tempfile
import time

T0 = time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", help="folder written by generate_artifacts")
    parser.add_argument("--demo", action="store_true", help="generate the demo classifier's artifacts first (untimed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--expect-no-compile", action="store_true")
    args = parser.parse_args()
    if not args.artifacts and not args.demo:
        parser.error("give --artifacts DIR or --demo")

    phases = {}

    def timed(name, fn):
        t = time.perf_counter()
        value = fn()
        phases[name] = time.perf_counter() - t
        return value

    np = timed("import numpy", lambda: __import__("numpy"))
    timed("import numba", lambda: __import__("numba"))
    timed("import odtrain.api", lambda: __import__("odtrain.api"))
    from odtrain import demo, jit, trial_steps
    from odtrain.jit import cache
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.artifact_paths import ArtifactPaths

    scratch = None
    directory = args.artifacts
    if args.demo:
        scratch = tempfile.TemporaryDirectory(prefix="odtrain-first-step-")
        t = time.perf_counter()
        directory = demo.demo_artifacts(scratch.name)
        untimed = time.perf_counter() - t
    else:
        untimed = 0.0

    def open_session():
        paths = ArtifactPaths.of(directory)
        state = CheckpointState.load_checkpoint(paths.checkpoint)
        module = Module(paths.training_model, state, paths.eval_model)
        return module, Optimizer(paths.optimizer_model, module)

    timed("runtime: BLAS table, Numba's set-up", jit.load)
    module, optimizer = timed("CheckpointState + Module + Optimizer", open_session)
    feeds = trial_steps.zero_inputs(module, args.batch_size)
    timed("import kernels", lambda: cache.kernel_dispatchers())
    before = cache.kernel_stats()

    def train_step():
        module(*feeds)
        module.lazy_reset_grad()

    timed("first training step", train_step)
    after_first = cache.kernel_stats()
    timed("first optimizer step", optimizer.step)

    def eval_step():
        module.eval()
        module(*feeds)
        module.train()

    timed("first eval step", eval_step)
    total = time.perf_counter() - T0 - untimed
    timed("second training step", train_step)
    after = cache.kernel_stats()
    result = {
        "phases": phases,
        "to_first_step": sum(v for k, v in phases.items() if k in (
            "import numpy", "import numba", "import odtrain.api", "runtime: BLAS table, Numba's set-up",
            "CheckpointState + Module + Optimizer", "import kernels", "first training step")),
        "through_first_eval": total,
        "kernels_first_training_step": after_first["kernels"] - before["kernels"],
        "compiled": after["compiled"] - before["compiled"],
        "loaded": after["loaded"] - before["loaded"],
        "compiled_kernels": sorted(set(after.get("compiled_kernels", ())) - set(before.get("compiled_kernels", ()))),
        "cache_dir": cache.cache_dir(),
    }
    if scratch is not None:
        scratch.cleanup()
    if args.json:
        print(json.dumps(result))
    else:
        for name, seconds in phases.items():
            print(f"  {name:<40} {seconds:8.3f} s")
        print(f"  {'to the end of the first training step':<40} {result['to_first_step']:8.3f} s")
        print(f"  {'through the first eval step':<40} {total:8.3f} s")
        print(f"  kernels: {result['compiled']} compiled, {result['loaded']} loaded from {result['cache_dir']}")
        if result["loaded"] and not result["compiled"]:
            extra = phases["first training step"] - phases["second training step"]
            print(f"  first training step beyond a warm one, per loaded kernel: "
                  f"{extra / max(1, after_first['loaded'] - before['loaded']) * 1000:.0f} ms (cache load, plan binding)")
    if args.expect_no_compile and result["compiled"]:
        print(f"error: {result['compiled']} kernels were compiled ({', '.join(result['compiled_kernels'])}); "
              "a warm cache should have served them all", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
