"""One op at a time, per op family, at 1 thread and at every core: params are (op, threads), as numpy's
ufunc benchmarks are parameterised by ufunc.

Each op is a node taken from the training step of a reference model (tests/data) bound at the
model's batch size (meta.json's input shape): of the nodes of that op type that match the case, the
one with the most work by `graph.cost.node_cost`. It runs alone, bound by the executor in a graph of
its own: its float inputs are held outside the arena (no copy per run) with fixed-seed values in
[0.5, 1.5) (no NaN, no denormals), its integer inputs are the step's constants or zeros (valid as
labels, indices and token ids). `threads` is the thread count the op is bound and run at (`odtrain.threads`).

Families: ConvOps (convolutions and their gradients, depthwise included), ProductOps (Gemm,
FusedMatMul as a linear layer and as attention's batched products), NormalizationOps, PoolOps,
ElementwiseOps (activations, their gradients, Softmax, Add), SiluOps (a decoder's fused SiLU gate and its
gradient), OptimizerOps (the fused AdamW update
of a model's trainable block, its moments in float32 or in 8 bits), VocabularyLossOps (a decoder's vocabulary
product fused with its cross-entropy, forward and backward, at the shape of the benchmark decoder),
DecoderLayoutOps (a decoder's memory-bound ops at the SmolLM2-135M LoRA step's shapes, with the bytes they move).

UnaryOps: every unary op of the elementwise kernels (`odtrain.kernels.elementwise`, tables UNARY,
SPECIAL_UNARY and RARE_UNARY: a row added there is a parameter here; and IsNaN, IsInf) over 2^20 float32 values,
out of place, as a
step runs them (the binding's prepared calls, one thread).
"""
import functools
import os

import numpy as np

from . import common

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = sorted({1, CORES})


def _dense(node) -> bool:
    return int(node.attrs.get("group", 1)) == 1


def _depthwise(node) -> bool:
    return int(node.attrs.get("group", 1)) > 1


def _linear(node) -> bool:
    return not any(key in node.attrs for key in ("permA", "permB", "permY", "activation"))


def _attention(node) -> bool:
    return "permA" in node.attrs or "permB" in node.attrs


def _without_activation(node) -> bool:
    return "activation" not in node.attrs


def _with_activation(node) -> bool:  # a Relu's or Clip's gradient folded in (graph/gradient_fusion.py), or a
    return "activation" in node.attrs  # product's activation epilogue (graph/product_epilogues.py)


# op label -> (reference model, op type, which of its nodes)
CASES = {
    "Conv": ("cnn", "Conv", _dense),
    "ConvInputGrad": ("cnn", "ConvInputGrad", _dense),
    "ConvWeightGrad": ("cnn", "ConvWeightGrad", _dense),
    "Conv depthwise": ("mobilenetv2_full", "Conv", _depthwise),
    "ConvInputGrad depthwise": ("mobilenetv2_full", "ConvInputGrad", _depthwise),
    "ConvWeightGrad depthwise": ("mobilenetv2_full", "ConvWeightGrad", _depthwise),
    "Gemm": ("mlp", "Gemm", None),
    "FusedMatMul linear": ("transformer", "FusedMatMul", _linear),
    "FusedMatMul attention": ("transformer", "FusedMatMul", _attention),
    "FusedMatMul Relu": ("mlp", "FusedMatMul", _with_activation),
    "ActivationBiasGrad": ("mlp", "ActivationBiasGrad", None),
    # in the training model a training-mode BatchNormalization is a BatchNormalizationActivation (graph/ops/nn.py)
    "BatchNormalization": ("cnn", "BatchNormalizationActivation", _without_activation),
    "BatchNormalizationActivation": ("cnn", "BatchNormalizationActivation", _with_activation),
    "BatchNormalizationGrad": ("cnn", "BatchNormalizationGrad", _without_activation),
    "BatchNormalizationGrad Clip": ("mobilenetv2_full", "BatchNormalizationGrad", _with_activation),
    "LayerNormalization": ("transformer", "LayerNormalization", None),
    "LayerNormalizationGrad": ("transformer", "LayerNormalizationGrad", None),
    "MaxPool": ("cnn", "MaxPool", None),
    "MaxPoolGrad": ("cnn", "MaxPoolGrad", None),
    "GlobalAveragePool": ("cnn", "GlobalAveragePool", None),
    "GlobalAveragePoolGrad": ("cnn", "GlobalAveragePoolGrad", None),
    "Relu": ("cnn", "Relu", None),
    "ReluGrad": ("cnn", "ReluGrad", None),
    "Add": ("cnn", "Add", None),
    "Gelu": ("transformer", "Gelu", None),
    "GeluGrad": ("transformer", "GeluGrad", None),
    "Softmax": ("transformer", "Softmax", None),
    "SoftmaxGrad": ("transformer", "SoftmaxGrad", None),
}


@functools.lru_cache(maxsize=None)
def training_step(name: str):
    """(module, optimizer, bound training step) of a reference model at its batch size (meta.json)."""
    module, optimizer = common.open_training(common.artifacts(name))
    shape = common.meta(name)["input_shape"]  # MobileNetV2's file leaves its square image's size symbolic
    # planned per op: these benchmarks time one op's kernel, which the element-wise fusion would merge into a chain
    switch, os.environ["ODTRAIN_ELEMENTWISE_FUSION"] = os.environ.get("ODTRAIN_ELEMENTWISE_FUSION"), "0"
    try:
        step = module.executable_step_at(shape[0], sequence_length=shape[-1] if len(shape) == 4 else None)
    finally:
        if switch is None:
            del os.environ["ODTRAIN_ELEMENTWISE_FUSION"]
        else:
            os.environ["ODTRAIN_ELEMENTWISE_FUSION"] = switch
    return module, optimizer, step


@functools.lru_cache(maxsize=None)
def picked_node(label: str):
    from odtrain.graph.cost import node_cost

    model, op_type, which = CASES[label]
    bound = training_step(model)[2]
    nodes = [n for n in bound.order if n.op_type == op_type and (which is None or which(n))]
    return bound, max(nodes, key=lambda n: node_cost(n, bound.types))


def bind_alone(label: str, threads: int = 1):
    """The picked node bound in a graph of its own at `threads` threads; returns the ExecutableStep (its run
    takes no feeds)."""
    from odtrain.executor import ExecutableStep
    from odtrain.graph.ir import Graph

    bound, node = picked_node(label)
    rng = np.random.default_rng(common.SEED)
    held, constants = {}, {}
    for name in dict.fromkeys(i for i in node.inputs if i):
        t = bound.types[name]
        if t.dtype.kind == "f":
            held[name] = rng.uniform(0.5, 1.5, t.shape).astype(t.dtype)
        elif name in bound.plan.group_of:  # an integer value of the step (labels, indices): zeros are valid
            held[name] = np.zeros(t.shape, t.dtype)
        else:  # a constant of the step (a shape, axes)
            constants[name] = np.asarray(bound.storage[name]).copy()
    outputs = [o for o in node.outputs if o]  # the first is the graph's output; state updates never are
    types = {name: bound.types[name] for name in list(held) + list(constants) + outputs}
    graph = Graph([node], list(held), outputs[:1], constants, types, name=label)
    return ExecutableStep(graph, feed_types={}, external=held, threads=threads)


class _OpBenchmark:
    params = []
    param_names = ["op", "threads"]
    timeout = 300

    def setup(self, op, threads):
        self.bound = bind_alone(op, threads)
        for _ in range(2):  # compiles or loads the kernel, touches the arena
            self.bound.run([])

    def time_run(self, op, threads):
        self.bound.run([])


def _family(*labels):
    return [list(labels), THREADS]


class ConvOps(_OpBenchmark):
    params = _family("Conv", "ConvInputGrad", "ConvWeightGrad", "Conv depthwise", "ConvInputGrad depthwise",
                     "ConvWeightGrad depthwise")


class ProductOps(_OpBenchmark):
    params = _family("Gemm", "FusedMatMul linear", "FusedMatMul attention", "FusedMatMul Relu", "ActivationBiasGrad")


class NormalizationOps(_OpBenchmark):
    params = _family("BatchNormalization", "BatchNormalizationActivation", "BatchNormalizationGrad",
                     "BatchNormalizationGrad Clip", "LayerNormalization", "LayerNormalizationGrad")


class PoolOps(_OpBenchmark):
    params = _family("MaxPool", "MaxPoolGrad", "GlobalAveragePool", "GlobalAveragePoolGrad")


class ElementwiseOps(_OpBenchmark):
    params = _family("Relu", "ReluGrad", "Add", "Gelu", "GeluGrad", "Softmax", "SoftmaxGrad")


class OptimizerOps:
    """The fused AdamW update of a reference model's whole trainable block (one loop over the buffer)."""

    params = [["cnn", "transformer", "mobilenetv2_full"], THREADS]
    param_names = ["model", "threads"]
    state_dtype = "float32"

    def setup(self, model, threads):
        import dataclasses

        from odtrain.optimizer_update import apply_update, int8_moments
        from odtrain.graph.optimizers import STATE_BLOCK
        from odtrain.state import moment_blocks

        module, optimizer, _ = training_step(model)
        weights = np.asarray(module.get_contiguous_parameters(trainable_only=True))  # a copy: the update's cost
        rng = np.random.default_rng(common.SEED)
        grads = rng.uniform(-1, 1, weights.size).astype(np.float32)
        config = dataclasses.replace(optimizer.config, state_dtype=self.state_dtype)
        moments = {k: v.copy() for k, v in optimizer.state.moments.items()}
        sizes = {name: p.data.size for name, p in module.state.parameters.items() if p.requires_grad}
        blocks = moment_blocks(sizes, STATE_BLOCK)[0]
        if self.state_dtype == "int8":
            moments = int8_moments(blocks, config.state_names)
        self.update = functools.partial(apply_update, config, weights, grads, moments, 1e-3, 1, threads=threads,
                                        blocks=blocks)
        self.update()

    def time_update(self, model, threads):
        self.update()


class Int8OptimizerOps(OptimizerOps):
    """OptimizerOps with AdamW's moments in 8 bits: dequantized, updated and requantized a block at a time."""

    state_dtype = "int8"


VOCABULARY = {"rows": 8 * 128, "width": 256, "classes": 4096}  # make_models.py --benchmark: batch 8 of 128 tokens


class VocabularyLossOps:
    """LinearCrossEntropy (hidden [tokens, H] times lm_head [V, H]ᵀ, scored against labels) and
    LinearCrossEntropyGrad (the weight's gradient), bound alone at the benchmark decoder's shape; track_ reports
    the scratch the node holds (its chunk of logits)."""

    params = [["LinearCrossEntropy", "LinearCrossEntropyGrad"], THREADS]
    param_names = ["op", "threads"]

    def setup(self, op, threads):
        from odtrain.graph.ir import ODTRAIN_DOMAIN, Node, TensorType

        rows, width, classes = VOCABULARY["rows"], VOCABULARY["width"], VOCABULARY["classes"]
        rng = np.random.default_rng(common.SEED)
        held = {"hidden": rng.standard_normal((rows, width)).astype(np.float32),
                "weight": (rng.standard_normal((classes, width)) * 0.05).astype(np.float32),
                "labels": rng.integers(0, classes, rows).astype(np.int64)}
        inputs = ["hidden", "weight", "labels"]
        outputs = ["loss"]
        if op.endswith("Grad"):  # the weight's gradient alone, each chunk's logits formed again (graph/ops/training.py)
            held["dloss"] = np.ones((), np.float32)
            inputs, outputs = ["dloss"] + inputs, ["dweight"]
        types = {name: TensorType(value.dtype, value.shape) for name, value in held.items()}
        types.update(loss=TensorType(np.dtype(np.float32), ()), dweight=types["weight"])
        node = Node(op, inputs, outputs, {"transB": 1, "reduction": "mean"}, op, ODTRAIN_DOMAIN)
        self.bound = _warm_node_step(node, held, types, threads)

    def time_run(self, op, threads):
        self.bound.run([])

    def track_scratch_bytes(self, op, threads):
        from odtrain.executor import scratch_bytes

        return scratch_bytes(self.bound.order[0], self.bound.types, threads)

    track_scratch_bytes.unit = "bytes"


def _warm_node_step(node, held: dict, types: dict, threads: int):
    """`node` bound alone (its inputs `held` outside the arena, its first output the graph's), run twice."""
    from odtrain.executor import ExecutableStep
    from odtrain.graph.ir import Graph

    bound = ExecutableStep(Graph([node], list(held), node.outputs[:1], {}, types, name=node.name), feed_types={}, external=held,
                           threads=threads)
    for _ in range(2):
        bound.run([])
    return bound


SILU_GATE = (4 * 128, 1536)  # SmolLM2-135M's MLP gate at batch 4 of 128 tokens


class SiluOps:
    """A decoder's SiLU gate as training runs it, fused from Mul(x, Sigmoid(x)) into ai.odtrain Swish
    (graph/fusion.py), and its gradient SwishGrad(dY, X), bound alone at SILU_GATE, values from N(0, 1)."""

    params = [["Swish", "SwishGrad"], THREADS]
    param_names = ["op", "threads"]

    def setup(self, op, threads):
        from odtrain.graph.ir import ODTRAIN_DOMAIN, Node, TensorType

        rng = np.random.default_rng(common.SEED)
        held = {"x": rng.standard_normal(SILU_GATE).astype(np.float32)}
        inputs = ["x"]
        if op == "SwishGrad":
            held["dy"] = rng.standard_normal(SILU_GATE).astype(np.float32)
            inputs = ["dy", "x"]
        types = {name: TensorType(np.dtype(np.float32), SILU_GATE) for name in list(held) + ["y"]}
        self.bound = _warm_node_step(Node(op, inputs, ["y"], {"alpha": 1.0}, op, ODTRAIN_DOMAIN), held, types, threads)

    def time_run(self, op, threads):
        self.bound.run([])


SIZE = 1 << 20


def unary_input(size: int, seed: int = common.SEED) -> np.ndarray:
    """float32 values in [0.5, 2): inside the domain of every unary op (Log, Sqrt, Reciprocal)."""
    return np.random.default_rng(seed).uniform(0.5, 2.0, size).astype(np.float32)


def _unary_ops() -> list[str]:
    from odtrain.kernels.elementwise import RARE_UNARY, SPECIAL_UNARY, UNARY

    return [*UNARY, *SPECIAL_UNARY, *RARE_UNARY, *BOOLEAN_UNARY]


BOOLEAN_UNARY = ("IsNaN", "IsInf")  # float classes: boolean outputs


class UnaryOps:
    params = _unary_ops()
    param_names = ["op"]

    def setup(self, op):
        from odtrain.kernels import BINDINGS

        x = unary_input(SIZE)
        self.calls = BINDINGS[("", op)]([x], [np.empty(x.shape, bool if op in BOOLEAN_UNARY else x.dtype)])
        self.time_forward(op)  # compiles or loads the kernel

    def time_forward(self, op):
        for kernel, args in self.calls:
            kernel(*args)


# The data-movement ops of a Llama-style decoder's step at the SmolLM2-135M LoRA step's shapes (batch 4, seq 128,
# 9 query heads, 3 key/value heads of 64, hidden 576): label -> (domain, op type, inputs (a shape, or an int64
# constant), output shapes, attributes). Memory-bound: track_bytes is what one run reads and writes (bytes over
# time_run: its GB/s).
SMOLLM2_LAYOUT = {
    "Expand repeated heads": ("", "Expand", [(4, 3, 1, 128, 64), np.array([4, 3, 3, 128, 64])], [(4, 3, 3, 128, 64)],
                              {}),
    "SumToShape repeated heads": ("ai.odtrain", "SumToShape", [(4, 3, 3, 128, 64), (4, 3, 1, 128, 64)],
                                  [(4, 3, 1, 128, 64)], {}),
    "Transpose heads": ("", "Transpose", [(4, 128, 9, 64)], [(4, 9, 128, 64)], {"perm": [0, 2, 1, 3]}),
    "Add mask over heads": ("", "Add", [(4, 9, 128, 128), (4, 1, 128, 128)], [(4, 9, 128, 128)], {}),
    "Sum of 5": ("", "Sum", [(4, 128, 576)] * 5, [(4, 128, 576)], {}),
    "RotaryEmbedding fused": ("ai.odtrain", "RotaryEmbedding", [(4, 9, 128, 64), (4, 1, 128, 64), (4, 1, 128, 64),
                                                                np.array([32])], [(4, 9, 128, 64)], {}),
    "RMSNormalizationGrad": ("ai.odtrain", "RMSNormalizationGrad", [(4, 128, 576), (4, 128, 576), (576,)],
                             [(4, 128, 576), (576,)], {"epsilon": 1e-5}),
}


class DecoderLayoutOps:
    """SMOLLM2_LAYOUT's ops, each bound alone (inputs held outside the arena, fixed-seed values in [0.5, 1.5))."""

    params = [list(SMOLLM2_LAYOUT), THREADS]
    param_names = ["op", "threads"]

    def setup(self, op, threads):
        from odtrain.executor import ExecutableStep
        from odtrain.graph.ir import Graph, Node, TensorType
        from odtrain.graph.ops import OPS

        domain, op_type, inputs, outputs, attrs = SMOLLM2_LAYOUT[op]
        rng = np.random.default_rng(common.SEED)
        held, constants = {}, {}
        for i, value in enumerate(inputs):
            if isinstance(value, np.ndarray):
                constants[f"in{i}"] = value.astype(np.int64)
            else:
                held[f"in{i}"] = rng.uniform(0.5, 1.5, value).astype(np.float32)
        names = [f"out{i}" for i in range(len(outputs))]
        types = {name: TensorType(v.dtype, v.shape) for name, v in {**held, **constants}.items()}
        types.update({name: TensorType(np.dtype(np.float32), shape) for name, shape in zip(names, outputs)})
        node = Node(op_type, [f"in{i}" for i in range(len(inputs))], names, dict(attrs), op, domain)
        self.bound = ExecutableStep(Graph([node], list(held), names[:1], constants, types, name=op), feed_types={}, external=held,
                                    threads=threads)
        unread = {f"in{i}" for i in OPS[(domain, op_type)].shape_only}
        self.bytes = sum(v.nbytes for k, v in held.items() if k not in unread) + \
            sum(4 * int(np.prod(shape)) for shape in outputs)
        for _ in range(2):
            self.bound.run([])

    def time_run(self, op, threads):
        self.bound.run([])

    def track_bytes(self, op, threads):
        return self.bytes

    track_bytes.unit = "bytes"
