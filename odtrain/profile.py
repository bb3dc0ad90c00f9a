"""Where a training step's time goes: per node, per op type, per phase, and the products against the GEMM peak.

    report = odtrain.profile.profile_artifacts("artifacts", batch_size=32, steps=10, threads=None)
    print(report.render()); report.to_dict(); report.nodes[0].seconds

How it measures:
- The artifacts are loaded as `odtrain train` loads them (CheckpointState, Module, Optimizer) and the
  training step is bound at `batch_size` (and `sequence_length`: `Module.executable_step_at`). Float inputs are drawn from
  a normal distribution (fixed seed), integer inputs (labels, token ids) are zeros.
- Each step runs twice, alternating: once as training runs it (`module(...)`, `optimizer.step()`,
  `lazy_reset_grad()`), timed as a whole; once as a timed twin of the executor's loop (`timed_calls`),
  which runs the same bound calls with a clock read around each. The untimed loop is not touched.
- A node's time is the sum of its calls' times in one step; reported is its median over `steps`
  steps after `warmup` steps (compilation or cache loading, first touches of the arena). The profiled
  total is the sum of those medians; beside it stands the median untimed step, so the clock's own
  cost (well under a microsecond a call) can be judged.
- The clock is wall time, or with `clock="cpu"` the process's CPU time, every thread summed: the
  work a call did, steady on a busy machine where wall times stretch with every preemption, but
  blind to parallel speed-up (a kernel split over two threads costs its CPU time on both).
- Phases: forward (up to the loss), backward (the nodes that depend on the loss gradient seed),
  optimizer (`Optimizer.step()`, or the updates fused into backward), feeds (copying the inputs in).
- Products: nodes for which `graph.cost.product_flops` counts operations (Conv, Gemm, MatMul,
  FusedMatMul and their gradients that are products). Their time includes what runs around BLAS in
  the same kernel (a convolution's im2col, a bias broadcast). GF/s = those operations over that time.
- With a kernel library (odtrain/kernel_library/; the device's route), the timed twin runs each call the
  library holds as its own foreign call into it, the others as the JIT's kernels; the peak's product too.
- Threads: the step runs at its module's thread count (`odtrain.threads`), the timed twin too (its
  calls were bound for that count and run on that many of Numba's threads); BLAS runs one thread
  inside each part of a product.
- The peak is a float32 square MatMul (PEAK_SIZE³) bound by the executor, through the same BLAS
  and kernel the products call, at 1 thread and at the step's and the machine's thread counts:
  the best of PEAK_REPEATS runs, measured once per process and thread count. Shares of the peak are
  of the higher of that and the step's fastest product: a busy machine may slow the measured peak
  below what a product then reaches, and no share exceeds 100%.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from .graph.autodiff import LOSS_SEED
from .graph.cost import product_flops
from .graph.errors import ArgumentError, KernelsUnavailableError
from .graph.ir import Graph, Node, TensorType
from .graph.ops.training import APPLY_UPDATE
from .graph.schedule import split_forward_backward
from .graph.wording import count

PEAK_SIZE = 1024
PEAK_REPEATS = 10
PHASES = ("feeds", "forward", "backward", "optimizer")
# wall: elapsed time; cpu: CPU time of the process, every thread summed (the work done, whoever waited)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_peaks: dict[tuple[int, str], float] = {}


def timed_calls(calls: list, elapsed: np.ndarray, clock=time.perf_counter, library=None, threads: int = 1) -> None:
    """Run a bound step's calls in order, as `ExecutableStep.run` does, writing each call's seconds to `elapsed`;
    the calls a kernel `library` holds run in it (one foreign call each, packed before the first run:
    `library_calls`), the others as the JIT's kernels."""
    prepared = library_calls(calls, library) if library is not None else [None] * len(calls)
    for index, ((kernel, args), call) in enumerate(zip(calls, prepared)):
        start = clock()
        if call is None:
            kernel(*args)
        elif library.run(call, threads) >= 0:
            raise ValueError(library.message(kernel, args))
        elapsed[index] = clock() - start


_packed_calls: dict[int, tuple] = {}  # id of a step's call list -> (the list, its library calls)


def library_calls(calls: list, library) -> list:
    """Each call as a one-call CallList of `library`, or None where the library lacks it (packed once per list)."""
    from .kernel_library import CallList, pack

    held = _packed_calls.get(id(calls))
    if held is None or held[0] is not calls:
        prepared = []
        for kernel, args in calls:
            address = library.address(kernel, args)
            prepared.append(CallList([address], [pack(args)]) if address is not None else None)
        held = _packed_calls[id(calls)] = (calls, prepared)
    return held[1]


def gemm_peak(threads: int, clock: str = "wall", library=None) -> float:
    """GF/s of a float32 PEAK_SIZE³ MatMul bound by the executor at `threads` threads, as a step's products
    are (best of PEAK_REPEATS) on `clock` (CLOCKS), measured once per process and thread count; through the
    kernel `library` when it holds the product's kernel (KernelsUnavailableError where it does not and Numba
    is not installed)."""
    threads, read = max(int(threads), 1), CLOCKS[clock]
    if (threads, clock) not in _peaks:
        from .executor import ExecutableStep

        rng = np.random.default_rng(0)
        square = TensorType(np.dtype(np.float32), (PEAK_SIZE, PEAK_SIZE))
        operands = {name: rng.standard_normal(square.shape, dtype=np.float32) for name in ("a", "b")}
        graph = Graph([Node("MatMul", ["a", "b"], ["y"], name="peak")], ["a", "b"], ["y"],
                      value_types={"a": square, "b": square, "y": square})
        # operands held outside the arena: a run is the product alone
        product = ExecutableStep(graph, feed_types={}, external=operands, threads=threads, library=library)
        product.run([])  # the kernel loaded, the threads started
        best = float("inf")
        for _ in range(PEAK_REPEATS):
            start = read()
            product.run([])
            best = min(best, read() - start)
        _peaks[threads, clock] = 2.0 * PEAK_SIZE ** 3 / best / 1e9
    return _peaks[threads, clock]


class _Rate:
    """Seconds and operations, and the GF/s they make."""

    seconds: float
    flops: float

    @property
    def gflops_per_second(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.flops and self.seconds > 0 else None

    def _rates(self) -> dict:
        return {"ms": 1e3 * self.seconds, "gflop": self.flops / 1e9, "gflops_per_second": self.gflops_per_second}


@dataclass
class NodeTime(_Rate):
    """One node of the step (or a pseudo-node: the feeds, the optimizer step, a gradient accumulation)."""

    name: str
    op_type: str
    phase: str
    calls: int
    seconds: float  # median over the profiled steps of the node's calls' summed time
    flops: float = 0.0  # operations of a product (2 per multiply-add), 0 for other nodes

    def to_dict(self) -> dict:
        return {"name": self.name, "op_type": self.op_type, "phase": self.phase, "calls": self.calls, **self._rates()}


@dataclass
class OpTypeTime(_Rate):
    """The nodes of one op type in one phase, summed."""

    op_type: str
    phase: str
    nodes: int
    calls: int
    seconds: float
    flops: float

    def to_dict(self) -> dict:
        return {"op_type": self.op_type, "phase": self.phase, "nodes": self.nodes, "calls": self.calls,
                **self._rates()}


@dataclass
class StepProfile:
    artifacts: str
    batch_size: int
    steps: int
    threads: int  # the step's thread count: the parts its parallel kernels were bound for
    numba_threads: int  # the threads those parts ran on: the fewest of any timed step (odtrain.threads.running)
    step_seconds: float  # median of the untimed steps
    nodes: list[NodeTime] = field(default_factory=list)  # in execution order
    peaks: dict[int, float] = field(default_factory=dict)  # threads -> float32 GEMM GF/s
    clock: str = "wall"  # what the seconds are (CLOCKS)
    sequence_length: int | None = None  # the inputs' other symbolic axes (a language model's sequence)
    runner: str = "Numba"  # what ran the parallel parts: Numba's threads, or the kernel library's (a device)

    @property
    def profiled_seconds(self) -> float:
        return sum(n.seconds for n in self.nodes)

    @property
    def phases(self) -> dict[str, float]:
        return {phase: sum(n.seconds for n in self.nodes if n.phase == phase) for phase in PHASES}

    @property
    def op_types(self) -> list[OpTypeTime]:
        """Per (phase, op type), in phase order, the slowest first within a phase."""
        groups: dict[tuple[str, str], OpTypeTime] = {}
        for n in self.nodes:
            group = groups.setdefault((n.phase, n.op_type), OpTypeTime(n.op_type, n.phase, 0, 0, 0.0, 0.0))
            group.nodes, group.calls = group.nodes + 1, group.calls + n.calls
            group.seconds, group.flops = group.seconds + n.seconds, group.flops + n.flops
        return sorted(groups.values(), key=lambda g: (PHASES.index(g.phase), -g.seconds))

    @property
    def product_seconds(self) -> float:
        return sum(n.seconds for n in self.nodes if n.flops)

    @property
    def product_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    @property
    def fastest_product(self) -> "NodeTime | None":
        """The product node with the highest GF/s in this profile."""
        return max((n for n in self.nodes if n.gflops_per_second), key=lambda n: n.gflops_per_second, default=None)

    @property
    def peak(self) -> float | None:
        """The GEMM peak at the step's thread count: the measured one, or this step's fastest product where
        that ran faster (the peak was measured while other work slowed it), so that no share exceeds 100%."""
        measured, fastest = self.peaks.get(self.threads), self.fastest_product
        if fastest is not None and (measured is None or fastest.gflops_per_second > measured):
            return fastest.gflops_per_second
        return measured

    @property
    def peak_source(self) -> str | None:
        """Where `peak` comes from: 'measured', or 'node NAME' (a product that outran the measured peak)."""
        if self.peak is None:
            return None
        return "measured" if self.peak == self.peaks.get(self.threads) else f"node {self.fastest_product.name}"

    @property
    def step_gflops_per_second(self) -> float | None:
        """The whole step's rate: its products' operations (the training FLOPs) over the untimed step's time, so
        that everything between the products counts against it."""
        return self.product_flops / self.step_seconds / 1e9 if self.product_flops and self.step_seconds else None

    def _of_peak(self, gflops: float | None) -> float | None:
        return gflops / self.peak if gflops and self.peak else None

    def to_dict(self) -> dict:
        product_gflops = self.product_flops / self.product_seconds / 1e9 if self.product_seconds else None
        return {"artifacts": self.artifacts, "batch_size": self.batch_size, "sequence_length": self.sequence_length,
                "steps": self.steps,
                "step": {"gflops_per_second": self.step_gflops_per_second,
                         "of_peak": self._of_peak(self.step_gflops_per_second)},
                "threads": self.threads, "numba_threads": self.numba_threads, "threads_of": self.runner,
                "clock": self.clock,
                "step_ms": 1e3 * self.step_seconds,
                "profiled_ms": 1e3 * self.profiled_seconds,
                "phases_ms": {k: 1e3 * v for k, v in self.phases.items()},
                "products": {"ms": 1e3 * self.product_seconds, "gflop": self.product_flops / 1e9,
                             "gflops_per_second": product_gflops, "of_peak": self._of_peak(product_gflops)},
                "gemm_peak_gflops_per_second": {str(k): v for k, v in sorted(self.peaks.items())},
                "of_peak_against": {"gflops_per_second": self.peak, "source": self.peak_source},
                "op_types": [g.to_dict() for g in self.op_types],
                "nodes": [n.to_dict() for n in self.nodes]}

    def render(self, top: int = 15) -> str:
        total = self.profiled_seconds or 1.0
        ms = (lambda seconds: f"{1e3 * seconds:.2f}")
        share = (lambda seconds: f"{100 * seconds / total:.1f}")
        rate = (lambda gf: f"{gf:.1f}" if gf else "")
        of_peak = (lambda gf: f"{100 * self._of_peak(gf):.0f}%" if self._of_peak(gf) else "")
        threads = f"{count(self.threads, 'thread')}, " + (
            count(self.numba_threads, "Numba thread") if self.runner == "Numba" else
            f"{count(self.numba_threads, 'thread')} of the kernel library")
        clock = "wall time" if self.clock == "wall" else "CPU time of every thread"
        shape = f"batch size {self.batch_size}" + (f", sequence length {self.sequence_length}"
                                                   if self.sequence_length else "")
        lines = [self._step_line()] if self.step_gflops_per_second and self.peak else []
        lines += [f"profile of {self.artifacts}: training step at {shape}, {threads}, "
                 f"medians of {count(self.steps, 'step')}, {clock}",
                 f"step {ms(self.step_seconds)} ms (untimed loop); profiled {ms(self.profiled_seconds)} ms: "
                 + ", ".join(f"{phase} {ms(s)} ms ({share(s)}%)" for phase, s in self.phases.items())]
        if self.product_seconds:
            gf = self.product_flops / self.product_seconds / 1e9
            peaks = ", ".join(f"{v:.1f} at {count(k, 'thread')}" for k, v in sorted(self.peaks.items()))
            lines.append(f"products (BLAS): {ms(self.product_seconds)} ms ({share(self.product_seconds)}%), "
                         f"{self.product_flops / 1e9:.3f} GFLOP, {gf:.1f} GF/s"
                         + (f" = {of_peak(gf)} of the GEMM peak at {count(self.threads, 'thread')}" if self.peak else "")
                         + (f"; float32 GEMM peak (GF/s): {peaks}" if peaks else ""))
            if self.peak_source not in (None, "measured"):
                lines.append(f"  (shares are of {self.peak:.1f} GF/s, reached by {self.peak_source}: faster than the "
                             "GEMM peak measured here, which other work on this machine slowed)")
        header = ("phase", "op type", "nodes", "calls", "ms", "%", "GFLOP", "GF/s", "of peak")
        rows = [header] + [(g.phase, g.op_type, str(g.nodes), str(g.calls), ms(g.seconds), share(g.seconds),
                            f"{g.flops / 1e9:.3f}" if g.flops else "", rate(g.gflops_per_second),
                            of_peak(g.gflops_per_second)) for g in self.op_types]
        lines += ["", "by op type:"] + _table(rows, 2)
        slowest = sorted(self.nodes, key=lambda n: -n.seconds)[:top]
        header = ("node", "op type", "phase", "calls", "ms", "%", "GF/s", "of peak")
        rows = [header] + [(n.name, n.op_type, n.phase, str(n.calls), ms(n.seconds), share(n.seconds),
                            rate(n.gflops_per_second), of_peak(n.gflops_per_second)) for n in slowest]
        lines += ["", f"the {len(slowest)} slowest of {count(len(self.nodes), 'node')}:"] + _table(rows, 3)
        return "\n".join(lines)


    def _step_line(self) -> str:
        """The first line: the whole step against the float32 GEMM peak, the goal one command away."""
        rate = self.step_gflops_per_second
        return (f"whole step: {100 * self._of_peak(rate):.0f}% of the float32 GEMM peak ({rate:.1f} of {self.peak:.1f} "
                f"GF/s at {count(self.threads, 'thread')}): {self.product_flops / 1e9:.3f} GFLOP of products in "
                f"{1e3 * self.step_seconds:.2f} ms")


def _table(rows: list[tuple], text_columns: int) -> list[str]:
    """Rows as aligned lines: the first `text_columns` columns flush left, the numbers flush right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    text = (lambda row: "  " + "  ".join(v.ljust(w) if i < text_columns else v.rjust(w)
                                         for i, (v, w) in enumerate(zip(row, widths))).rstrip())
    return [text(row) for row in rows]


def _random_feeds(views: list[np.ndarray], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f" else np.zeros(v.shape, v.dtype)
            for v in views]


def _phase_of(node, backward: set[int]) -> str:
    if node is not None and node.op_type == APPLY_UPDATE:  # an update fused into the backward pass
        return "optimizer"
    return "backward" if node is None or id(node) in backward else "forward"


def profile_artifacts(directory, batch_size: int, steps: int = 10, threads: int | None = None, warmup: int = 2,
                      seed: int = 0, clock: str = "wall", sequence_length: int | None = None,
                      input_shapes: dict | None = None) -> StepProfile:
    """Profile the training step of an artifact folder at `batch_size` (see the module docstring), the inputs'
    other symbolic axes at `sequence_length` (a language model's sequence), or the whole shapes of
    `input_shapes` by input name (an image model's height and width).

    `threads` sets odtrain's threads (`odtrain.threads.set_num_threads`, which stays set); None keeps the
    process's setting. Runs `warmup + steps` steps of each loop; the parameters train as they would."""
    from .threads import set_num_threads
    from .training import Session

    for label, value, least in (("batch size", batch_size, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                                ("threads", 1 if threads is None else threads, 1)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise ArgumentError(f"{label} must be an integer of at least {least}, got {value!r}")
    if clock not in CLOCKS:
        raise ArgumentError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    directory = os.fspath(directory)
    session = Session(directory, fresh_optimizer=True)
    if threads is not None:
        set_num_threads(threads)
    module, optimizer = session.module, session.optimizer
    bound = module.executable_step_at(int(batch_size), sequence_length=sequence_length, input_shapes=input_shapes)
    step_threads = bound.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    peaks = {}
    for threads_count in sorted({1, step_threads or 1, cores}):
        try:
            peaks[threads_count] = gemm_peak(threads_count, clock, module.kernel_library)
        except KernelsUnavailableError:  # a library without the peak's product and no Numba: no peak
            pass
    feeds = _random_feeds(bound.feed_views, seed)
    _, backward = split_forward_backward(bound.order, LOSS_SEED)
    untimed, feed_times, optimizer_times, ran_on = [], [], [], []
    elapsed = np.zeros((warmup + steps, len(bound.calls)))
    read = CLOCKS[clock]
    for step in range(warmup + steps):
        start = read()
        module(*feeds)
        optimizer.step()
        module.lazy_reset_grad()
        untimed.append(read() - start)

        start = read()
        for view, value in zip(bound.feed_views, feeds):
            np.copyto(view, value, casting="no")
        feed_times.append(read() - start)
        with bound.step_threads() as running:
            timed_calls(bound.calls, elapsed[step], read, bound.library, running)
        ran_on.append(running)
        start = read()
        optimizer.step()
        optimizer_times.append(read() - start)
        module.lazy_reset_grad()
    elapsed = elapsed[warmup:]

    columns: dict[int, list[int]] = {}  # node id -> its calls' columns
    owners = {}
    for column, node in enumerate(bound.call_nodes):
        columns.setdefault(id(node), []).append(column)
        owners[id(node)] = node
    nodes = [NodeTime("(inputs)", "copy", "feeds", len(feeds), statistics.median(feed_times[warmup:]))]
    for key, cols in columns.items():
        node = owners[key]
        seconds = float(np.median(elapsed[:, cols].sum(axis=1)))
        if node is None:
            nodes.append(NodeTime("(gradient accumulation)", "Add", "backward", len(cols), seconds))
        else:
            nodes.append(NodeTime(node.name or node.op_type, node.op_type, _phase_of(node, backward), len(cols),
                                  seconds, product_flops(node, bound.types)))
    if not any(node.op_type == APPLY_UPDATE for node in bound.order):  # else the updates ran inside backward
        nodes.append(NodeTime("(optimizer step)", session.state.buffer_bytes().optimizer_kind, "optimizer", 1,
                              statistics.median(optimizer_times[warmup:])))
    return StepProfile(directory, int(batch_size), int(steps), step_threads, min(ran_on[warmup:]),
                       statistics.median(untimed[warmup:]), nodes, peaks, clock, sequence_length,
                       "Numba" if bound.library is None else "the kernel library")
