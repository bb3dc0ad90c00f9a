"""The offline phase: training, eval and optimizer models and the checkpoint from a forward model.

`generate_artifacts` has the signature of onnxruntime.training.artifacts.generate_artifacts:

    generate_artifacts(model, requires_grad=[...], frozen_params=[...], loss=LossType.CrossEntropyLoss,
                       optimizer=OptimType.AdamW, artifact_directory="artifacts")

writes the files of an artifact folder (`odtrain.artifact_paths`: the training, eval and optimizer
models and the checkpoint), each name prefixed by `prefix`. Parameters named in `requires_grad` train, those in `frozen_params` are kept in
the checkpoint without training; other initializers stay constants of the models. With
`requires_grad=None`, every floating-point initializer not in `frozen_params` trains, except those a
user would not train (odtrain.graph.parameters: configuring inputs, quantization scales and zero points,
single values, position tables, initializers no gradient reaches), which the returned GeneratedArtifacts
lists with reasons; integer weights that DequantizeLinear reads are frozen. A frozen quantized weight
takes its scale and zero point into the checkpoint with it, where it stays int8 (graph/ops/quantize.py).
Keywords beyond ONNX Runtime's: `class_axis` and `ignore_index` for cross-entropy on class-last
outputs (odtrain.graph.losses), `lora` for low-rank adapters (odtrain.graph.lora), `qat` for
quantization-aware training (odtrain.graph.qat).

Before generating, `choose_parameters(graph, loss_inputs, requires_grad=, freeze=, train_last=)` picks
parameters as `odtrain prepare` does (odtrain.graph.parameters), and `missing_support(graph, trainable,
loss_inputs)` names the nodes without a kernel or a needed gradient rule (odtrain.graph.autodiff), as
`odtrain check` reports them; both take a Graph (`odtrain.graph.onnx_io.load_graph(path)`).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import checkpoint as checkpoint_file
from .artifact_paths import ArtifactPaths
from .graph.autodiff import build_gradient_graph, missing_support
from .graph.errors import ArgumentError, ModelError, ParameterError
from .graph.frozen import check_frozen_dtype, store_frozen
from .graph.ir import Graph, TensorType
from .graph.ops import OPS, check_supported
from .graph.ops.quantize import dequantized_weights, quantization_inputs
from .graph.losses import LossType, add_loss, parse_loss
from .graph.control_flow import fold_constant_ifs, loops_as_scans, map_bodies, walk
from .graph.onnx_io import read_graph, save_graph
from .graph.optimizers import OPTIMIZERS, OptimType, build_optimizer_graph, check_max_grad_norm, parse_optimizer
from .graph.lora import add_adapters
from .graph.parameters import NO_GRADIENT, ParameterChoice, choose_parameters, default_selection, quantization_parameters
from .graph.qat import QatConfig, insert_fake_quantization
from .lora import LoraConfig, target_weights
from .state import PropertyBag

__all__ = ["generate_artifacts", "build_training_graphs", "GeneratedArtifacts", "LoraConfig", "LossType", "OptimType",
           *OPTIMIZERS, "QatConfig", "choose_parameters", "ParameterChoice", "default_selection", "missing_support"]


def __getattr__(name: str):
    """odtrain.artifacts.AdamW, SGD, SGDMomentum, ...: the hyper-parameter class of each optimizer record
    (odtrain.graph.optimizers.OPTIMIZERS), so that a new optimizer is offered here by its record alone."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name].config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _select_parameters(graph, requires_grad, frozen_params):
    """(trainable, frozen, left out with reasons): named ones, or odtrain.graph.parameters' default selection."""
    floating = [n for n, v in graph.initializers.items() if np.issubdtype(v.dtype, np.floating)]
    frozen = list(frozen_params or [])
    left_out: dict[str, str] = {}
    if requires_grad is None:
        selection = default_selection(graph, frozen)
        trainable, left_out = selection.trainable, selection.left_out
        frozen += [n for n in selection.state if n not in left_out]
        frozen += [n for n in dequantized_weights(graph) if n not in frozen]  # int8 weights: frozen, not constants
    else:
        trainable = list(requires_grad)
    frozen += quantization_parameters(graph, frozen, trainable)
    left_out = {n: why for n, why in left_out.items() if n not in frozen}  # scales frozen with their weights
    for name in trainable + frozen:
        if name not in graph.initializers:
            raise ParameterError(f"'{name}' is not an initializer of the model; its parameters are: "
                                 f"{', '.join(floating) or '(none)'}")
    both = sorted(set(trainable) & set(frozen))
    if both:
        raise ArgumentError(f"parameters {both} are in both requires_grad and frozen_params")
    for name in trainable:
        if graph.initializers[name].dtype != np.float32:
            raise ArgumentError(f"parameter '{name}' is {graph.initializers[name].dtype}; only float32 parameters train")
    order = list(graph.initializers)
    return sorted(trainable, key=order.index), sorted(frozen, key=order.index), left_out


def to_eval_graph(graph):
    """The graph as the eval and inference models run it: each op in its eval form, unused outputs cut."""
    evaluated = graph.copy()
    evaluated.nodes = [_eval_node(node) for node in evaluated.nodes]
    return evaluated.prune(evaluated.outputs)


def _eval_node(node):
    """A node in its eval form, the nodes of its If, Loop or Scan bodies too."""
    opdef = OPS.get(node.key)
    node = opdef.eval_form(node) if opdef is not None and opdef.eval_form else node
    return map_bodies(node, _eval_body)


def _eval_body(body):
    evaluated = body.copy()
    evaluated.nodes = [_eval_node(node) for node in evaluated.nodes]
    return evaluated


@dataclass
class TrainingGraphs:
    """The training and eval graphs of a model, with its parameters (values go to the checkpoint)."""

    training: Graph
    eval: Graph
    trainable: list[str]
    frozen: list[str]
    values: dict[str, np.ndarray]
    param_inputs: list[str]  # parameters as extra graph inputs of both models, in checkpoint order
    left_out: dict[str, str] = field(default_factory=dict)  # initializers the default selection did not train, why


def _with_adapters(graph, lora: LoraConfig, requires_grad, frozen_params):
    """(the graph with LoRA adapters, trainable, frozen, left out): the adapters train with `requires_grad` (extra
    parameters, e.g. norms); every other parameter of the default selection is frozen, kept in the checkpoint."""
    if not isinstance(lora, LoraConfig):
        raise ArgumentError(f"lora must be an odtrain.artifacts.LoraConfig, got {type(lora).__name__}")
    base = default_selection(graph, frozen_params or ())
    adapted, adapters = add_adapters(graph, target_weights(graph, lora), lora.rank, lora.scale, lora.seed)
    extra = list(requires_grad or [])
    frozen = [n for n in base.trainable if n not in extra] + list(frozen_params or []) + base.state
    return adapted, list(adapters) + extra, frozen, base.left_out


def build_training_graphs(model, requires_grad=None, frozen_params=None, loss=None, additional_output_names=None,
                          loss_input_names=None, class_axis=None, ignore_index=None, lora=None,
                          qat: QatConfig | None = None, frozen_dtype: str = "float32",
                          eval_output_names=None) -> TrainingGraphs:
    """Forward model + loss -> training graph (with `<param>_grad` outputs) and eval graph.

    `loss` is a LossType; or an object with a method `build_loss(graph, loss_inputs)` that adds the loss to
    the forward graph and returns (the scalar loss's name, extra output names), as odtrain.onnxblock
    blocks do (their build takes the loss inputs and returns the loss name, or (loss, *extra outputs));
    or None when the model's output is the loss. `class_axis` and `ignore_index` configure
    LossType.CrossEntropyLoss (odtrain.graph.losses). With `lora` (a LoraConfig), adapters train on the
    targeted weights, with the parameters `requires_grad` names; the rest is frozen (odtrain.graph.lora).
    `qat` inserts fake quantization (graph/qat.py); its activation ranges join the frozen parameters.
    `frozen_dtype` ("float32", "bfloat16", "int8", "int4") is the type the frozen weight matrices are stored
    and held in (odtrain.graph.frozen); int8's and int4's scales join the frozen parameters. `additional_output_names` are
    outputs of both graphs; `eval_output_names` of the eval graph only, so that the training step neither
    keeps nor returns them (a language model's logits: then the vocabulary product fuses with its loss).
    """
    check_frozen_dtype(frozen_dtype)
    custom_loss = hasattr(loss, "build_loss")
    graph, path = read_graph(model, "model")
    graph = loops_as_scans(fold_constant_ifs(graph))  # an If on a constant condition becomes its branch; a
    # Loop that reads rows x[i] over a constant trip count, a Scan over them (graph/control_flow.py)
    check_supported(list(walk(graph)), f"model '{path}'" if path else "model")
    graph, trainable, frozen, left_out = _chosen_parameters(graph, requires_grad, frozen_params, lora, qat,
                                                            frozen_dtype)
    extra_outputs, eval_outputs, loss_inputs = _named_outputs(graph, additional_output_names, eval_output_names,
                                                              loss_input_names, custom_loss)
    forward, loss_name, extra_outputs = _with_loss(graph, loss, custom_loss, loss_inputs, extra_outputs,
                                                   eval_outputs, class_axis, ignore_index)
    frozen, used = _checked_parameters(forward, trainable, frozen)
    params = trainable + frozen
    for p in params:  # parameters leave the models; their values go to the checkpoint
        forward.initializers.pop(p, None)
        forward.value_types.setdefault(p, TensorType(graph.initializers[p].dtype, graph.initializers[p].shape))
    if requires_grad is None:  # "every parameter": leave out initializers no gradient reaches (Resize scales)
        _leave_out_unreached(forward, graph, loss_name, trainable, params, left_out)
    eval_graph = to_eval_graph(forward)
    trained = forward.prune([loss_name] + extra_outputs) if len(forward.outputs) > 1 + len(extra_outputs) else forward
    training_graph = build_gradient_graph(trained, loss_name, trainable)
    return TrainingGraphs(training_graph, eval_graph, trainable, frozen, {p: graph.initializers[p] for p in params},
                          [p for p in params if p in used], left_out)


def _chosen_parameters(graph, requires_grad, frozen_params, lora, qat, frozen_dtype):
    """(the graph with adapters, fake quantization and frozen weights stored as `frozen_dtype`, trainable,
    frozen, left out with reasons); the graph read is build_training_graphs' own to change."""
    lora_left_out = {}
    if lora is not None:
        graph, requires_grad, frozen_params, lora_left_out = _with_adapters(graph, lora, requires_grad, frozen_params)
    trainable, frozen, left_out = _select_parameters(graph, requires_grad, frozen_params)
    left_out.update(lora_left_out)
    if qat is not None:
        frozen += insert_fake_quantization(graph, qat, trainable + frozen)
    frozen += store_frozen(graph, frozen, frozen_dtype)
    if not trainable:
        raise ArgumentError("no parameter requires a gradient: list parameters in requires_grad")
    return graph, trainable, frozen, left_out


def _named_outputs(graph, additional_output_names, eval_output_names, loss_input_names, custom_loss):
    """(outputs of both graphs, outputs of the eval graph only, the loss's inputs), each a value of the model."""
    known = graph.all_value_names()
    extra_outputs = list(additional_output_names or [])
    eval_outputs = [n for n in eval_output_names or [] if n not in extra_outputs]
    for name in extra_outputs + eval_outputs:
        if name not in known:
            raise ArgumentError(f"additional output '{name}' is not a value of the model; its outputs are {graph.outputs}")
    if loss_input_names is not None:
        loss_inputs = list(loss_input_names)
        for name in loss_inputs:
            if name not in known:
                raise ArgumentError(f"loss input '{name}' is not a value of the model; its outputs are {graph.outputs}")
    elif len(graph.outputs) == 1 or custom_loss:  # a block scores every output, as in ONNX Runtime
        loss_inputs = list(graph.outputs)
    else:
        raise ArgumentError(f"the model has {len(graph.outputs)} outputs {graph.outputs}: name the one the loss "
                            "scores with loss_input_names=[...]")
    return extra_outputs, eval_outputs, loss_inputs


def _with_loss(graph, loss, custom_loss, loss_inputs, extra_outputs, eval_outputs, class_axis, ignore_index):
    """(a copy of the graph with the loss added, pruned to the loss and the outputs asked for, the loss's name,
    the outputs of both graphs with those a loss block adds)."""
    forward = graph.copy()
    extra_outputs = list(extra_outputs)
    if loss is None:
        loss_name = loss_inputs[0]
        t = forward.value_types.get(loss_name)
        if t is not None and t.shape not in ((), None):
            raise ModelError(f"with loss=None the model output '{loss_name}' is the loss and must be a scalar; it is {t}")
    elif custom_loss:
        loss_name, block_outputs = loss.build_loss(forward, loss_inputs)
        extra_outputs += [name for name in block_outputs if name not in extra_outputs and name != loss_name]
    else:
        loss_name = add_loss(forward, parse_loss(loss), loss_inputs, class_axis, ignore_index)
    forward.outputs = [loss_name] + extra_outputs + [n for n in eval_outputs if n not in extra_outputs]
    return forward.prune(forward.outputs), loss_name, extra_outputs


def _checked_parameters(forward, trainable, frozen) -> tuple[list[str], set]:
    """(the frozen parameters the loss reads, every value a node reads), once no parameter configures an op
    and every trainable one is read; a frozen parameter nothing reads is left out with a warning."""
    params = trainable + frozen
    for node in forward.nodes:  # shapes, axes, scales must stay constants of the model
        constant_inputs = OPS[node.key].constant_inputs if node.key in OPS else ()
        for k in constant_inputs:
            if k < len(node.inputs) and node.inputs[k] in params:
                raise ModelError(f"'{node.inputs[k]}' configures {node.describe()} (input {k}, a shape, axes, "
                                 "scales or pads): it must stay a constant of the model; leave it out of "
                                 "requires_grad and frozen_params")
    used = {i for node in forward.nodes for i in node.inputs}
    unused = [p for p in trainable if p not in used]
    if unused:
        raise ArgumentError(f"parameters {unused} are not used on the way to the loss; leave them out of "
                            "requires_grad")
    dead = [p for p in frozen if p not in used]  # ONNX Runtime accepts these too: nothing reads them
    if dead:
        shown = ", ".join(f"'{p}'" for p in dead[:5]) + (f" and {len(dead) - 5} more" if len(dead) > 5 else "")
        warnings.warn(f"{len(dead)} frozen_params are used on no path to the loss and stay out of the checkpoint: "
                      f"{shown}", stacklevel=4)
        frozen = [p for p in frozen if p in used]
    return frozen, used


def _leave_out_unreached(forward, graph, loss_name, trainable, params, left_out) -> None:
    """With every parameter chosen: those no gradient reaches (Resize's scales) become constants again, listed in
    `left_out`; trainable and params lose them in place."""
    constants: list[str] = []
    build_gradient_graph(forward, loss_name, trainable, without_gradient=constants)
    for name in constants:
        trainable.remove(name)
        params.remove(name)
        forward.initializers[name] = graph.initializers[name]
        left_out[name] = NO_GRADIENT
    if not trainable:
        raise ArgumentError("no parameter of the model receives a gradient from the loss")


@dataclass
class GeneratedArtifacts:
    """What generate_artifacts wrote and decided (ONNX Runtime's returns nothing; odtrain's says)."""

    paths: ArtifactPaths
    trainable: list[str]
    frozen: list[str]
    left_out: dict[str, str]  # initializers the default selection left as constants, and why


def _clipping(optimizer, max_grad_norm) -> float | None:
    """The gradient clipping norm: `max_grad_norm`, or an optimizer block's clip_grad; both only when they agree."""
    given, blocks = check_max_grad_norm(max_grad_norm), getattr(optimizer, "max_grad_norm", None)
    if given is not None and blocks is not None and given != blocks:
        raise ArgumentError(f"max_grad_norm={given:g} and the optimizer block's clip_grad (max_norm {blocks:g}) "
                            "disagree: give one of them")
    if optimizer is None and given is not None:
        raise ArgumentError("max_grad_norm clips the gradients in the optimizer model: give an optimizer too")
    return given if given is not None else blocks


def generate_artifacts(model, requires_grad=None, frozen_params=None, loss=None, optimizer=None,
                       artifact_directory=None, prefix: str = "", ort_format: bool = False,
                       custom_op_library=None, additional_output_names=None, nominal_checkpoint: bool = False,
                       loss_input_names=None, class_axis=None, ignore_index=None, lora=None,
                       qat: QatConfig | None = None, properties: dict | None = None,
                       frozen_dtype: str = "float32", eval_output_names=None,
                       max_grad_norm: float | None = None) -> GeneratedArtifacts:
    """Write the training artifacts for `model` (an onnx.ModelProto or a path) into `artifact_directory`.

    `loss` and `optimizer` also accept odtrain.onnxblock blocks (a custom loss; onnxblock.optim.AdamW, SGD,
    SGDMomentum: objects that carry an optimizer `config`). With LossType.CrossEntropyLoss, `class_axis=-1`
    reads the classes on the last axis (logits [batch, seq, vocab], labels [batch, seq]) instead of ONNX's
    axis 1, and labels equal to `ignore_index` (e.g. -100 on padding) are left out of the loss.
    `lora=LoraConfig(rank, alpha, target_params=[...])` trains low-rank adapters of the targeted weights
    (and what `requires_grad` names) instead of the weights; export merges them back. `qat=QatConfig()`
    trains with fake quantization; the exported inference model is then a QDQ model with int8 weights.
    `properties` (int, float or str values) are stored in the checkpoint, as CheckpointState.properties.
    `frozen_dtype="int8"` (per output channel, float32 scales), `"int4"` (blocks of 32 along the input axis,
    float32 scales; the models are then opset 21) or `"bfloat16"` stores and holds the frozen
    weight matrices (those of products, embeddings, convolutions) in that type (odtrain.graph.frozen);
    training reads them a panel at a time, never as a whole float32 copy. `eval_output_names` are added to
    the eval model only (what `odtrain eval` scores and export writes), so the training step does not keep
    them: a language model's [batch, seq, vocab] logits then never exist whole in training.
    `max_grad_norm` clips all gradients together to that L2 norm before each optimizer step, as
    torch.nn.utils.clip_grad_norm_ (an onnxblock AdamW's `clip_grad=onnxblock.optim.ClipGradNorm(c)` says
    the same); Optimizer.grad_norm is the norm before clipping.

    Returns what was written and which parameters train; with `requires_grad=None`, `left_out` names the
    floating-point initializers left as constants (rotary tables, single values, ...) with the reason."""
    if qat is not None and not isinstance(qat, QatConfig):
        raise ArgumentError(f"qat must be an artifacts.QatConfig, got {type(qat).__name__}")
    if ort_format:
        raise ArgumentError("ort_format=True does not apply: odtrain reads and writes ONNX files, not ORT format")
    if custom_op_library is not None:
        raise ArgumentError("custom_op_library does not apply: odtrain runs its own kernels and cannot load "
                            "ONNX Runtime custom-op libraries")
    max_grad_norm = _clipping(optimizer, max_grad_norm)
    optimizer = getattr(optimizer, "config", optimizer)  # an optimizer block's hyper-parameters
    optimizer = parse_optimizer(optimizer) if optimizer is not None else None
    built = build_training_graphs(model, requires_grad, frozen_params, loss, additional_output_names, loss_input_names,
                                  class_axis, ignore_index, lora, qat, frozen_dtype, eval_output_names)
    trainable, values = built.trainable, built.values

    paths = ArtifactPaths.of(artifact_directory if artifact_directory is not None else os.getcwd(), prefix)
    os.makedirs(paths.directory, exist_ok=True)
    save_graph(built.training, paths.training_model, built.param_inputs)
    save_graph(built.eval, paths.eval_model, built.param_inputs)
    if optimizer is not None:
        save_graph(build_optimizer_graph(optimizer, trainable, max_grad_norm), paths.optimizer_model)
    checkpoint_file.save(paths.checkpoint, checkpoint_file.CheckpointContents(values, trainable,
                                                                              PropertyBag(properties).to_dict()),
                         keep_previous=False)  # new artifacts: a checkpoint.previous left there is another model's
    if nominal_checkpoint:
        checkpoint_file.save(paths.nominal_checkpoint,
                             checkpoint_file.CheckpointContents(values, trainable, nominal=True))
    return GeneratedArtifacts(paths, trainable, built.frozen, built.left_out)
