"""The spread behind README's language-model figure: the walk-through run on the CPUs users have.

A training run's last bits depend on the CPU twice: Numba compiles the kernels for the host (its vector
width, whether a multiply and an add contract into one FMA), and numpy's OpenBLAS picks a kernel family for
it. One machine shows what another host computes by naming the other target and family:
`NUMBA_CPU_NAME` (generic, haswell, skylake-avx512, znver4, or the host's own) and `OPENBLAS_CORETYPE`
(Haswell, Zen, Sandybridge, SkylakeX), each Numba target with a kernel cache of its own. The thread count
(`ODTRAIN_NUM_THREADS`) changes how sums are split. For each combination this runs README's walk-through
in a fresh folder (make_text.py, prepare with LoRA, 4 epochs, eval on the held-out lines) and prints the
held-out line; the range over all runs is what README states.

From the repository root, with odtrain installed in .venv:

    .venv/bin/python benchmarks/walkthrough_spread.py                       # the full matrix
    .venv/bin/python benchmarks/walkthrough_spread.py --targets host --threads 2   # one run
"""
import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MODEL = ROOT / "tests" / "data" / "decoders" / "llama" / "torchscript17.onnx"
HELD_OUT = re.compile(r"loss ([\d.]+), perplexity ([\d.]+), accuracy ([\d.]+)%")


def make_text_script() -> str:
    """README's make_text.py, as the walk-through shows it."""
    start = README.index("# make_text.py")
    return README[start:README.index("```", start)]


def odtrain(env, folder, *argv):
    result = subprocess.run([sys.executable, "-m", "odtrain", *argv], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"odtrain {' '.join(argv)} failed:\n{result.stderr}")
    return result.stdout


def run(target: str, core_type: str, threads: int, cache_root: Path) -> dict:
    env = dict(os.environ, ODTRAIN_NUM_THREADS=str(threads))
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("OPENBLAS_CORETYPE", None)
    if target != "host":
        env["NUMBA_CPU_NAME"] = target
    if core_type != "default":
        env["OPENBLAS_CORETYPE"] = core_type
    env["ODTRAIN_CACHE_DIR"] = str(cache_root / target)  # a Numba target's kernels never load for another
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-c", make_text_script()], cwd=folder, env=env, check=True, timeout=600)
        odtrain(env, folder, "prepare", str(MODEL), "-o", "lm-lora", "--lora-rank", "8", "--lora-targets",
                "*proj.weight", "lm_head.weight", "--lr", "0.003")
        text = ["--tokenizer", "tokenizer.json", "--seq-len", "64"]
        before = HELD_OUT.search(odtrain(env, folder, "eval", "lm-lora", "--data", "test.txt", *text))
        odtrain(env, folder, "train", "lm-lora", "--data", "train.txt", *text, "--epochs", "4", "--batch-size", "16")
        after = HELD_OUT.search(odtrain(env, folder, "eval", "lm-lora", "--data", "test.txt", *text))
    return {"target": target, "core_type": core_type, "threads": threads, "before": before.group(0),
            "loss": float(after.group(1)), "perplexity": float(after.group(2)), "accuracy": float(after.group(3))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["host", "generic", "haswell", "skylake-avx512", "znver4"])
    parser.add_argument("--core-types", nargs="+", default=["default", "Sandybridge"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--cache", default=None, help="folder for the per-target kernel caches (default: temporary)")
    parser.add_argument("--json", help="append each run as a JSON line to this file")
    args = parser.parse_args()
    cache_root = Path(args.cache or tempfile.mkdtemp(prefix="odtrain-spread-"))
    runs = []
    for target, core_type, threads in itertools.product(args.targets, args.core_types, args.threads):
        result = run(target, core_type, threads, cache_root)
        runs.append(result)
        print(f"{target:15} {core_type:12} {threads} threads: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}, accuracy {result['accuracy']:.1f}%   (before: {result['before']})",
              flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as out:
                out.write(json.dumps(result) + "\n")
    if args.cache is None:
        shutil.rmtree(cache_root, ignore_errors=True)
    for key, unit in (("loss", ".4f"), ("perplexity", ".2f"), ("accuracy", ".1f")):
        values = [r[key] for r in runs]
        print(f"{key}: {min(values):{unit}} to {max(values):{unit}}")


if __name__ == "__main__":
    main()
