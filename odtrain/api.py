"""The training API, with the names, signatures and semantics of `onnxruntime.training.api`.

    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    module = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    optimizer = Optimizer("artifacts/optimizer_model.onnx", module)
    loss = module(x, y); optimizer.step(); module.lazy_reset_grad()

Module runs the training graph (forward, loss, gradients accumulated into the
state's gradient buffer) or, in eval mode, the eval graph. Parameters,
gradients and optimizer moments live in the state's flat buffers.

Beyond ONNX Runtime's API, for tools that look at a session without running
it (the CLI, the memory report, the training loop, benchmarks):
`Module.bind_at(batch_size, training)` binds a step and returns its
`BoundStep` (memory plan, folded constants, recomputation), and
`Module.executable_step_at(batch_size, training)` the executor's ExecutableStep of it;
`Module.bound_steps()` lists the steps bound so far; `Module.arena_bytes`,
`Module.input_types(training)`, `Module.graph(training)`, `Module.state`, and
`CheckpointState.buffer_bytes()` (a `StateBuffers`).
"""
from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import checkpoint as checkpoint_file, kernel_library
from .allocation import AUTO, auto_budget, auto_shortfall
from .graph.autodiff import GRAD_SUFFIX
from .graph.errors import (ArgumentError, CheckpointError, InputError, ModelError, NonFiniteError, ParameterError,
                           StateError)
from .graph.ir import Graph, TensorType
from .graph.frozen import check_frozen_dtype, frozen_bytes, restore_frozen, store_frozen, stored_weights
from .graph.fusion import with_weights_read_in_place
from .graph.lora import merge_adapters
from .graph.onnx_io import load_graph, save_graph
from .graph.ops import check_supported
from .graph.optimizers import STATE_BLOCK, STATE_DTYPES, check_state_dtype, read_max_grad_norm, read_optimizer_graph
from .graph.planner import MemoryPlan
from .graph.qat import quantized_for_inference

from .state import ABSMAX, OptimizerState, ParameterStore, PropertyBag, deferred_interrupt, moment_blocks
from .threads import checked as checked_threads, get_num_threads, usable

DEFAULT_LEARNING_RATE = 1e-3
PLAN_CACHE_SIZE = 4


class Parameter:
    """One parameter of a CheckpointState: `.data` (copy; assignable), `.grad`, `.requires_grad`."""

    def __init__(self, state: "CheckpointState", name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return self._state._store.data(self.name).copy()

    @data.setter
    def data(self, value) -> None:
        target = self._state._store.data(self.name)
        value = np.asarray(value)
        if value.shape != target.shape:
            raise ArgumentError(f"parameter '{self.name}' has shape {target.shape}; the new value has {value.shape}")
        if not np.can_cast(value.dtype, target.dtype, casting="same_kind"):
            raise ArgumentError(f"parameter '{self.name}' is {target.dtype}; cannot assign a {value.dtype} array")
        target[...] = value
        self._state._mark_assigned([self.name])

    @property
    def grad(self) -> np.ndarray | None:
        grad = self._state._store.grad(self.name)
        return None if grad is None else grad.copy()

    @property
    def requires_grad(self) -> bool:
        return self.name in self._state._store.trainable

    def __repr__(self) -> str:
        data = self._state._store.data(self.name)
        return f"Parameter(name={self.name!r}, shape={data.shape}, dtype={data.dtype}, requires_grad={self.requires_grad})"


class Parameters:
    """The mapping `state.parameters`: name -> Parameter, in checkpoint order."""

    def __init__(self, state: "CheckpointState"):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        self._state._store.check(name)
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value) -> None:
        self[name].data = value

    def __contains__(self, name) -> bool:
        return name in self._state._store

    def __iter__(self):
        return iter(self._state._store.names)

    def __len__(self) -> int:
        return len(self._state._store.names)

    def keys(self):
        return list(self)

    def items(self):
        return [(name, self[name]) for name in self]

    def __repr__(self) -> str:
        return f"Parameters({self.keys()})"


@dataclass(frozen=True)
class StateBuffers:
    """The bytes of a CheckpointState's buffers."""

    parameter_bytes: int  # every parameter, trainable and frozen
    trainable_parameter_bytes: int
    gradient_bytes: int
    optimizer_kind: str | None  # None before an Optimizer is created for the state
    optimizer_state_bytes: dict[str, int]  # moment name -> bytes
    frozen_bytes_by_type: dict[str, int] = dataclasses.field(default_factory=dict)  # element type -> bytes


@dataclass(frozen=True)
class BoundStep:
    """A training or eval step bound at one set of input shapes: the memory plan a call at those
    shapes runs on, and what the step holds beside the arena; a report of the ExecutableStep that
    runs it (the plans of a step: graph/step_plan.py's StepPlan)."""

    mode: str  # "train" or "eval"
    inputs: tuple  # (name, shape) of each user input
    plan: MemoryPlan
    constant_bytes: int  # constants folded at these shapes, held beside the arena
    recomputed_nodes: int  # nodes run again in the backward pass: cheap ones, and those a memory budget needs
    loss: str | None  # the name of the loss output
    loops: tuple = ()  # a loops.LoopMemory for each If, Loop and Scan node: its bodies' arenas, what it saves

    @property
    def arena_bytes(self) -> int:
        return self.plan.arena_bytes

    @property
    def lower_bound(self) -> int:
        return self.plan.lower_bound

    @property
    def loss_step(self) -> int | None:
        """The step of the plan that writes the loss: the end of the forward pass."""
        return self.plan.written.get(self.loss) if self.loss is not None else None


class CheckpointState:
    """Parameters, optimizer state and user properties, loaded from and saved to a checkpoint file."""

    def __init__(self, contents: checkpoint_file.CheckpointContents):
        source = contents.source
        self._store = ParameterStore(contents.parameters, contents.trainable, source and (
            lambda name, out: source.read_into(checkpoint_file.PARAM_PREFIX + name, out)))
        self._properties = PropertyBag(contents.properties)
        self._optimizer: OptimizerState | None = None
        self._unassigned = set(contents.parameters) if contents.nominal else set()
        self._reset_grad_pending = True  # the next backward writes the gradients instead of adding
        random = contents.random or {}
        # [run seed, training steps that drew]: where each random op's stream stands (executor.seed_random)
        self._random = np.array([random.get("seed", 0), random.get("draws", 0)], dtype=np.int64)
        if contents.optimizer is not None:
            info = contents.optimizer
            state_dtype = info.get("state_dtype", "float32")
            if state_dtype not in STATE_DTYPES or int(info.get("state_block", STATE_BLOCK)) != STATE_BLOCK:
                raise CheckpointError(f"the checkpoint's optimizer state is {state_dtype} in blocks of "
                                      f"{info.get('state_block')}; this odtrain reads {list(STATE_DTYPES)} in blocks "
                                      f"of {STATE_BLOCK}: save it again with a matching odtrain")
            _, blocks = moment_blocks(self._store.trainable_sizes(), STATE_BLOCK)
            moments = {}
            for state_name, per_param in contents.optimizer_tensors.items():
                absmax = state_name.endswith(ABSMAX)  # 8-bit moments' scales: a range of blocks per parameter
                size = max((b for _, b in blocks.values()), default=0) if absmax else self._store.trainable_size
                dtype = np.float32 if absmax or state_dtype == "float32" else np.uint8
                flat = np.zeros(size, dtype=dtype)
                for name, array in per_param.items():
                    if name not in self._store.trainable:
                        raise ParameterError(f"optimizer state for '{name}', which is not a trainable parameter")
                    target = flat[slice(*blocks[name])] if absmax else self._store.trainable_view(flat, name)
                    if source is not None:
                        source.read_into(f"{checkpoint_file.OPTIMIZER_PREFIX}{name}/{state_name}", target)
                    else:
                        target[...] = array
                moments[state_name] = flat
            self._optimizer = OptimizerState(info["kind"], int(info["step"]), float(info["learning_rate"]),
                                             float(info.get("initial_learning_rate", info["learning_rate"])), moments,
                                             state_dtype)

    @classmethod
    def load_checkpoint(cls, checkpoint_uri) -> "CheckpointState":
        return cls(checkpoint_file.load(checkpoint_uri))

    @classmethod
    def save_checkpoint(cls, state: "CheckpointState", checkpoint_uri, include_optimizer_state: bool = False) -> None:
        store = state._store
        if state._unassigned and state._unassigned != set(store.names):
            state._require_values("saving a checkpoint")  # part real, part placeholder: refuse to save zeros
        contents = checkpoint_file.CheckpointContents({n: store.data(n) for n in store.names}, list(store.trainable),
                                                      state._properties.to_dict(), nominal=bool(state._unassigned))
        if state._random.any():
            contents.random = {"seed": int(state._random[0]), "draws": int(state._random[1])}
        if include_optimizer_state:
            opt = state._optimizer
            if opt is None:
                raise StateError("include_optimizer_state=True, but this state has no optimizer state yet: "
                                 "create an Optimizer for a Module of this state first")
            contents.optimizer = {"kind": opt.kind, "step": opt.step, "learning_rate": opt.learning_rate,
                                  "initial_learning_rate": opt.initial_learning_rate}
            if opt.state_dtype != "float32":
                contents.optimizer.update(state_dtype=opt.state_dtype, state_block=STATE_BLOCK)
            _, blocks = moment_blocks(store.trainable_sizes(), STATE_BLOCK)
            contents.optimizer_tensors = {s: {n: flat[slice(*blocks[n])] if s.endswith(ABSMAX) else
                                              store.trainable_view(flat, n) for n in store.trainable}
                                          for s, flat in opt.moments.items()}
        checkpoint_file.save(checkpoint_uri, contents)

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    @property
    def properties(self) -> PropertyBag:
        return self._properties

    @property
    def random_seed(self) -> int:
        """The run's seed: each random op (Dropout) draws from a stream of its own seeded from it, the node and
        the training steps done, saved with the checkpoint so a resumed run draws what an uninterrupted one would.
        Setting it restarts the streams (as onnxruntime.set_seed does for its Dropout); default 0."""
        return int(self._random[0])

    @random_seed.setter
    def random_seed(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ArgumentError(f"random_seed must be an integer, got {seed!r}")
        self._random[:] = (int(seed), 0)

    @property
    def optimizer_state(self) -> OptimizerState | None:
        """The optimizer's step count, learning rates and moment buffers (flat, in the trainable parameters'
        order), or None before an Optimizer was made for this state or loaded with it; an Optimizer updates
        it, `Optimizer.reset_state()` restarts it."""
        return self._optimizer

    def buffer_bytes(self) -> StateBuffers:
        """The bytes of the parameter, gradient and optimizer buffers."""
        store, optimizer = self._store, self._optimizer
        return StateBuffers(store.flat.nbytes + sum(a.nbytes for a in store.others.values()),
                            store.flat[:store.trainable_size].nbytes, store.grad_flat.nbytes,
                            optimizer.kind if optimizer else None,
                            {name: m.nbytes for name, m in optimizer.moments.items()} if optimizer else {},
                            frozen_bytes({name: store.data(name) for name in store.frozen}))

    def _mark_assigned(self, names) -> None:
        self._unassigned.difference_update(names)

    def _require_values(self, action: str) -> None:
        """Refuse `action` while parameters of a nominal checkpoint have no values yet."""
        if self._unassigned:
            raise StateError(f"{action} needs parameter values, and the checkpoint is nominal (shapes only): parameters "
                             f"{sorted(self._unassigned)[:5]} have no values yet; load them with "
                             "copy_buffer_to_parameters(buffer, trainable_only=False) or parameters[name].data = ...")


class ParameterBuffer(np.ndarray):
    """A flat float32 parameter buffer; `.numpy()` returns it, as ONNX Runtime's OrtValue does."""

    def numpy(self) -> np.ndarray:
        return self.view(np.ndarray)


def _as_array(buffer) -> np.ndarray:
    return np.asarray(buffer.numpy() if hasattr(buffer, "numpy") else buffer)


class _GraphSession:
    """A loaded training or eval graph, its user inputs and a small cache of bound plans."""

    def __init__(self, uri, state: CheckpointState, what: str, with_gradients: bool, check_finite: bool = False,
                 memory_budget: int | None = None, arena=None, num_threads: int | None = None):
        self.with_gradients = with_gradients
        self.mode = "train" if with_gradients else "eval"
        self.num_threads = num_threads  # None: the process default (odtrain.threads.get_num_threads) at each bind
        self.arena = arena  # an executor.SharedArena shared with the Module's other session, or None
        self.memory_budget = memory_budget
        self.budget_bytes = memory_budget if memory_budget != AUTO else None  # "auto": set when a step is planned
        self.fused: dict = {}  # gradient output -> (parameter, update) when the optimizer runs inside backward
        self.check_finite = check_finite
        self.steps = 0
        from .executor import ExecutableStep  # noqa: F401  (kernels load with the first session)

        self.uri = os.fspath(uri)
        self.what = what
        self.folder = os.path.dirname(os.path.abspath(self.uri))  # the artifacts' folder, where a library is looked for
        self.library = kernel_library.find(self.folder)  # None: the JIT's kernels
        self.graph = load_graph(uri, what)
        check_supported(self.graph.nodes, f"{what} '{self.uri}'")
        # what the steps run: an eval model reads stored frozen weights in place (the training model already does)
        self.step_graph = self.graph if with_gradients else with_weights_read_in_place(self.graph)
        store = state._store
        self.state = state
        self.input_names = [n for n in self.graph.inputs if n not in store]
        params = [n for n in self.graph.inputs if n in store]
        undefined = [n for n in self.graph.inputs if n not in store and n not in self.graph.value_types]
        if undefined:
            raise ModelError(f"{what} '{self.uri}': inputs {undefined} have no declared type")
        self.grad_outputs = _gradient_outputs(self.graph, store, f"{what} '{self.uri}'") if with_gradients else {}
        self.output_names = [o for o in self.graph.outputs if o not in self.grad_outputs]
        self.external = {n: store.data(n) for n in params}
        self.sinks = {g: store.grad(p).reshape(-1) for g, p in self.grad_outputs.items()}
        self.plans: OrderedDict = OrderedDict()

    def threads(self) -> int:
        """The thread count of this session's steps: the module's num_threads, else the process default."""
        return usable(self.num_threads or get_num_threads())

    def feeds(self, user_inputs) -> tuple[list[np.ndarray], tuple]:
        """(the inputs as arrays, the signature a plan is cached under), each checked against its declared type."""
        return _checked_feeds(self.graph, self.input_names, user_inputs)

    def bound(self, signature, arrays):
        from .executor import ExecutableStep

        accumulate = self.with_gradients and not self.state._reset_grad_pending
        threads = self.threads()
        signature = signature + (accumulate, threads)
        plan = self.plans.get(signature)
        if plan is None:
            types = {name: TensorType(a.dtype, a.shape) for name, a in zip(self.input_names, arrays)}
            guarded = tuple(self.output_names[:1]) if self.check_finite else ()
            sinks = {} if self.fused else self.sinks
            budget = self.memory_budget
            if budget == AUTO:  # taken now: what is available when the step is planned
                budget = self.budget_bytes = auto_budget(self.state._store.mapped_bytes(),
                                                         self.arena.nbytes if self.arena is not None else 0)
            def planned(budget):
                return ExecutableStep(self.step_graph, feed_types=types, external=self.external, gradient_sinks=sinks,
                                      accumulate=accumulate and not self.fused, check_finite=guarded,
                                      memory_budget=budget, fused_updates=self.fused, arena=self.arena, threads=threads,
                                      library=self.library, artifact_folder=self.folder)

            from .graph.errors import MemoryBudgetError

            try:
                plan = planned(budget)
            except MemoryBudgetError as error:
                if self.memory_budget != AUTO or error.smallest_bytes is None:
                    raise
                plan = planned(auto_shortfall(error.smallest_bytes, budget))
            self.plans[signature] = plan
            if len(self.plans) > PLAN_CACHE_SIZE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(signature)
        return plan

    def bind_at(self, batch_size: int, sequence_length: int | None = None,
                input_shapes: dict | None = None) -> BoundStep:
        """Bind the plan (an ExecutableStep, cached) that a call with inputs of batch `batch_size` (and every other
        symbolic axis `sequence_length`, or the whole shapes of `input_shapes` by name) runs."""
        signature, bound = self.bound_at(batch_size, sequence_length, input_shapes)
        return self.bound_step(signature, bound)

    def bound_at(self, batch_size: int, sequence_length: int | None = None, input_shapes: dict | None = None):
        """(signature, ExecutableStep) of the plan, bound and cached, that a call with inputs of batch `batch_size`
        (and every other symbolic axis `sequence_length`, or `input_shapes` by name) runs."""
        declared = {name: self.graph.value_types[name] for name in self.input_names}
        feeds, signature = self.feeds(placeholder_feeds(declared, batch_size, sequence_length, input_shapes))
        return signature, self.bound(signature, feeds)

    def bound_step(self, signature, bound) -> BoundStep:
        from .loops import loop_memory

        return BoundStep(self.mode, tuple(item for item in signature if isinstance(item, tuple)), bound.plan,
                         bound.constant_bytes, bound.recomputed, self.graph.outputs[0] if self.graph.outputs else None,
                         tuple(loop_memory(bound.calls, bound.types)))

    def run(self, user_inputs):
        if self.state._unassigned:
            raise StateError(f"the checkpoint is nominal (shapes only) and parameters "
                             f"{sorted(self.state._unassigned)[:5]} have no values yet: load them with "
                             "copy_buffer_to_parameters(buffer, trainable_only=False) or parameters[name].data = ...")
        arrays, signature = self.feeds(user_inputs)
        if self.check_finite:
            for name, array in zip(self.input_names, arrays):
                if array.dtype.kind == "f" and not np.isfinite(array).all():
                    raise NonFiniteError(f"input '{name}' holds NaN or infinite values (step {self.steps + 1})")
        plan = self.bound(signature, arrays)
        plan.seed_random(*self.state._random)
        with deferred_interrupt():
            try:
                plan.run(arrays)
            except NonFiniteError as error:
                raise NonFiniteError(f"step {self.steps + 1}: {error}") from None
            except InputError as error:  # a kernel stopped on the data: name the label when it is one
                raise self._label_error(arrays, plan.types) or error from None
            self.steps += 1
            if self.with_gradients and plan.random_streams:
                self.state._random[1] += 1
            if self.with_gradients:
                self.state._reset_grad_pending = False
            if self.fused:
                self.state._optimizer.step += 1
        if self.check_finite and self.with_gradients and not self.fused:
            bad = self.state._store.first_nonfinite_gradient()
            if bad is not None:
                raise NonFiniteError(f"step {self.steps}: the gradient of parameter '{bad}' holds NaN or infinite "
                                     "values; lower the learning rate or check the data")
        outputs = [plan.output(name) for name in self.output_names]
        return outputs[0] if len(outputs) == 1 else outputs

    def _label_error(self, arrays, types: dict) -> InputError | None:
        """The error naming a label outside the cross-entropy's classes (_label_error), looked for only after a
        step failed, so a step pays nothing for it; `types` are the failed step's bound value types."""
        return _label_error(self.graph, f"{self.what} '{self.uri}'", self.input_names, arrays, types)


def _gradient_outputs(graph: Graph, store: ParameterStore, source: str) -> dict[str, str]:
    """The training model's gradient outputs: `<param>_grad` -> the trainable parameter it is the gradient of; a
    gradient of a parameter the checkpoint does not train is a ParameterError."""
    outputs = {}
    for out in graph.outputs:
        param = out[:-len(GRAD_SUFFIX)] if out.endswith(GRAD_SUFFIX) else ""
        if param in store.trainable:
            outputs[out] = param
        elif param in graph.inputs:  # a parameter this checkpoint does not train
            raise ParameterError(f"{source} trains parameter '{param}', which the checkpoint "
                                 "does not hold as trainable; load the checkpoint generated with this model")
    return outputs


def _checked_feeds(graph: Graph, input_names: list[str], user_inputs) -> tuple[list[np.ndarray], tuple]:
    """The user's inputs as arrays, each of its declared dtype and rank with its fixed axes, and every symbolic
    axis bound to one size across inputs; and their signature ((name, shape), ...)."""
    if len(user_inputs) == 1 and isinstance(user_inputs[0], (list, tuple)) and len(input_names) > 1:
        user_inputs = tuple(user_inputs[0])
    if len(user_inputs) != len(input_names):
        raise InputError(f"the model takes {len(input_names)} inputs {input_names}, got {len(user_inputs)}")
    arrays, bound, signature = [], {}, []
    for name, value in zip(input_names, user_inputs):
        declared = graph.value_types[name]
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        if array.dtype != declared.dtype:
            raise InputError(f"input '{name}' must be {declared.dtype}, got {array.dtype}; "
                             f"convert it with .astype(np.{declared.dtype.name})")
        if declared.shape is not None:
            if array.ndim != len(declared.shape):
                raise InputError(f"input '{name}' must have shape {_show(declared)}, got {array.shape}")
            for axis, (want, got) in enumerate(zip(declared.shape, array.shape)):
                if isinstance(want, str):
                    if bound.setdefault(want, got) != got:
                        raise InputError(f"input '{name}' has {got} on axis {axis} ('{want}'), but another input "
                                         f"bound '{want}' to {bound[want]}")
                elif want != got:
                    raise InputError(f"input '{name}' must have shape {_show(declared)}, got {array.shape}")
        arrays.append(array)
        signature.append((name, array.shape))
    return arrays, tuple(signature)


def placeholder_feeds(declared: dict[str, TensorType], batch_size: int, sequence_length: int | None = None,
                      input_shapes: dict | None = None) -> list[np.ndarray]:
    """Zero inputs for the `declared` types (name -> TensorType, in order): what binds a step ahead. The first
    symbolic axis is `batch_size`, every other symbolic axis `sequence_length`; `input_shapes` gives whole
    shapes by input name instead (an image model exported with a symbolic height and width)."""
    for what, value in (("batch size", batch_size), ("sequence length", sequence_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ArgumentError(f"the {what} must be a positive integer, got {value!r}")
    input_shapes = input_shapes or {}
    arrays = []
    for name, types in declared.items():
        if name in input_shapes:
            arrays.append(np.zeros(tuple(int(d) for d in input_shapes[name]), dtype=types.dtype))
            continue
        if types.shape is None:
            raise ArgumentError(f"input '{name}' has no declared shape: give it whole (input_shapes, "
                                f"--input-shape {name}=D0,D1,...)")
        shape = []
        for axis, dim in enumerate(types.shape):
            if isinstance(dim, str) and axis > 0 and sequence_length is None:
                raise ArgumentError(f"input '{name}' has the symbolic dimension '{dim}' on axis {axis}; the batch "
                                    "size binds axis 0 only: give the length of the others (sequence_length, "
                                    f"--seq-len N) or the whole shape (input_shapes, --input-shape {name}=D0,D1,...)")
            shape.append((int(batch_size) if axis == 0 else int(sequence_length)) if isinstance(dim, str) else dim)
        arrays.append(np.zeros(shape, dtype=types.dtype))
    return arrays


def _label_error(graph: Graph, source: str, input_names: list[str], arrays, types: dict) -> InputError | None:
    """The error naming the model, the sample, its label and the class count, when an integer input holds a
    label outside the cross-entropy's classes (what its kernel stopped on); else None."""
    from .graph.losses import cross_entropy_classes, cross_entropy_layout

    classes, layout = cross_entropy_classes(graph, types), cross_entropy_layout(graph)
    if classes is None or layout is None:
        return None
    ignore_index = layout[1]
    for name, labels in zip(input_names, arrays):
        if labels.dtype.kind not in "iu" or labels.ndim == 0:
            continue
        outside = (labels < 0) | (labels >= classes)
        if ignore_index is not None:
            outside &= labels != ignore_index
        if outside.any():
            where = tuple(int(i) for i in np.argwhere(outside)[0])
            position = f"sample {where[0]}" + (f" (position {', '.join(map(str, where[1:]))})"
                                               if len(where) > 1 else "")
            ignored = f", nor the ignored label {ignore_index}" if ignore_index is not None else ""
            loss = next(n for n in graph.nodes if n.op_type == "SoftmaxCrossEntropyLoss")
            return InputError(f"{source}: {loss.describe()}: input '{name}': {position} has "
                              f"label {labels[where]}, "
                              f"outside the model's {classes} classes [0, {classes}){ignored}; relabel the "
                              "data, or give a model with as many classes as the labels")
    return None


def _show(t: TensorType) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


class Module:
    """Runs the training model (train mode) or the eval model (eval mode) on a CheckpointState."""

    training: bool

    def __init__(self, train_model_uri, state: CheckpointState, eval_model_uri=None, device: str = "cpu", *,
                 check_finite: bool = False, memory_budget: int | str | None = AUTO, num_threads: int | None = None):
        """`check_finite=True` stops a step with NonFiniteError at a NaN or infinity in an input, the loss
        (before the backward pass) or a gradient, naming the step and the parameter.

        `memory_budget` (bytes) caps the arena of a training step: the planner recomputes activations
        in the backward pass instead of storing them until the plan fits; if no plan fits, the first
        call raises MemoryBudgetError with the smallest budget that works. `memory_budget="auto"` (the
        default) takes the budget from the memory the machine has available when a step is first planned at
        an input shape, less the mapped frozen weights and a reserve (odtrain.allocation.auto_budget); the
        budget taken is `Module.memory_budget_bytes`. On a machine with room it recomputes nothing more than
        no budget does; on a small board it keeps the step from pushing the mapped weights out of memory.
        `memory_budget=None` plans without a budget.

        `num_threads` is the number of threads this module's steps use (kernels and BLAS together);
        by default odtrain.threads.get_num_threads(): ODTRAIN_NUM_THREADS, else every core the process
        may run on. `num_threads=1` runs serial kernels and is bit-for-bit reproducible."""
        if not isinstance(state, CheckpointState):
            raise ArgumentError(f"state must be a CheckpointState, got {type(state).__name__}")
        if str(device).split(":")[0] != "cpu":
            raise ArgumentError(f"device {device!r} is not supported: odtrain runs on the CPU (device='cpu')")
        self._state = state
        _check_budget(memory_budget)
        threads = None if num_threads is None else checked_threads(num_threads)
        from .executor import SharedArena

        # The train and eval steps, at every input shape, never run at once: one arena serves them all.
        self._arena = SharedArena()
        self._train = _GraphSession(train_model_uri, state, "training model", True, check_finite, memory_budget,
                                    self._arena, threads)
        if not self._train.grad_outputs:
            raise ModelError(f"training model '{self._train.uri}' computes no parameter gradients; "
                             "generate it with odtrain.artifacts.generate_artifacts")
        self._eval = (_GraphSession(eval_model_uri, state, "eval model", False, check_finite, arena=self._arena,
                                    num_threads=threads)
                      if eval_model_uri is not None else None)
        self.training = True

    def __call__(self, *user_inputs):
        """Train mode: forward, loss and gradient accumulation; returns the loss (then extra outputs)."""
        if self.training:
            return self._train.run(user_inputs)
        if self._eval is None:
            raise StateError("eval mode needs an eval model: pass eval_model_uri to Module(...)")
        return self._eval.run(user_inputs)

    @property
    def memory_budget_bytes(self) -> int | None:
        """The arena budget of the training steps: memory_budget's bytes; for "auto" (the default), the budget
        taken when the last training step was planned (None before that); None without a budget."""
        return self._train.budget_bytes

    @property
    def kernel_library(self):
        """The kernel library (odtrain.kernel_library.KernelLibrary) this module's steps run in, or None: Numba's."""
        return self._train.library

    def train(self, mode: bool = True) -> "Module":
        self.training = bool(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """Make the next training call overwrite the gradients instead of adding to them."""
        self._state._reset_grad_pending = True

    def _session(self) -> _GraphSession:
        return self._train if self.training or self._eval is None else self._eval

    def _session_of(self, training: bool) -> _GraphSession:
        if training:
            return self._train
        if self._eval is None:
            raise StateError("the eval step needs an eval model: pass eval_model_uri to Module(...)")
        return self._eval

    @property
    def state(self) -> CheckpointState:
        """The CheckpointState this module trains."""
        return self._state

    @property
    def arena_bytes(self) -> int:
        """The bytes of the arena buffer that every bound step of this module shares."""
        return self._arena.nbytes

    def bind_at(self, batch_size: int, training: bool = True, sequence_length: int | None = None,
                input_shapes: dict | None = None) -> BoundStep:
        """Bind the training (or eval) step for inputs of batch `batch_size`, as a call with such inputs
        would, without running it; symbolic axes after the first take `sequence_length`; `input_shapes`
        ({input name: whole shape}) gives the inputs that these do not (an image's height and width)."""
        return self._session_of(training).bind_at(batch_size, sequence_length, input_shapes)

    def executable_step_at(self, batch_size: int, training: bool = True, sequence_length: int | None = None,
                           input_shapes: dict | None = None):
        """The executor's plan (odtrain.executor.ExecutableStep: its calls, their nodes, storage) that bind_at
        binds, for tools that run or time a step's calls one by one (odtrain.profile, benchmarks); read it,
        do not change it."""
        return self._session_of(training).bound_at(batch_size, sequence_length, input_shapes)[1]

    def bound_steps(self) -> list[BoundStep]:
        """The steps bound so far: training steps, then eval steps, each from least to most recently used."""
        return [session.bound_step(signature, bound) for session in (self._train, self._eval) if session is not None
                for signature, bound in session.plans.items()]

    def input_types(self, training: bool = True) -> dict[str, TensorType]:
        """The declared type of each input of the training (or eval) model, in order; a symbolic
        dimension is its name."""
        session = self._session_of(training)
        return {name: session.graph.value_types[name] for name in session.input_names}

    def graph(self, training: bool = True) -> Graph:
        """The training (or eval) model as loaded (odtrain.graph.ir.Graph); read it, do not change it."""
        return self._session_of(training).graph

    def input_names(self) -> list[str]:
        return list(self._session().input_names)

    def output_names(self) -> list[str]:
        return list(self._session().output_names)

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        store = self._state._store
        return store.trainable_size if trainable_only else sum(store.data(n).size for n in store.names)

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ParameterBuffer:
        store = self._state._store
        others = [n for n in store.names if n not in store.float32_names]
        if not trainable_only and others:
            raise StateError(f"parameters {sorted(others)} are not float32 and cannot join a contiguous "
                             "float32 buffer; use trainable_only=True")
        return store.gather(trainable_only).view(ParameterBuffer)

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        store = self._state._store
        array = _as_array(buffer)
        size = store.float32_size(trainable_only)
        if array.dtype != np.float32:
            raise ArgumentError(f"the parameter buffer must be float32, got {array.dtype}")
        if array.size != size:
            raise ArgumentError(f"the parameter buffer has {array.size} elements; the "
                                f"{'trainable' if trainable_only else 'float32'} parameters have {size}")
        self._state._mark_assigned(store.scatter(array.reshape(-1), trainable_only))

    def export_model_for_inferencing(self, inference_model_uri, graph_output_names, frozen_dtype=None) -> None:
        """Write an ONNX model computing `graph_output_names` from the model inputs, parameters embedded.

        Frozen weights stored as int8, int4 or bfloat16 (generate_artifacts' `frozen_dtype`) are written as
        float32 with LoRA adapters merged into them (`frozen_dtype=None` or "float32"), or as int8 read by
        DequantizeLinear per output channel (a QDQ model, "int8"), int4 read by DequantizeLinear in blocks
        along the input axis (opset 21, "int4") or bfloat16 read by Cast ("bfloat16"), the
        adapters then kept as their own rank-r products beside the weights: merged, an update finer than a
        weight's quantization step would round away. Weights stored in the other type are converted."""
        frozen_dtype = check_frozen_dtype(frozen_dtype or "float32")
        if self._eval is None:
            raise StateError("exporting an inference model needs the eval model: pass eval_model_uri to Module(...)")
        self._state._require_values("exporting an inference model")
        if isinstance(graph_output_names, str):
            graph_output_names = [graph_output_names]
        inference = _inference_graph(self._eval.graph, self._state._store, list(graph_output_names), frozen_dtype)
        save_graph(quantized_for_inference(inference), inference_model_uri)


def _check_budget(memory_budget) -> None:
    if memory_budget is not None and memory_budget != AUTO and \
            (not isinstance(memory_budget, (int, np.integer)) or memory_budget <= 0):
        raise ArgumentError(f'memory_budget must be a positive number of bytes or "auto", got {memory_budget!r}')


def _inference_graph(graph: Graph, store: ParameterStore, graph_output_names: list[str], frozen_dtype: str) -> Graph:
    """The eval graph pruned to `graph_output_names`, the parameters' live values embedded, the frozen weights
    held as `frozen_dtype` (export_model_for_inferencing says how); QAT's fake quantization still in it."""
    known = graph.all_value_names()
    unknown = [n for n in graph_output_names if n not in known]
    if unknown or not graph_output_names:
        outputs = [o for o in graph.outputs]
        raise ArgumentError(f"graph_output_names {unknown or '[]'} are not values of the eval model; "
                            f"its outputs are {outputs} and it computes {len(known)} values in all")
    inference = graph.prune(list(graph_output_names))
    for name in list(inference.inputs):
        if name in store:  # the live arrays: the steps below make new arrays where they change a value
            inference.initializers[name] = store.data(name)
    inference.inputs = [n for n in inference.inputs if n not in store]
    inference.name = "inference"
    # float32: every frozen weight restored and the LoRA adapters merged into their weights; int8 or
    # bfloat16: the weights stored in the other type converted, the adapters kept beside their weights
    # (an update finer than int8's step would round away in a merge); then QAT's fake quantization as QDQ
    if frozen_dtype == "float32":
        restore_frozen(inference)
        return merge_adapters(inference)
    stored = stored_weights(inference)
    store_frozen(inference, restore_frozen(inference, {w for w, t in stored.items() if t != frozen_dtype}),
                 frozen_dtype)
    return inference


class Optimizer:
    """Applies the optimizer model's update to the trainable parameters of a Module."""

    def __init__(self, optimizer_uri, module: Module, *, fuse_with_backward: bool = False, state_dtype=None):
        """`fuse_with_backward=True` applies each parameter's update inside the training call, as soon as
        its gradient is complete and nothing else reads the parameter, so the full gradient buffer never
        exists. Gradients then cannot accumulate across calls: each training call is a whole step, and
        `step()` has nothing left to do. Parameters end bit-identical to the unfused loop.
        `state_dtype="int8"` keeps AdamW's moments in 8 bits, quantized in blocks (graph/optimizers.py); None
        takes the optimizer model's choice. Moments loaded in the other type are converted."""
        if not isinstance(module, Module):
            raise ArgumentError(f"module must be an odtrain Module, got {type(module).__name__}")
        self._module = module
        self._state = module._state
        store = self._state._store
        graph = load_graph(optimizer_uri, "optimizer model")
        config, params = read_optimizer_graph(graph, os.fspath(optimizer_uri))
        self._max_grad_norm = read_max_grad_norm(graph, os.fspath(optimizer_uri))
        if self._max_grad_norm is not None and fuse_with_backward:
            raise ArgumentError(f"'{os.fspath(optimizer_uri)}' clips the gradients to a global norm of "
                                f"{self._max_grad_norm:g}, which needs every gradient before the first update: "
                                "fuse_with_backward=True cannot apply it; leave it False, or generate the "
                                "optimizer model without max_grad_norm")
        if params and params != store.trainable:
            raise ParameterError(f"the optimizer model updates {params}, but the checkpoint's trainable "
                                 f"parameters are {store.trainable}; generate them together")
        if state_dtype is not None and check_state_dtype(state_dtype, config.kind) and hasattr(config, "state_dtype"):
            config = dataclasses.replace(config, state_dtype=state_dtype)
        self._config, self._grad_norm = config, None
        wanted = getattr(config, "state_dtype", "float32")
        self._blocks = moment_blocks(store.trainable_sizes(), STATE_BLOCK)
        from .optimizer_update import float_moments, int8_moments  # kernels load with the first session or optimizer
        current = self._state._optimizer
        if current is None or current.kind != config.kind:
            moments = {s: np.zeros(store.trainable_size, dtype=np.float32) for s in config.state_names}
            if wanted == "int8":
                moments = int8_moments(self._blocks[0], config.state_names)
            self._state._optimizer = OptimizerState(config.kind, 0, DEFAULT_LEARNING_RATE, DEFAULT_LEARNING_RATE, moments,
                                                    wanted)
        elif current.state_dtype != wanted:  # moments saved in the other type
            if wanted == "int8":
                current.moments = int8_moments(self._blocks[0], config.state_names, current.moments)
            else:
                current.moments = float_moments(self._blocks[0], current.moments, config.state_names)
            current.state_dtype = wanted
        self._fused = bool(fuse_with_backward)
        session = module._train
        session.fused = {f"{p}{GRAD_SUFFIX}": (p, self._update_of(p)) for p in store.trainable} if self._fused else {}
        session.plans.clear()
        self._require_kernels()

    def _require_kernels(self) -> None:
        """Where Numba is not installed: the update's kernel, as the steps will call it, is in the module's
        library, else KernelsUnavailableError now, before a training step runs (optimizer_update.require_update_kernels)."""
        from .optimizer_update import require_update_kernels

        session, store = self._module._train, self._state._store
        folder = session.folder
        if self._fused:  # one update per parameter, on its slices
            for name in store.trainable:
                weights, moments, blocks = self._slices_of(name)
                start, stop, _ = store.slices[name]
                require_update_kernels(self._config, weights, store.grad_flat[start:stop], moments,
                                       session.threads(), blocks, session.library, folder)
        else:
            require_update_kernels(self._config, store.flat[:store.trainable_size], store.grad_flat,
                                   self._state._optimizer.moments, session.threads(), self._blocks[0],
                                   session.library, folder)

    def _slices_of(self, name: str) -> tuple:
        """(weights, moments, 8-bit blocks) of one parameter's update: views of the trainable block's."""
        start, stop, _ = self._state._store.slices[name]
        weights = self._state._store.flat[start:stop]
        starts, ranges = self._blocks
        first, last = ranges[name]
        moments = {key: flat[first:last] if key.endswith(ABSMAX) else flat[start:stop]
                   for key, flat in self._state._optimizer.moments.items()}
        return weights, moments, starts[first:last + 1] - start

    def _update_of(self, name: str):
        """The update of one parameter from its gradient, reading the learning rate and step when called."""
        from .optimizer_update import apply_update

        state = self._state._optimizer
        weights, moments, blocks = self._slices_of(name)

        def update(gradient):  # inside the training step, which runs at the module's threads
            apply_update(self._config, weights, gradient, moments, state.learning_rate, state.step + 1,
                         self._module._train.threads(), blocks, self._module._train.library)

        return update

    def step(self) -> None:
        """One update of every trainable parameter from its accumulated gradient."""
        if self._fused:
            return  # the training call already applied this step's updates
        opt = self._state._optimizer
        store = self._state._store
        weights = store.flat[:store.trainable_size]
        from .optimizer_update import apply_update, clip_gradients

        self._state._require_values("an optimizer step")
        if self._module._train.check_finite and store.first_nonfinite_gradient() is not None:
            raise NonFiniteError(f"optimizer step {opt.step + 1} refused: the gradient of parameter "
                                 f"'{store.first_nonfinite_gradient()}' is not finite; the parameters are unchanged")
        with deferred_interrupt():
            if self._max_grad_norm is not None:
                self._grad_norm = clip_gradients(store.grad_flat, self._max_grad_norm)
            apply_update(self._config, weights, store.grad_flat, opt.moments, opt.learning_rate, opt.step + 1,
                         self._module._train.threads(), self._blocks[0], self._module._train.library)
            opt.step += 1

    def set_learning_rate(self, learning_rate: float) -> None:
        learning_rate = float(learning_rate)
        if not np.isfinite(learning_rate) or learning_rate < 0:
            raise ArgumentError(f"learning rate must be a finite number >= 0, got {learning_rate}")
        self.state.learning_rate = learning_rate
        self.state.initial_learning_rate = learning_rate

    def get_learning_rate(self) -> float:
        return float(self.state.learning_rate)

    @property
    def state(self) -> OptimizerState:
        """The state this optimizer updates (its CheckpointState's optimizer_state): kind, step count,
        learning rates and moment buffers."""
        return self._state._optimizer

    @property
    def max_grad_norm(self) -> float | None:
        """The global L2 norm the gradients are clipped to before each update (the optimizer model's
        max_grad_norm), or None when they are not."""
        return self._max_grad_norm

    @property
    def grad_norm(self) -> float | None:
        """The L2 norm of all gradients together before the last step clipped them (what
        torch.nn.utils.clip_grad_norm_ returns); None before a step, or when the model does not clip."""
        return self._grad_norm

    @property
    def config(self):
        """What the optimizer model computes (odtrain.graph.optimizers' config: the kind, its hyperparameters,
        the names of its moment buffers), as odtrain.optimizer_update.apply_update takes it."""
        return self._config

    def reset_state(self) -> None:
        """Zero the moments and the step count, as a new optimizer starts (the learning rate stays)."""
        for moment in self.state.moments.values():
            moment[...] = 0
        self.state.step = 0


class LinearLRScheduler:
    """Linear warm-up from 0 to `initial_lr` over `warmup_step_count` optimizer steps, then linear decay to 0
    at `total_step_count`. The rate follows the optimizer's step count: step() after each optimizer.step()."""

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float):
        if warmup_step_count < 0 or total_step_count < 0:
            raise ArgumentError("warmup_step_count and total_step_count must be >= 0")
        if total_step_count < warmup_step_count:
            raise ArgumentError(f"total_step_count ({total_step_count}) is smaller than warmup_step_count "
                                f"({warmup_step_count})")
        self._optimizer = optimizer
        self.warmup_step_count, self.total_step_count = int(warmup_step_count), int(total_step_count)
        self.initial_lr = float(initial_lr)
        optimizer.state.initial_learning_rate = self.initial_lr
        self._apply()

    def multiplier(self, step: int) -> float:
        if step < self.warmup_step_count:
            return step / max(1, self.warmup_step_count)
        remaining = self.total_step_count - step
        return max(0.0, remaining / max(1, self.total_step_count - self.warmup_step_count))

    def _apply(self) -> None:
        state = self._optimizer.state
        state.learning_rate = self.initial_lr * self.multiplier(state.step)

    def step(self) -> None:
        self._apply()
