"""The executor: a planned step laid out in one arena and run as a flat call list.

The graph layer decides (`graph.step_plan.plan_step`: types, folded
constants, the order with any recomputation and fused updates, what lives
outside the arena, the memory plan); the executor only lays out and binds:
- `scratch_bytes` tells the planner how much working memory a node's kernel
  needs at the step's thread count (the kernels' `scratch=` declarations);
- storage: parameters, folded constants and gradient sinks are arrays of
  their own, and the plan's outside views are numpy views of them; every
  other value is a view of the arena at its planned offset;
- the arena is allocated only if the machine can hold it (`odtrain.allocation`:
  else a MemoryBudgetError, before any work, says what memory_budget would fit);
- each node's kernel binding turns it into (kernel, args) calls on views;
  a random op (Dropout) also gets a one-int64 stream that `seed_random` sets
  before each step from the run's seed, the node and the steps that drew
  before, so each node draws its own masks, reproducibly, across plans and
  resumed runs.
A step copies the feeds into their arena slots and runs the calls: no
lookups, no allocation. With a kernel library (odtrain/kernel_library/) the calls it holds run
in it, a run of them in one foreign call with their arguments packed once (`Program`); the others,
and every call without a library, run through Numba's dispatchers. Graphs that never run at the same time (a
Module's train and eval steps, at every input shape) share one arena
buffer (`SharedArena`), as large as the largest of their plans. Gradients of trainable parameters are written
straight into the gradient buffer (the usual step, after lazy_reset_grad),
or, when gradients accumulate, computed in the arena and added by a last
call per parameter.
"""
from __future__ import annotations

import contextlib
import hashlib
import weakref
from functools import partial

import numpy as np

from .graph.errors import InputError, KernelsUnavailableError, ModelError, NonFiniteError, UnsupportedOpError
from .graph.control_flow import is_control_flow
from .graph.ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from .graph.ops import is_view, lookup
from .graph.ops.training import APPLY_UPDATE
from .allocation import aligned_buffer, allocate, budget_advice
from .graph.autodiff import LOSS_SEED
from .graph.schedule import split_forward_backward
from .graph.elementwise_fusion import fusion_enabled
from .graph.step_plan import plan_step
from .kernels import BINDINGS, PARALLEL, SCRATCH
from .kernels.blas import hold_one_thread, release_thread
from .kernels import scalar_expressions
from .kernels.scalar_expressions import ROWS, row_of
from .kernels.jit import resolved
from . import jit, threads as thread_policy
from .kernel_library import compiler_installed, kernel_name, library_folder_of, missing_kernel, unavailable
from .jit.ahead import compile_ahead
from .jit.cache import discard_stale
from .kernels.optim import add_into, assert_finite, copy_into


def scratch_bytes(node: Node, types: dict[str, TensorType], threads: int = 1) -> int:
    """The working memory, in bytes, that the kernel binding of `node` declares at `threads` threads (0 if none)."""
    size_of = SCRATCH.get(node.key)
    if size_of is None:
        return 0
    specs_in = [(types[i].shape, types[i].dtype) if i else None for i in node.inputs]
    specs_out = [(types[o].shape, types[o].dtype) if o else None for o in node.outputs]
    extra = {"threads": threads} if node.key in PARALLEL else {}
    try:
        return int(size_of(specs_in, specs_out, **node.attrs, **extra))
    except TypeError as error:  # an attribute the binding does not take (odtrain's own ops; the loader checks ONNX's)
        raise ModelError(f"{node.describe()}: unsupported attributes {sorted(node.attrs)}: {error}") from None


def element_wise_arity(node: Node) -> int | None:
    """How many operands the element-wise row of kernels/scalar_expressions.py that `node` computes takes, or None
    when it computes none that a fused chain may hold (what graph/elementwise_fusion.py fuses)."""
    if node.domain not in ("", "ai.onnx", ODTRAIN_DOMAIN):
        return None
    row = row_of(node.op_type, node.attrs)
    return ROWS[row].arity if row is not None and ROWS[row].fusable else None


def stream_key(node: Node) -> bytes:
    """What tells a random node's stream apart from the others': its first output (unique in a graph, and the
    same in the training and eval models) and its `seed` attribute."""
    return f"{node.outputs[0]}\0{int(node.attrs.get('seed', 0))}".encode()


def stream_seed(seed: int, key: bytes, draws: int) -> int:
    """The 32-bit seed of a random node's draw number `draws` in a run seeded `seed` (a hash: nearby seeds,
    nodes and draws give unrelated streams)."""
    digest = hashlib.blake2b(key, digest_size=4, key=f"{int(seed)}/{int(draws)}".encode()).digest()
    return int.from_bytes(digest, "little")


class ExecutableStep:
    """One graph at one set of feed shapes and thread count: its StepPlan laid out on an arena, and the
    calls of a step (how it relates to MemoryPlan and BoundStep: graph/step_plan.py's StepPlan).

    `external` maps parameter names to the arrays that hold them (views of
    the flat parameter buffer). `gradient_sinks` maps gradient outputs to
    their views of the gradient buffer: with `accumulate` they are added
    into it, otherwise the producing kernels write into it directly.
    `fused_updates` maps gradient outputs to (parameter, update(gradient)).
    `bound_feeds` maps graph inputs to fed values bound as constants (the
    axes, shapes or sizes an op reads while shapes bind): the plan holds
    for those values only, and a step is fed the other inputs, `feeds`.
    `threads` is the step's thread count: parallel kernels are bound to split their work into
    that many parts, with their scratch sized for it, and a run uses that many of Numba's threads.
    `element_wise_fusion`: chains of element-wise nodes run as one fused kernel each (graph/elementwise_fusion.py;
    also off with ODTRAIN_ELEMENTWISE_FUSION=0, and with a kernel library or while one is recorded: `_fuses`).
    """

    expressions = scalar_expressions  # the kernels' table of scalar expressions, which odtrain/body_fusion.py reads

    def _fuses(self, asked: bool) -> bool:
        """Whether this step plans element-wise chains fused: asked and switched on, and neither running from a
        kernel library nor recording one. A fused chain's kernel is generated when the step binds, which takes
        Numba; a library and the step that records it both hold the per-op kernels instead, the same bits."""
        return asked and fusion_enabled() and self.library is None and _recording is None

    def __init__(self, graph: Graph, *, feed_types: dict[str, TensorType], external: dict[str, np.ndarray],
                 gradient_sinks: dict[str, np.ndarray] | None = None, accumulate: bool = False,
                 check_finite: tuple[str, ...] = (), memory_budget: int | None = None,
                 fused_updates: dict | None = None, arena: SharedArena | None = None,
                 bound_feeds: dict[str, np.ndarray] | None = None, threads: int = 1, library=None,
                 artifact_folder=None, element_wise_fusion: bool = True):
        self.library = library  # a KernelLibrary (odtrain/kernel_library/) whose kernels run the calls it holds
        self.artifact_folder = artifact_folder  # where the library was looked for (named when kernels are missing)
        if library is None:
            if not compiler_installed():
                raise KernelsUnavailableError(unavailable(artifact_folder))
            jit.load()  # Numba's CPU target, BLAS on one thread, Numba's threading layer (odtrain/threads.py)
            discard_stale()  # cached kernels compiled from other kernel sources than these
        else:
            thread_policy.configure_without_compiler()
        self.graph = graph
        self.threads = int(threads)
        self._updates = {grad: update for grad, (_, update) in (fused_updates or {}).items()}
        sinks = gradient_sinks or {}
        parameter_types = {k: TensorType(v.dtype, tuple(v.shape)) for k, v in external.items()}

        def planned(budget: int | None):
            return plan_step(graph, feed_types, parameter_types, partial(scratch_bytes, threads=self.threads),
                             held=set() if accumulate else set(sinks), memory_budget=budget,
                             fused_updates={grad: param for grad, (param, _) in (fused_updates or {}).items()},
                             bound_feeds=bound_feeds,
                             element_wise=element_wise_arity if self._fuses(element_wise_fusion) else None)

        step = planned(memory_budget)
        self.step_plan = step
        self.plan, self.types, self.feeds = step.plan, step.types, step.feeds
        self.constant_bytes, self.recomputed = step.constant_bytes, step.recomputed
        outside = dict(external)
        outside.update({k: np.asarray(v, order="C") for k, v in step.folded.items()})  # keeps 0-d values 0-d
        if not accumulate:
            outside.update({name: sink.reshape(self.types[name].shape) for name, sink in sinks.items()})
        for name, source in step.views.items():
            outside[name] = outside[source].reshape(self.types[name].shape)
        self._outside = outside
        self._check_finite, self._accumulated_sinks = check_finite, (sinks if accumulate else {})

        def advice(nbytes: int) -> str:  # asked only when the machine cannot hold the arena
            return budget_advice(self.plan, bool(split_forward_backward(step.order, LOSS_SEED)[1]), planned, nbytes)

        (arena or SharedArena()).attach(self, advice)

    def describe(self) -> str:
        """The graph and the input shapes it is bound to."""
        return f"graph '{self.graph.name}' at inputs " + ", ".join(f"{name} {self.types[name]}" for name in self.feeds)

    def attach(self, buffer: np.ndarray) -> None:
        """Lay the arena values into `buffer` (at least the plan's arena bytes) and bind the calls of a step."""
        storage = dict(self._outside)
        for name in self.step_plan.arena_values:
            t = self.types[name]
            offset = self.plan.offset(name)
            storage[name] = buffer[offset:offset + t.nbytes].view(t.dtype).reshape(t.shape)
        self.arena = buffer
        self.storage = storage
        self.feed_views = [storage[name] for name in self.feeds]
        calls, call_nodes = [], []
        self.random_streams = []  # (node's stream key, the int64 its kernel seeds from) of each random op
        for index, node in enumerate(self.step_plan.order):
            calls.extend(self._bind_node(index, node, storage))
            for name in node.outputs:  # stop before a non-finite value reaches the backward pass
                if name in self._check_finite:
                    calls.append((assert_finite, (storage[name].reshape(-1),)))
            call_nodes.extend([node] * (len(calls) - len(call_nodes)))
        for name, sink in self._accumulated_sinks.items():
            calls.append((add_into, (sink, storage[name].reshape(-1))))
            call_nodes.append(None)
        self.calls = calls
        self.call_nodes = call_nodes  # the node each call belongs to (None: a gradient added into its sink)
        self.program = Program(self.library, calls, call_nodes, self.graph.name, self.artifact_folder) \
            if self.library is not None else None
        self._jit_calls = [(resolved(kernel), args) for kernel, args in calls] if self.program is None else None
        if self._jit_calls is not None:
            compile_ahead(self._jit_calls)  # says so when a kernel compiles, before the step holds the line

    def _bind_node(self, index: int, node: Node, storage: dict[str, np.ndarray]):
        types = self.types
        if node.key == (ODTRAIN_DOMAIN, APPLY_UPDATE):  # the optimizer update of one parameter
            return [(self._updates[node.inputs[0]], (storage[node.inputs[0]].reshape(-1),))]
        opdef = lookup(node)
        if index in self.step_plan.copies:
            return [(copy_into, (storage[node.outputs[0]].reshape(-1), storage[node.inputs[0]].reshape(-1)))]
        if is_view(opdef, [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o]):
            return []  # the output already shares the input's bytes
        if is_control_flow(node):  # If, Loop, Scan: bodies planned once, run by odtrain/loops.py
            from .loops import bind_control_flow

            return bind_control_flow(self, node, storage)
        bind = BINDINGS.get(node.key)
        if bind is None:
            raise UnsupportedOpError(f"{node.describe()}: no kernel is registered for this op type")
        inputs = [(storage[i] if i in storage or k not in opdef.shape_only else _shape_only(types[i])) if i else None
                  for k, i in enumerate(node.inputs)]
        outputs = [storage[o] if o else None for o in node.outputs]
        extra = {"scratch": storage[self.step_plan.scratch[index]]} if index in self.step_plan.scratch else {}
        if node.key in PARALLEL:
            extra["threads"] = self.threads
        if opdef.random:
            extra["stream"] = np.zeros(1, dtype=np.int64)
            self.random_streams.append((stream_key(node), extra["stream"]))
        try:
            return bind(inputs, outputs, **node.attrs, **extra)
        except TypeError as error:
            raise ModelError(f"{node.describe()}: unsupported attributes {sorted(node.attrs)}: {error}") from None
        except ValueError as error:
            raise ModelError(f"{node.describe()}: {error}") from None

    def seed_random(self, seed: int, draws: int) -> None:
        """Seed each random op's next draw: a function of the run's seed, the node and how many training steps
        drew before, so two nodes of one step draw apart, and a resumed run draws what an uninterrupted one would."""
        for key, stream in self.random_streams:
            stream[0] = stream_seed(seed, key, draws)

    @property
    def order(self) -> list[Node]:
        """The nodes of a step in execution order, recomputed and update nodes included."""
        return self.step_plan.order

    def run(self, feeds: list[np.ndarray]) -> None:
        for view, value in zip(self.feed_views, feeds):
            np.copyto(view, value, casting="no")
        if _recording is not None:
            _recording.extend(self.calls)
            _recording.extend(nested_calls(self.calls))  # the calls of If, Loop and Scan bodies (odtrain/loops.py)
            return
        try:
            with self.step_threads() as threads:
                if self.program is None:
                    for kernel, args in self._jit_calls:
                        kernel(*args)
                else:
                    failed = self.program.run(threads)
                    if failed is not None:
                        self._stopped(failed)
        except FloatingPointError as error:
            raise NonFiniteError(f"{self.graph.name}: {error}") from None
        except InputError:  # a library call's, already worded (_stopped)
            raise
        except ValueError as error:  # a kernel's check on the data (e.g. a label out of range)
            raise InputError(f"{self.graph.name}: {error}; check the inputs' values") from None

    @property
    def jit_calls(self) -> list | None:
        """The step's calls as the JIT runs them ((dispatcher, args)), or None when a kernel library runs them."""
        return self._jit_calls

    def run_calls(self) -> None:
        """Run the calls once, the feeds already in their slots, inside a running step (an iteration of a
        loop's body: odtrain/loops.py); a library call that stops on its data raises as in `run`."""
        if self.program is None:
            for kernel, args in self._jit_calls:
                kernel(*args)
        else:
            failed = self.program.run(self.threads)
            if failed is not None:
                self._stopped(failed)

    def _stopped(self, index: int):
        """The error of library call `index`, which stopped on its data (as the JIT kernel raises it)."""
        kernel, args = self.calls[index]
        node = self.call_nodes[index]
        where = f"{self.graph.name}: {node.describe()}" if node is not None else self.graph.name
        message = self.library.message(kernel, args)
        if kernel_name(kernel) == kernel_name(assert_finite):
            raise NonFiniteError(f"{where}: {message}")
        raise InputError(f"{where}: {message}; check the inputs' values")

    @contextlib.contextmanager
    def step_threads(self):
        """While the calls run: Numba's pool at the threads the machine leaves free for the parts they were
        bound for (odtrain.threads.running), BLAS on one thread (the program's own BLAS threads come back
        afterwards); yields that thread count."""
        with thread_policy.running(self.threads) if self.threads > 1 else contextlib.nullcontext(1) as threads:
            hold_one_thread()
            try:
                yield threads
            finally:
                release_thread()

    def output(self, name: str) -> np.ndarray:
        return self.storage[name].copy()


def nested_calls(calls) -> list:
    """The calls of the bodies that `calls` run (a control-flow node's call carries its bodies' calls as
    `body_calls`), their own bodies' included."""
    found = []
    for kernel, _ in calls:
        inner = getattr(kernel, "body_calls", ())
        found.extend(inner)
        found.extend(nested_calls(inner))
    return found


def _shape_only(t: TensorType) -> np.ndarray:
    """An array of type `t` holding no memory (every stride 0), for an input read for its shape only whose
    value nothing computes (a gradient in a loop body reading a forward value that only its shape reaches)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, t.dtype), t.shape, (0,) * len(t.shape), writeable=False)


class Program:
    """A step's calls as runs of library calls (one foreign call each) between the calls it lacks.

    `segments` holds (first call index, CallList, None) for a run of library calls
    and (index, kernel, args) for a call left to Python (a JIT kernel, an optimizer update). The argument
    blocks are packed once (odtrain.kernel_library.pack) and hold the addresses of the arena views: the
    views must live as long as the program (the bound graph keeps both)."""

    def __init__(self, library, calls, nodes=None, graph_name: str = "step", artifact_folder=None):
        from .kernel_library import pack, report_missing

        self.library = library
        self.segments, run, missing, first_node = [], [], [], None
        for index, (kernel, args) in enumerate(calls):
            address = library.address(kernel, args)
            if address is not None:
                run.append((index, address, pack(args)))
                continue
            self._close(run)
            run = []
            self.segments.append((index, kernel, args))
            if kernel_name(kernel) is not None:  # a JIT kernel (else Python: an optimizer update, itself a library call)
                if not missing and nodes is not None:
                    first_node = nodes[index]
                missing.append((kernel, args))
        self._close(run)
        self.jit_calls = len(missing)
        if missing and not compiler_installed():  # before any call runs: nothing of the step is half done
            where = f"{graph_name}: {first_node.describe()}" if first_node is not None else graph_name
            raise KernelsUnavailableError(missing_kernel(where, *missing[0], library, artifact_folder,
                                                         len(missing) - 1))
        if missing:
            jit.load()
            report_missing(missing)

    def _close(self, run) -> None:
        from .kernel_library import CallList

        if run:
            self.segments.append((run[0][0], CallList([a for _, a, _ in run], [b for _, _, b in run]), None))

    def run(self, threads: int) -> int | None:
        """Run the calls; the index of a library call that stopped on its data, or None."""
        for first, calls, args in self.segments:
            if args is None:
                failed = self.library.run(calls, threads)
                if failed >= 0:
                    return first + failed
            else:
                calls(*args)  # (index, kernel, args): a call the library lacks
        return None


_recording: list | None = None  # while recording (record_calls): the calls steps would run, instead of running


@contextlib.contextmanager
def record_calls():
    """Within the block, steps and optimizer updates record their (kernel, args) calls in the yielded list
    instead of running them (the kernel library's build: which kernels at which signatures a model needs)."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


def invoke(kernel, args, threads: int = 1, library=None) -> None:
    """One kernel call outside a bound step: through `library` when it holds it, else the JIT's kernel."""
    if _recording is not None:
        _recording.append((kernel, args))
    elif library is None or not library.call(kernel, args, threads):
        if not compiler_installed():
            raise KernelsUnavailableError(
                missing_kernel("the optimizer's update", kernel, args, library, library_folder_of(library))
                if library is not None else f"the optimizer's update: {unavailable(None)}")
        jit.load()  # the JIT's kernel (before the compiler loads, a kernel would run as Python)
        kernel(*args)


class SharedArena:
    """One arena buffer for bound graphs that never run at the same time (the train and eval steps of
    a Module, at every input shape): as large as the largest plan, not the sum of them.

    Invariant: nothing lives in the arena from one run to the next (a run copies its feeds in, its
    outputs are copied out, gradients and state go to buffers outside), so graphs may take turns
    over the same bytes. A graph whose plan is larger than the buffer replaces it: every graph
    still bound to the old buffer is attached to the new one, and the old one is freed.
    """

    def __init__(self):
        self.buffer = aligned_buffer(0)
        self._users: weakref.WeakSet = weakref.WeakSet()  # plans a session evicted from its cache drop out

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def attach(self, bound: ExecutableStep, advice=None) -> None:
        """Lay `bound` into the buffer, first replacing it with a larger one if its plan needs more
        (`advice(bytes)` says what memory_budget fits when the machine cannot hold that; allocation.allocate)."""
        if bound.plan.arena_bytes > self.buffer.nbytes:
            self.buffer = allocate(bound.plan, bound.describe(), advice)
            for user in list(self._users):
                user.attach(self.buffer)
        self._users.add(bound)
        bound.attach(self.buffer)
