"""A Mamba-style selective scan's forward, as a Scan and as a Loop: odtrain beside onnxruntime.

    python benchmarks/loops.py [--steps 1600] [--model 256] [--state 16] [--runs 7] [--threads 2] [--train]

The model (microsoft/onnxruntime#27796's size by default: batch 1, d_model 256, d_state 16, 1,600 steps),
the projections before and after the scan included:
    Δ = softplus(x·W_Δ + b_Δ), B = x·W_B, C = x·W_C            (input-dependent, [T, D] and [T, N])
    A = −exp(A_log)                                              ([D, N])
    h_t = exp(Δ_t·A)·h_{t−1} + Δ_t·B_t·x_t,  y_t = h_t·C_t        (h: [D, N])
    out = y·W_out
written once with a Scan over (x, Δ, B, C) and once with a Loop that gathers row i of each. Each
runtime runs each model `--runs` times, alternated in one process (odtrain Scan, onnxruntime Scan,
odtrain Loop, onnxruntime Loop, ...), both at `--threads` threads; the medians are printed in ms,
with a hand-written Numba loop of the same recurrence (the scan alone, projections by numpy) as
the floor. With `--train`, odtrain's training step (MSE loss, AdamW; generate_artifacts, Module) and
eval step of each form instead. Numbers from a shared machine move by ±25%: say how loaded it was.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def selective_scan_model(steps: int, model: int, state: int, form: str, seed: int = 0):
    """The ONNX model of the docstring, its recurrence a Scan (`form="scan"`) or a Loop (`form="loop"`)."""
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    rng = np.random.default_rng(seed)

    def weight(name, *shape, scale=None):
        value = (rng.standard_normal(shape) * (scale or 1 / np.sqrt(shape[0]))).astype(np.float32)
        return numpy_helper.from_array(value, name)

    weights = [weight("W_dt", model, model), weight("b_dt", model, scale=0.1), weight("W_B", model, state),
               weight("W_C", model, state), weight("W_out", model, model),
               numpy_helper.from_array(np.log(np.tile(np.arange(1, state + 1, dtype=np.float32), (model, 1))), "A_log"),
               numpy_helper.from_array(np.zeros((model, state), np.float32), "h0"),
               numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
               numpy_helper.from_array(np.array([0], np.int64), "zero_axis")]
    before = [helper.make_node("MatMul", ["x", "W_dt"], ["dt_lin"]), helper.make_node("Add", ["dt_lin", "b_dt"], ["dt_pre"]),
              helper.make_node("Softplus", ["dt_pre"], ["dt"]), helper.make_node("MatMul", ["x", "W_B"], ["B"]),
              helper.make_node("MatMul", ["x", "W_C"], ["C"]), helper.make_node("Exp", ["A_log"], ["A_pos"]),
              helper.make_node("Neg", ["A_pos"], ["A"])]
    step = [helper.make_node("Unsqueeze", ["dt_t", "one_axis"], ["dt_col"]),          # [D, 1]
            helper.make_node("Mul", ["dt_col", "A"], ["dtA"]), helper.make_node("Exp", ["dtA"], ["decay"]),
            helper.make_node("Unsqueeze", ["B_t", "zero_axis"], ["B_row"]),           # [1, N]
            helper.make_node("Mul", ["dt_col", "B_row"], ["dtB"]),
            helper.make_node("Unsqueeze", ["x_t", "one_axis"], ["x_col"]),
            helper.make_node("Mul", ["dtB", "x_col"], ["drive"]),
            helper.make_node("Mul", ["decay", "h_in"], ["kept"]), helper.make_node("Add", ["kept", "drive"], ["h_out"]),
            helper.make_node("Unsqueeze", ["C_t", "zero_axis"], ["C_row"]),
            helper.make_node("Mul", ["h_out", "C_row"], ["hc"]),
            helper.make_node("ReduceSum", ["hc", "one_axis"], ["y_t"], keepdims=0)]
    d, n = [model], [state]
    if form == "scan":
        body = helper.make_graph(step, "ssm_step",
                                 [helper.make_tensor_value_info("h_in", F, [model, state]),
                                  helper.make_tensor_value_info("x_t", F, d), helper.make_tensor_value_info("dt_t", F, d),
                                  helper.make_tensor_value_info("B_t", F, n), helper.make_tensor_value_info("C_t", F, n)],
                                 [helper.make_tensor_value_info("h_out", F, [model, state]),
                                  helper.make_tensor_value_info("y_t", F, d)])
        recurrence = [helper.make_node("Scan", ["h0", "x", "dt", "B", "C"], ["hT", "y"], body=body, num_scan_inputs=4)]
    else:
        gathers = [helper.make_node("Gather", [whole, "i"], [row], axis=0)
                   for whole, row in (("x", "x_t"), ("dt", "dt_t"), ("B", "B_t"), ("C", "C_t"))]
        body = helper.make_graph(gathers + step + [helper.make_node("Identity", ["cond_in"], ["cond_out"])], "ssm_step",
                                 [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                  helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                                  helper.make_tensor_value_info("h_in", F, [model, state])],
                                 [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                                  helper.make_tensor_value_info("h_out", F, [model, state]),
                                  helper.make_tensor_value_info("y_t", F, d)])
        weights += [numpy_helper.from_array(np.array(steps, np.int64), "trip"),
                    numpy_helper.from_array(np.array(True), "go")]
        recurrence = [helper.make_node("Loop", ["trip", "go", "h0"], ["hT", "y"], body=body)]
    after = [helper.make_node("MatMul", ["y", "W_out"], ["out"])]
    graph = helper.make_graph(before + recurrence + after, f"selective_scan_{form}",
                              [helper.make_tensor_value_info("x", F, [steps, model])],
                              [helper.make_tensor_value_info("out", F, [steps, model])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def numba_floor(steps: int, model: int, state: int):
    """The recurrence as one hand-written Numba loop (the floor a compiled body aims at)."""
    import numba

    @numba.njit(cache=False, fastmath=False, error_model="numpy")
    def recurrence(x, dt, B, C, A, h, y):
        for t in range(x.shape[0]):
            for d in range(A.shape[0]):
                total = np.float32(0)
                for k in range(A.shape[1]):
                    h[d, k] = np.exp(dt[t, d] * A[d, k]) * h[d, k] + dt[t, d] * B[t, k] * x[t, d]
                    total += h[d, k] * C[t, k]
                y[t, d] = total

    return recurrence


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--model", type=int, default=256)
    parser.add_argument("--state", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train", action="store_true", help="time odtrain's training and eval steps instead")
    args = parser.parse_args(argv)
    os.environ.setdefault("ODTRAIN_NUM_THREADS", str(args.threads))
    if args.train:
        train_steps(args)
        return
    import onnxruntime

    from odtrain.inference import InferenceSession

    x = np.random.default_rng(1).standard_normal((args.steps, args.model)).astype(np.float32)
    runners = {}
    for form in ("scan", "loop"):
        proto = selective_scan_model(args.steps, args.model, args.state, form)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = args.threads
        ort = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        ours = InferenceSession(proto)
        expected = ort.run(None, {"x": x})[0]
        got = ours.run(None, {"x": x})[0]  # the first run plans and compiles
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4)
        runners[f"odtrain {form}"] = lambda ours=ours: ours.run(None, {"x": x})
        runners[f"onnxruntime {form}"] = lambda ort=ort: ort.run(None, {"x": x})
    # the floor: projections by numpy, the recurrence by one Numba loop
    proto = selective_scan_model(args.steps, args.model, args.state, "scan")
    from onnx import numpy_helper

    w = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    recurrence = numba_floor(args.steps, args.model, args.state)

    def by_hand():
        dt = np.logaddexp(0, x @ w["W_dt"] + w["b_dt"]).astype(np.float32)
        B, C, A = x @ w["W_B"], x @ w["W_C"], -np.exp(w["A_log"])
        h, y = np.zeros((args.model, args.state), np.float32), np.empty((args.steps, args.model), np.float32)
        recurrence(x, dt, B, C, A, h, y)
        return y @ w["W_out"]

    np.testing.assert_allclose(by_hand(), runners["onnxruntime scan"]()[0], rtol=2e-3, atol=2e-4)
    runners["numba loop by hand"] = by_hand
    times = {name: [] for name in runners}
    for _ in range(args.runs):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"selective scan forward: batch 1, d_model {args.model}, d_state {args.state}, {args.steps} steps, "
          f"{args.threads} threads, median of {args.runs} alternated runs (ms)")
    for name, values in times.items():
        print(f"  {name:22s} {statistics.median(values):9.1f}   (min {min(values):.1f}, max {max(values):.1f})")


def train_steps(args) -> None:
    """The median training step (forward, loss, backward) and eval step of each form, in ms."""
    import pathlib
    import tempfile

    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.steps, args.model)).astype(np.float32)
    target = rng.standard_normal((args.steps, args.model)).astype(np.float32)
    print(f"selective scan training: d_model {args.model}, d_state {args.state}, {args.steps} steps, "
          f"{args.threads} threads, median of {args.runs} (ms; the first step, which compiles, left out)")
    for form in ("scan", "loop"):
        folder = pathlib.Path(tempfile.mkdtemp())
        artifacts.generate_artifacts(selective_scan_model(args.steps, args.model, args.state, form),
                                     requires_grad=["W_dt", "b_dt", "W_B", "W_C", "W_out", "A_log"],
                                     loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=folder)
        module = Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"),
                        folder / "eval_model.onnx")
        times = {"train": [], "eval": []}
        for run in range(args.runs + 1):
            for mode in ("train", "eval"):
                module.train(mode == "train")
                start = time.perf_counter()
                module(x, target)
                if run:
                    times[mode].append((time.perf_counter() - start) * 1e3)
        print(f"  {form}: training step {statistics.median(times['train']):.0f}, "
              f"eval step {statistics.median(times['eval']):.0f}")


if __name__ == "__main__":
    main()
