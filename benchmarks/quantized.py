"""Quantized models, every claim measured in one run: a QDQ MobileNetV2 made by onnxruntime's quantizer run,
personalised and timed against onnxruntime, the float model and ONNX Runtime training, and
quantization-aware training of the digits classifier.

From the repository root, with odtrain installed in the current python (`pip install -e .`) and
onnxruntime (inference) importable by it:

    python benchmarks/quantized.py --ort-python /work/ortref/bin/python --json quantized.json

The model: tests/data/mobilenetv2_personalize/forward.onnx (the same file as shared/models') through
`onnxruntime.quantization.quantize_static` (QDQ, uint8 activations, int8 weights, the Gemm head kept float,
MinMax on the 4 golden batches), by tests/quantized_models.py, in two forms: BatchNormalization on running
statistics (the model an application ships) and, as exported for training, on the batch's statistics.

Measured, in this order (1-4 in one child process, 5 in processes this one starts):
1. outputs: odtrain's InferenceSession against onnxruntime's (optimised session) on the 4 golden batches
   (32 images): top-1 equal, largest |logit difference| beside the logits' range, the pooled features
   (the head's input) one quantization step apart and further; for scale, how far onnxruntime's
   optimised and as-written graphs differ from each other; and the cross-entropy of onnxruntime's logits
   on golden batch 0, which a training step's step-0 loss (5) should equal.
2. personalising: artifacts with the float head trainable and the rest frozen; the head's gradients after
   one step on golden batch 0 against float64 gradients from onnxruntime's features (and from odtrain's
   own): max |g - g_ref| / max |g_ref|, the larger of weight and bias.
3. frozen backbone bytes in `odtrain.memory.report` (batch 8), against the float model's.
4. QAT: the demo classifier trained with `artifacts.QatConfig()` and without (same seed, batches and
   --qat-epochs), exported; onnxruntime's held-out accuracy on each export.
5. a personalising step at batch 8 (AdamW): benchmarks/compare.py's worker, one fresh process per run,
   the models alternating (QDQ running statistics, QDQ batch statistics, float, then ONNX Runtime
   training's) for --repeat rounds after one uncounted warm-up round (Numba's cache filled, files read).
   Each process times --steps steps; its figure is the median after --warmup; the table gives the median
   over the rounds. Peak RSS is the process's ru_maxrss; "added by training" is compare.py's (peak after
   the checkpoint is loaded minus the RSS then). The step-0 loss is on golden batch 0.

ONNX Runtime training 1.19.2 (--ort-python) is asked to prepare the QDQ model as odtrain is (every
initializer the output needs but the head frozen); its error is reported. It does prepare and train a
variant, reported beside: scales and zero points left as constants of the model (not frozen parameters,
which it turns into graph inputs), every QuantizeLinear given its own scale and zero point (its QDQ
fusion consumes a zero point at its first pair; the pooled and flattened features share one), and, in the
batch-statistics form, the quantized running-statistics outputs (which lead nowhere) removed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import compare

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import quantized_models  # noqa: E402  (tests/quantized_models.py)

FLOAT = "mobilenetv2_personalize"
FORMS = {"mobilenetv2_qdq_inference": "QDQ, running statistics", "mobilenetv2_qdq": "QDQ, batch statistics"}
ORT_SUFFIX = "_ort_constants"  # the workload as ONNX Runtime training prepares it
MIB = 1024 * 1024


# ---------------------------------------------------------------- the models
def write_models(folder: Path) -> None:
    """The two QDQ workloads, the float one (a link to tests/data) and the variants ONNX Runtime training takes."""
    for name in FORMS:
        quantized_models.write_workload(folder / name, inference_form=name.endswith("_inference"))
        onnxruntime_training_workload(folder / name, folder / (name + ORT_SUFFIX))
    os.symlink(quantized_models.DATA / FLOAT, folder / FLOAT)


def onnxruntime_training_workload(source: Path, folder: Path) -> None:
    """`source`'s workload as ONNX Runtime training takes it: its quantization scales and zero points constants
    of the model rather than frozen parameters, each QuantizeLinear (with its DequantizeLinear) given a scale
    and zero point of its own (its QDQ fusion needs both), and no nodes that lead to no output (the quantized
    running statistics of the batch-statistics form, which its eval model would read dangling)."""
    import onnx

    model = onnx.load(str(source / "forward.onnx"))
    graph = model.graph
    needed, kept = {o.name for o in graph.output}, []
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            needed.update(node.input)
            kept.append(node)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    initializers = {t.name: t for t in graph.initializer}
    users = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            users.setdefault(tuple(node.input[1:]), []).append(node)
    for shared, quantizers in users.items():
        for count, quantize in enumerate(quantizers[1:], start=1):
            dequantize = next(n for n in graph.node
                              if n.op_type == "DequantizeLinear" and n.input[0] == quantize.output[0])
            for position, name in enumerate(shared, start=1):
                copy = graph.initializer.add()
                copy.CopyFrom(initializers[name])
                copy.name = f"{name}_{count}"
                quantize.input[position] = dequantize.input[position] = copy.name
    constants = {name for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")
                 for name in node.input[1:]}
    os.makedirs(folder)
    onnx.save(model, str(folder / "forward.onnx"))
    meta = json.loads((source / "meta.json").read_text())
    meta["frozen_params"] = [name for name in meta["frozen_params"] if name not in constants]
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    os.symlink((source / "golden.npz").resolve(), folder / "golden.npz")


# ---------------------------------------------------------------- 1-4: in one process
def outputs_against_onnxruntime(path) -> dict:
    from odtrain.inference import InferenceSession

    model = quantized_models.with_output(path, quantized_models.FEATURES)
    step = quantized_models.feature_step(model)
    session = InferenceSession(model)
    agree = images = 0
    logits_diff = logits_range = feature_steps = graphs_diff = 0.0
    off_by_one = features_count = 0
    for x in quantized_models.golden_batches():
        logits, features = session.run(None, {"input": x})
        expected_logits, expected_features = quantized_models.onnxruntime_outputs(model, {"input": x})
        literal_logits = quantized_models.onnxruntime_outputs(model, {"input": x}, optimized=False)[0]
        agree += int((logits.argmax(1) == expected_logits.argmax(1)).sum())
        images += len(x)
        logits_diff = max(logits_diff, float(np.abs(logits - expected_logits).max()))
        logits_range = max(logits_range, float(expected_logits.max() - expected_logits.min()))
        graphs_diff = max(graphs_diff, float(np.abs(literal_logits - expected_logits).max()))
        steps = np.rint(np.abs(features - expected_features) / step)
        feature_steps = max(feature_steps, float(steps.max()))
        off_by_one += int((steps == 1).sum())
        features_count += steps.size
    first_logits = quantized_models.onnxruntime_outputs(model, {"input": quantized_models.golden_batches()[0]})[0]
    return {"onnxruntime_loss0": cross_entropy(first_logits, golden_labels()[0]),
            "images": images, "top1_equal": agree, "max_abs_logit_difference": logits_diff,
            "logit_range": logits_range, "max_feature_difference_steps": feature_steps,
            "features_one_step_apart": off_by_one / features_count,
            "onnxruntime_optimised_vs_as_written": graphs_diff}


def golden_labels() -> np.ndarray:
    return np.load(quantized_models.DATA / FLOAT / "golden.npz")["y"]


def cross_entropy(logits, labels) -> float:
    """Mean cross-entropy in float64: the loss a training step on these logits reports."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(labels)), labels]))


def personalised(path, directory: Path) -> dict:
    """Artifacts of the QDQ model with its float head trainable; one step on golden batch 0; its head
    gradients against those from onnxruntime's and odtrain's features; the memory report."""
    from onnx import numpy_helper

    import odtrain.memory
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from odtrain.inference import InferenceSession

    trainable, frozen = quantized_models.personalize_parameters(path)
    artifacts.generate_artifacts(str(path), requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    x, y = quantized_models.golden_batches()[0], golden_labels()[0]
    module(x, y)
    model = quantized_models.with_output(path, quantized_models.FEATURES)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    head = weights[trainable[0]], weights[trainable[1]]
    features = {"onnxruntime": quantized_models.onnxruntime_outputs(model, {"input": x})[1],
                "odtrain": InferenceSession(model).run(None, {"input": x})[1]}
    result = {}
    for source, values in features.items():
        expected = quantized_models.head_gradients(values, *head, y)
        result[f"head_gradient_rel_to_{source}_features"] = max(
            float(np.abs(state.parameters[name].grad - want).max() / np.abs(want).max())
            for name, want in zip(trainable, expected))
    report = odtrain.memory.report(module)
    return {**result, "frozen_bytes": report.frozen_parameter_bytes, "arena_bytes": report.arena_bytes}


def float_memory(directory: Path) -> dict:
    import odtrain.memory
    from odtrain import artifacts

    meta = json.loads((quantized_models.DATA / FLOAT / "meta.json").read_text())
    artifacts.generate_artifacts(str(quantized_models.DATA / FLOAT / "forward.onnx"),
                                 requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory)
    shape = meta["input_shape"]  # MobileNetV2's file leaves its square image's size symbolic
    report = odtrain.memory.from_artifacts(directory, batch_size=shape[0], sequence_length=shape[-1])
    return {"frozen_bytes": report.frozen_parameter_bytes, "arena_bytes": report.arena_bytes}


def qat_digits(directory: Path, epochs: int) -> dict:
    import onnx
    from onnx import TensorProto

    from odtrain import artifacts

    result = {"epochs": epochs}
    for name, qat in (("float", None), ("qat", artifacts.QatConfig())):
        test_x, test_y, logits = quantized_models.train_digits(directory / name, qat, epochs)
        exported = directory / name / "inference.onnx"
        runtime = quantized_models.onnxruntime_outputs(exported, {"input": test_x})[0]
        result[f"{name}_onnxruntime_accuracy"] = float((runtime.argmax(1) == test_y).mean())
        result[f"{name}_odtrain_eval_accuracy"] = float((logits.argmax(1) == test_y).mean())
        graph = onnx.load(str(exported)).graph
        stored = {t.name: t.data_type for t in graph.initializer}
        dequantized = [stored[n.input[0]] for n in graph.node
                       if n.op_type == "DequantizeLinear" and n.input[0] in stored]
        result[f"{name}_int8_weights"] = dequantized.count(TensorProto.INT8)
        result[f"{name}_int32_biases"] = dequantized.count(TensorProto.INT32)
    result["held_out"] = len(test_y)
    return result


def measure_in_process(scratch: Path, qat_epochs: int) -> None:
    """1-4 (and the models for 5) into scratch; the results to scratch/in_process.json."""
    models = scratch / "models"
    print(f"quantizing MobileNetV2 into {models}", flush=True)
    write_models(models)
    results = {"outputs": {}, "personalised": {}}
    for name, form in FORMS.items():
        print(f"outputs and head gradients, {form}", flush=True)
        path = models / name / "forward.onnx"
        results["outputs"][name] = outputs_against_onnxruntime(path)
        results["personalised"][name] = personalised(path, scratch / f"artifacts-{name}")
    results["float_memory"] = float_memory(scratch / "artifacts-float")
    print("QAT on the digits classifier", flush=True)
    results["qat"] = qat_digits(scratch / "digits", qat_epochs)
    (scratch / "in_process.json").write_text(json.dumps(results))


# ---------------------------------------------------------------- 5: fresh processes
def timed_runs(args, models: Path, scratch: Path) -> dict:
    """Alternating fresh processes of compare.py's worker; per label the median of each metric over the
    counted rounds, or the error that stopped it."""
    runs = [(f"odtrain, {FORMS[name]}", "odtrain", name) for name in FORMS]
    runs.append(("odtrain, float", "odtrain", FLOAT))
    if args.ort_python:  # the QDQ models as odtrain takes them, then as ONNX Runtime training can
        runs += [(f"ORT training, {FORMS[name]}", "ort", name) for name in FORMS]
        runs += [(f"ORT training, {FORMS[name]}, scales as constants", "ort", name + ORT_SUFFIX) for name in FORMS]
        runs.append(("ORT training, float", "ort", FLOAT))
    results, errors, artifact_folders = {}, {}, {}
    cache = str(scratch / "numba")
    for label, system, workload in runs:
        prepared = spawn(args, models, system, workload, "prepare", scratch / f"{system}-{workload}", cache)
        if "error" in prepared:
            errors[label] = prepared["error"]
        else:
            artifact_folders[label] = scratch / f"{system}-{workload}"
    for round_index in range(args.repeat + 1):
        for label, system, workload in runs:
            if label in artifact_folders:
                res = spawn(args, models, system, workload, "run", artifact_folders[label], cache)
                counted = round_index > 0 and "error" not in res
                print(f"  [{label}] round {round_index}{'' if round_index else ' (warm-up)'}: "
                      + (res.get("error") or f"{res['median_step_ms']:.1f} ms/step"), flush=True)
                if "error" in res:
                    errors[label] = res["error"]
                elif counted:
                    results.setdefault(label, []).append(res)
    keys = ("median_step_ms", "peak_rss_mib", "train_rss_mib", "loss0")
    return {"runs": {label: {key: statistics.median(r[key] for r in rows) if rows[0][key] is not None else None
                             for key in keys} | {"processes": len(rows)}
                     for label, rows in results.items()},
            "errors": errors}


def spawn(args, models: Path, system: str, workload: str, phase: str, artifacts: Path, cache: str) -> dict:
    os.makedirs(artifacts, exist_ok=True)
    worker_args = argparse.Namespace(
        odtrain_python=sys.executable, ort_python=args.ort_python, torch_python=args.ort_python, workload=workload,
        models=models, steps=args.steps, warmup=args.warmup, threads=2, odtrain_threads=args.odtrain_threads,
        timeout=args.timeout, verbose=False)
    return compare.spawn(worker_args, system, phase, str(artifacts), cache)


# ---------------------------------------------------------------- the table
def short_error(message: str) -> str:
    """The sentence of an ONNX Runtime error that says what is wrong, without its source location."""
    return message[message.index("Expected:"):].strip() if "Expected:" in message else message.strip()[-240:]


def rows(results: dict) -> list[tuple[str, str, str]]:
    table = []
    for name, form in FORMS.items():
        o = results["outputs"][name]
        table += [
            (f"outputs, {form}", "top-1 equal to onnxruntime's", f"{o['top1_equal']}/{o['images']} images"),
            ("", "max |logits - onnxruntime's|",
             f"{o['max_abs_logit_difference']:.2g} (logit range {o['logit_range']:.2g}; onnxruntime's optimised "
             f"and as-written graphs differ by {o['onnxruntime_optimised_vs_as_written']:.2g})"),
            ("", "pooled features: one step apart, most steps apart",
             f"{100 * o['features_one_step_apart']:.1f}%, {o['max_feature_difference_steps']:.0f}"),
            ("", "loss on golden batch 0 from onnxruntime's logits", f"{o['onnxruntime_loss0']:.4f}")]
    for name, form in FORMS.items():
        p = results["personalised"][name]
        table += [(f"head gradients at step 0, {form}", "max rel. diff to those from onnxruntime's features",
                   f"{p['head_gradient_rel_to_onnxruntime_features']:.2g}"),
                  ("", "... from odtrain's own features", f"{p['head_gradient_rel_to_odtrain_features']:.2g}")]
    for name, form in FORMS.items():
        quantized, floating = results["personalised"][name], results["float_memory"]
        table.append((f"memory report, {form}", "frozen backbone: QDQ / float",
                      f"{quantized['frozen_bytes'] / MIB:.2f} / {floating['frozen_bytes'] / MIB:.2f} MiB = "
                      f"{quantized['frozen_bytes'] / floating['frozen_bytes']:.3f}"))
        table.append(("", "arena at batch 8: QDQ / float",
                      f"{quantized['arena_bytes'] / MIB:.1f} / {floating['arena_bytes'] / MIB:.1f} MiB"))
    q = results["qat"]

    def accuracy(key):
        return f"{100 * q[key]:.1f}% ({round(q[key] * q['held_out'])}/{q['held_out']})"

    table += [(f"QAT, digits classifier, {q['epochs']} epochs", "onnxruntime held-out accuracy: int8 QAT export",
               f"{accuracy('qat_onnxruntime_accuracy')}; {q['qat_int8_weights']} int8 weights, "
               f"{q['qat_int32_biases']} int32 biases; "
               f"odtrain's fake-quantized eval {accuracy('qat_odtrain_eval_accuracy')}"),
              ("", "... float-trained export", accuracy("float_onnxruntime_accuracy")),
              ("", "QAT - float",
               f"{100 * (q['qat_onnxruntime_accuracy'] - q['float_onnxruntime_accuracy']):+.1f} points")]
    timing = results.get("timing")
    if timing:
        runs = timing["runs"]
        float_run = runs.get("odtrain, float")
        for label, run in runs.items():
            ratio = ""
            if float_run and label.startswith("odtrain, QDQ"):
                ratio = (f"; {run['median_step_ms'] / float_run['median_step_ms']:.2f}x the float step, "
                         f"{run['peak_rss_mib'] / float_run['peak_rss_mib']:.2f}x its peak")
            added = "-" if run["train_rss_mib"] is None else f"{run['train_rss_mib']:.0f}"
            processes = f"median of {run['processes']} process" + "es" * (run["processes"] != 1)
            table.append((f"step, batch 8: {label}", processes,
                          f"{run['median_step_ms']:.1f} ms, peak RSS {run['peak_rss_mib']:.0f} MiB "
                          f"(training adds {added}), step-0 loss {run['loss0']:.4f}{ratio}"))
        for label, error in timing["errors"].items():
            table.append((f"step, batch 8: {label}", "failed", short_error(error)))
    return table


def render(table, header: str) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(2)]
    lines = [header, "  ".join(("item".ljust(widths[0]), "measure".ljust(widths[1]), "value"))]
    lines += ["  ".join((item.ljust(widths[0]), measure.ljust(widths[1]), value)) for item, measure, value in table]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ort-python", help="python of the onnxruntime-training venv (ONNX Runtime training runs)")
    parser.add_argument("--repeat", type=int, default=5, help="counted rounds of fresh processes")
    parser.add_argument("--steps", type=int, default=12, help="training steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of a process's median")
    parser.add_argument("--odtrain-threads", type=int, default=0, help="ODTRAIN_NUM_THREADS; default odtrain's own")
    parser.add_argument("--qat-epochs", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--no-timing", action="store_true", help="skip 5, the step time and peak RSS")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (models, artifacts)")
    parser.add_argument("--in-process", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        return measure_in_process(args.in_process, args.qat_epochs)

    started, load = time.time(), os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="odtrain-quantized-"))
    # The measurements in one process, the step timings in others started from this one, which stays small: a
    # process's ru_maxrss starts from that of the process that started it (Linux keeps the peak across exec).
    measured = subprocess.run([sys.executable, __file__, "--in-process", str(scratch), "--qat-epochs",
                               str(args.qat_epochs)], timeout=args.timeout)
    if measured.returncode:
        sys.exit(f"the measurements in {scratch} failed (exit code {measured.returncode})")
    results = json.loads((scratch / "in_process.json").read_text())
    if not args.no_timing:
        print(f"personalising steps, {args.repeat} rounds after a warm-up round", flush=True)
        results["timing"] = timed_runs(args, scratch / "models", scratch)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results["setting"] = {"commit": commit, "cpus": os.cpu_count(), "load_before": load, "load_after": os.getloadavg(),
                          "seconds": time.time() - started, "steps": args.steps, "warmup": args.warmup,
                          "repeat": args.repeat, "odtrain_threads": args.odtrain_threads or "default"}
    header = (f"\nquantized models, odtrain {commit}: {os.cpu_count()} CPUs, load average {load[0]:.1f} before and "
              f"{results['setting']['load_after'][0]:.1f} after")
    if not args.no_timing:
        header += (f"; steps: {args.steps} per process, median after {args.warmup}; odtrain threads "
                   f"{args.odtrain_threads or 'default'}")
    print(render(rows(results), header))
    if args.json:
        Path(args.json).write_text(json.dumps(results | {"table": rows(results)}, indent=1))
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
