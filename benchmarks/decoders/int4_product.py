"""One int4 product of a decoder's MLP against numpy's sgemm on the same weight in float32.

    python int4_product.py [--rows 256] [--shapes 8192x2048,2048x8192] [--threads 1] [--repeats 7]
                           [--clock cpu|wall] [--head]

A random weight W [R, C] is quantized as graph/int4.py does (blocks of 32 along C, the input axis, as
Llama's projections are stored) and multiplied by `--rows` activations through the DequantizedMatMul binding:
the forward product Y = X · dequant(W)ᵀ (transB=1) and the input gradient dX = dY · dequant(W) (transB=0).
Beside each, numpy's sgemm on dequant(W) in float32 (the float32 model's product; one BLAS thread with
--threads 1). `--head` adds the tied vocabulary head's LinearCrossEntropy (forward with dHidden) on a
[128256, 2048] weight. Printed: GF/s (median of `--repeats` calls), the panel scratch in bytes, the largest
difference from float32 sgemm relative to the largest output.

The default clock is the process's CPU time: steady on a shared machine, blind to parallel speed-up (use
`--clock wall` for more than one thread). Compare code versions by alternating runs in fresh processes.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np


def timed(run, repeats, read):
    seconds = []
    for _ in range(repeats):
        start = read()
        run()
        seconds.append(read() - start)
    return float(np.median(seconds))


@contextlib.contextmanager
def one_blas_thread():
    from odtrain.kernels.blas import hold_one_thread, release_thread

    hold_one_thread()
    try:
        yield
    finally:
        release_thread()


def call_all(calls):
    for kernel, args in calls:
        kernel(*args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="activation rows (batch x sequence)")
    parser.add_argument("--shapes", default="8192x2048,2048x8192", help="weights R x C, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--head", action="store_true", help="also the tied head's fused vocabulary loss")
    args = parser.parse_args()

    from odtrain.graph.int4 import dequantize, int4_blocks
    from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN, SCRATCH
    from odtrain.threads import set_num_threads

    set_num_threads(args.threads)
    read = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)
    m = args.rows
    cases = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    for rows, columns in cases:
        w = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
        packed, scale = int4_blocks(w, 1, 32)
        dense = dequantize(packed, scale, 1, 32).astype(np.float32)
        for trans_b in (1, 0):
            a = rng.standard_normal((m, columns if trans_b else rows)).astype(np.float32)
            out = np.empty((m, rows if trans_b else columns), np.float32)
            attrs = dict(transB=trans_b, axis=1, block_size=32)
            nbytes = SCRATCH[(ODTRAIN_DOMAIN, "DequantizedMatMul")](
                [(a.shape, a.dtype), (packed.shape, packed.dtype)], [], threads=args.threads, **attrs)
            scratch = np.zeros(nbytes, np.uint8)
            calls = BINDINGS[(ODTRAIN_DOMAIN, "DequantizedMatMul")]([a, packed, scale], [out], threads=args.threads,
                                                                    scratch=scratch, **attrs)
            product = dense.T if trans_b else dense
            expected = a @ product
            with one_blas_thread():  # the kernels' parts are the threads, as in a step
                call_all(calls)
                seconds = timed(lambda: call_all(calls), args.repeats, read)
            with one_blas_thread() if args.threads == 1 else contextlib.nullcontext():
                dense_seconds = timed(lambda: np.dot(a, product), args.repeats, read)
            flops = 2 * m * rows * columns
            error = float(np.max(np.abs(out - expected)) / np.max(np.abs(expected)))
            print(f"W [{rows} x {columns}] transB={trans_b} M={m} threads={args.threads}: int4 "
                  f"{flops / seconds / 1e9:6.1f} GF/s ({seconds * 1e3:6.1f} ms), sgemm float32 "
                  f"{flops / dense_seconds / 1e9:6.1f} GF/s; scratch {nbytes} B; difference {error:.1e}", flush=True)
    if args.head:
        head(m, args.threads, args.repeats, read, rng)


def head(m, threads, repeats, read, rng, vocabulary=128256, hidden_width=2048):
    """LinearCrossEntropy on a tied int4 head W [vocabulary, hidden] (transB=1), with dHidden."""
    from odtrain.graph.int4 import int4_blocks
    from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN, SCRATCH

    w = (rng.standard_normal((vocabulary, hidden_width)) * 0.02).astype(np.float32)
    packed, scale = int4_blocks(w, 1, 32)
    del w
    hidden = rng.standard_normal((1, m, hidden_width)).astype(np.float32)
    labels = rng.integers(0, vocabulary, (1, m)).astype(np.int64)
    attrs = dict(transB=1, axis=1, block_size=32, ignore_index=-100, reduction="mean")
    specs = [(hidden.shape, hidden.dtype), (packed.shape, packed.dtype), (labels.shape, labels.dtype),
             (scale.shape, scale.dtype)]
    nbytes = SCRATCH[(ODTRAIN_DOMAIN, "LinearCrossEntropy")](specs, [], threads=threads, **attrs)
    scratch = np.zeros(nbytes // 4 + 1, np.float32).view(np.uint8)[:nbytes]
    loss, dhidden = np.zeros((), np.float32), np.empty_like(hidden)
    calls = BINDINGS[(ODTRAIN_DOMAIN, "LinearCrossEntropy")]([hidden, packed, labels, scale], [loss, dhidden],
                                                             scratch=scratch, threads=threads, **attrs)
    with one_blas_thread():
        call_all(calls)
        seconds = timed(lambda: call_all(calls), repeats, read)
    flops = 2 * 2 * m * vocabulary * hidden_width
    print(f"head LinearCrossEntropy W [{vocabulary} x {hidden_width}] M={m} threads={threads}: "
          f"{flops / seconds / 1e9:6.1f} GF/s ({seconds * 1e3:7.1f} ms); scratch {nbytes} B", flush=True)


if __name__ == "__main__":
    main()
