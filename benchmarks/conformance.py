"""How many of ONNX's backend node cases a runtime runs and matches: odtrain's InferenceSession, or
onnxruntime's with --onnxruntime.

    python benchmarks/conformance.py [--onnxruntime] [--top 20] [--failures failures.txt]

Each case (built in memory by onnx.backend.test.loader, no download) runs its first data set with the
inputs fed as ONNX feeds them; outputs must have the expected shapes and dtypes and match (floats to
rtol 1e-4, atol 1e-5, NaN equal to NaN; the float types numpy lacks, such as bfloat16 and float8,
exactly, NaN equal to NaN; everything else exactly); sequences are fed and compared as lists of
arrays, an optional holding none as None. Prints the count, then the op types
that keep the most cases from running: unsupported ops by the cases that name them, other errors by
their first line.
"""
from __future__ import annotations

import argparse
import collections
import re
import warnings

import numpy as np


def _array(value):
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else np.asarray(value)


def _odtrain_run(model, feeds):
    from odtrain.inference import InferenceSession

    return InferenceSession(model).run(None, feeds)


def _onnxruntime_run(model, feeds):
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _value(data):
    """A data set's value: an array, a list of arrays (a sequence) or None (an optional holding none)."""
    if data is None:
        return None
    if isinstance(data, (list, tuple)):
        return [_array(t) for t in data]
    return _array(data)


def _mismatch(got, expected) -> str | None:
    """None when `got` matches `expected` (arrays, lists of them, None), else how it differs."""
    if expected is None or isinstance(expected, list):
        if expected is None or got is None or not isinstance(got, (list, tuple)):
            return None if got is None and expected is None else f"{type(got).__name__} instead of a sequence"
        if len(got) != len(expected):
            return f"a sequence of {len(got)} instead of {len(expected)}"
        return next((m for m in map(_mismatch, got, expected) if m), None)
    g, e = np.asarray(got), expected
    if g.shape != e.shape or g.dtype != e.dtype:
        return f"output {g.dtype}{list(g.shape)} instead of {e.dtype}{list(e.shape)}"
    if e.dtype.kind == "V" and e.dtype.name.startswith(("float", "bfloat")):  # ml_dtypes' floats
        g, e = g.astype(np.float64), e.astype(np.float64)
        same = np.array_equal(g, e, equal_nan=True)
    else:
        same = (np.allclose(g, e, rtol=1e-4, atol=1e-5, equal_nan=True) if e.dtype.kind == "f"
                else np.array_equal(g, e))
    return None if same else "wrong values"


def check(case, run) -> str | None:
    """None when the case runs and matches, else why not."""
    if not case.data_sets:
        return "no data"
    inputs, outputs = case.data_sets[0]
    feeds = {i.name: _value(t) for i, t in zip(case.model.graph.input, inputs)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run(case.model, feeds)
    except Exception as error:  # noqa: BLE001 (any failure is a reason to report)
        return f"{type(error).__name__}: {error}"
    expected = [_value(t) for t in outputs]
    if len(got) != len(expected):
        return f"{len(got)} outputs instead of {len(expected)}"
    return next((m for m in map(_mismatch, got, expected) if m), None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxruntime", action="store_true", help="count onnxruntime instead of odtrain")
    parser.add_argument("--top", type=int, default=20, help="how many missing groups to print")
    parser.add_argument("--failures", help="write each failing case and its reason to this file")
    args = parser.parse_args(argv)
    from onnx.backend.test.loader import load_model_tests

    run = _onnxruntime_run if args.onnxruntime else _odtrain_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    reasons = {case.name: check(case, run) for case in cases}
    failed = {name: reason for name, reason in reasons.items() if reason is not None}
    print(f"{len(cases) - len(failed)} of {len(cases)} node cases run and match")
    groups: collections.Counter = collections.Counter()
    for reason in failed.values():
        unsupported = re.search(r"no kernel for ([^(]*) \(", reason)
        if unsupported:
            groups.update(f"no kernel: {kind.strip()}" for kind in unsupported.group(1).split(","))
        else:
            groups[re.sub(r"'[^']*'|\d+", "_", reason.splitlines()[0])[:100]] += 1
    for group, count in groups.most_common(args.top):
        print(f"{count:5d}  {group}")
    if args.failures:
        with open(args.failures, "w") as out:
            out.writelines(f"{name}\t{reason.splitlines()[0]}\n" for name, reason in sorted(failed.items()))


if __name__ == "__main__":
    main()
