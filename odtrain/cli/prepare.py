"""`odtrain check` (can odtrain train this model?) and `odtrain prepare` (the artifacts).
"""
from __future__ import annotations

import os
import sys

from ..artifact_paths import ArtifactPaths
from ..graph.errors import ArgumentError, OdtrainError, UnsupportedOpError
from ..allocation import format_bytes
from ..graph.frozen import FROZEN_DTYPES, frozen_bytes
from ..graph.optimizers import OPTIMIZERS, STATE_DTYPES
from ..graph.wording import count
from .options import Command, add_shape_arguments, input_shapes, listed, note, print_json, value_text


def _loss_type(name: str):
    from ..artifacts import LossType

    return {"ce": LossType.CrossEntropyLoss, "mse": LossType.MSELoss, "bce": LossType.BCEWithLogitsLoss,
            "l1": LossType.L1Loss}[name]


def _loss_layout(graph, loss_inputs, args) -> tuple[int | None, int | None, str]:
    """(class_axis, ignore_index, what to tell the user) for --loss ce: the flags, else detected from the output."""
    from ..graph.losses import detect_class_axis

    if args.loss != "ce":
        if args.class_axis is not None or args.ignore_index is not None:
            raise ArgumentError(f"--class-axis and --ignore-index apply to --loss ce, not {args.loss}")
        return None, None, ""
    output = graph.value_types.get(loss_inputs[0])
    if args.class_axis is not None:
        axis, how = (-1 if args.class_axis == "last" else 1), "--class-axis"
    elif output is not None:
        axis, why = detect_class_axis(output)
        how = f"detected: {why}"
    else:
        axis, how = 1, "the output's shape is unknown"
    ignore = args.ignore_index if args.ignore_index is not None else (-100 if axis == -1 else None)
    where = "the last axis" if axis == -1 else "axis 1"
    text = f"classes on {where} ({how})" + (f"; labels equal to {ignore} are ignored" if ignore is not None else "")
    return (axis if axis == -1 else None), ignore, text


def _loss_inputs(graph, loss_input):
    if loss_input:
        return [loss_input]
    if len(graph.outputs) != 1:
        raise ArgumentError(f"the model has {len(graph.outputs)} outputs {graph.outputs}: name the one the loss "
                            "scores with --loss-input NAME")
    return list(graph.outputs)


def _training_choices(graph, args) -> dict:
    """What check and prepare hand to generate_artifacts, from the model and the command's options, with
    `left_out` and `loss_text` (what to tell the user) besides."""
    from ..artifacts import choose_parameters

    loss_inputs = _loss_inputs(graph, args.loss_input)
    choice = choose_parameters(graph, loss_inputs, args.requires_grad, args.freeze, args.train_last,
                               lambda names: listed(names, args.verbose))
    class_axis, ignore_index, loss_text = _loss_layout(graph, loss_inputs, args)
    if getattr(args, "train_biases", False):
        from ..personalise import with_biases

        chosen = bool(args.requires_grad or args.freeze or args.train_last is not None)
        choice.trainable, choice.frozen = with_biases(graph, choice.trainable, choice.frozen, chosen)
        if not choice.trainable:
            raise ArgumentError("--train-biases found no bias (Conv, Gemm or normalization input 2, or a vector added "
                                "to a MatMul) in the model; choose parameters with --train-last or --requires-grad")
    choices = {"requires_grad": choice.trainable, "frozen_params": choice.frozen, "loss": _loss_type(args.loss),
               "loss_input_names": loss_inputs, "class_axis": class_axis, "ignore_index": ignore_index,
               "left_out": choice.left_out, "loss_text": loss_text}
    if getattr(args, "qat", False):
        from ..artifacts import QatConfig

        choices["qat"] = QatConfig()
    if getattr(args, "lora_rank", None):  # adapters train, with the parameters --requires-grad names
        from ..artifacts import LoraConfig

        if args.freeze or args.train_last is not None:
            raise ArgumentError("with --lora-rank every weight is frozen: name parameters to train besides the "
                                "adapters with --requires-grad")
        alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
        choices.update(requires_grad=choice.trainable if args.requires_grad else None, frozen_params=None,
                       lora=LoraConfig(args.lora_rank, alpha, args.lora_targets or ["*"], seed=args.lora_seed))
    return choices


def _artifact_options(choices: dict) -> dict:
    return {k: v for k, v in choices.items() if k not in ("left_out", "loss_text")}


TRIAL_SEQUENCE_LENGTH = 8


def _trial_bind(model, choices: dict, batch_size: int = 2):
    """Generate the artifacts in a temporary folder and bind their training and eval steps: (arena bytes, error)."""
    import tempfile

    from .. import artifacts
    from ..api import CheckpointState, Module

    with tempfile.TemporaryDirectory(prefix="odtrain-check-") as folder:
        try:
            artifacts.generate_artifacts(model, artifact_directory=folder, **_artifact_options(choices))
            paths = ArtifactPaths.of(folder)
            state = CheckpointState.load_checkpoint(paths.checkpoint)
            module = Module(paths.training_model, state, paths.eval_model)
            return max(module.bind_at(batch_size, training, TRIAL_SEQUENCE_LENGTH).arena_bytes
                       for training in (True, False)), None
        except OdtrainError as error:
            return None, str(error)


def _optimizer_commands() -> tuple[str, ...]:
    """The choices of --optimizer: the optimizer records that name one (graph/optimizers.py)."""
    return tuple(record.command for record in OPTIMIZERS.values() if record.command)


def _names(kinds) -> str:
    kinds = list(kinds)
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} and {kinds[-1]}"


def _chosen_optimizer(args):
    """The hyper-parameters of the optimizer --optimizer names, with what --weight-decay and
    --optimizer-state-dtype set; either option given to an optimizer that does not take it is an ArgumentError."""
    offered = [record for record in OPTIMIZERS.values() if record.command]
    record = next(record for record in offered if record.command == args.optimizer)
    takes = record.hyper_parameters()
    if args.weight_decay and "weight_decay" not in takes:
        decaying = [r.kind for r in offered if "weight_decay" in r.hyper_parameters()]
        raise ArgumentError(f"--weight-decay applies to {_names(decaying)} only")
    if args.optimizer_state_dtype not in record.state_dtypes:
        keeping = [r.kind for r in offered if args.optimizer_state_dtype in r.state_dtypes]
        kept = "keeps no moments" if not record.state_names else "keeps its state in float32"
        raise ArgumentError(f"--optimizer-state-dtype applies to {_names(keeping)}'s moments only; "
                            f"{record.kind} {kept}")
    given = {"weight_decay": args.weight_decay, "state_dtype": args.optimizer_state_dtype}
    return record.config(**{name: value for name, value in given.items() if name in takes})


def _print_left_out(left_out: dict, verbose: bool = False) -> None:
    """One line per reason, naming the initializers the default selection left out for it."""
    reasons: dict[str, list[str]] = {}
    for name, why in left_out.items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        print(f"  left out: {listed(names, verbose)}: {why}")


def _list_ops(args) -> int:
    """`odtrain check --ops`: every registered op, with its gradient rule or why it has none."""
    from ..graph.ops import OPS

    rows = sorted(OPS.values(), key=lambda o: (o.domain, o.op_type))
    if args.json:
        print_json([{"op": o.op_type, "domain": o.domain, "gradient": o.gradient is not None,
                      "no_gradient_reason": o.no_grad_reason} for o in rows])
        return 0
    for o in rows:
        name = f"{o.domain}::{o.op_type}" if o.domain else o.op_type
        print(f"{name:<36} {'gradient rule' if o.gradient else 'no gradient: ' + (o.no_grad_reason or 'none')}")
    return 0


def _check_report(args, graph, choices, no_kernel, no_gradient, arena, trial_error) -> dict:
    """What `odtrain check --json` prints (the text report reads it too)."""
    from collections import Counter

    trainable, frozen = choices["requires_grad"], choices["frozen_params"]
    sizes = {n: int(graph.initializers[n].size) for n in trainable + frozen}
    return {
        "model": args.model, "trainable": not no_kernel and not no_gradient and trial_error is None, "loss": args.loss,
        "inputs": [value_text(graph, n) for n in graph.inputs], "outputs": [value_text(graph, n) for n in graph.outputs],
        "ops": dict(Counter(node.op_type for node in graph.nodes)),
        "no_kernel": [{"node": n.name, "op_type": n.op_type, "domain": n.domain} for n in no_kernel],
        "no_gradient": [{"node": n.name, "op_type": n.op_type, "reason": r} for n, r in no_gradient],
        "parameters": {"trainable": sum(sizes[n] for n in trainable), "frozen": sum(sizes[n] for n in frozen),
                       "trainable_tensors": trainable, "frozen_tensors": frozen},
        "left_out": choices["left_out"], "loss_layout": choices["loss_text"], "error": trial_error,
        "arena_bytes_at_batch_2": arena,
    }


def _print_check(args, graph, choices, report, no_kernel, no_gradient) -> None:
    """The text report of `odtrain check`: the model, its ops, what lacks a kernel or gradient, the parameters."""
    trainable, frozen = choices["requires_grad"], choices["frozen_params"]
    print(f"model: {args.model} ({count(len(graph.nodes), 'node')}); inputs {', '.join(report['inputs'])}; "
          f"outputs {', '.join(report['outputs'])}")
    ops = ", ".join(f"{op} x{count}" if count > 1 else op for op, count in report["ops"].items())
    print(f"ops: {ops}")
    for node in no_kernel:
        print(f"  no kernel: {node.describe()}")
    for node, reason in no_gradient:
        print(f"  no gradient rule: {node.describe()}" + (f" ({reason})" if reason else ""))
    if not no_kernel:
        print("  every op has a kernel" + ("" if no_gradient else ", and a gradient rule wherever a trainable "
                                           "parameter depends on it"))
    p = report["parameters"]
    frozen_text = f" in {count(len(frozen), 'tensor')} ({listed(frozen, args.verbose)})" if frozen else ""
    print(f"parameters: {p['trainable']:,} trainable in {count(len(trainable), 'tensor')} "
          f"({listed(trainable, args.verbose)}); {p['frozen']:,} frozen{frozen_text}")
    _print_left_out(choices["left_out"], args.verbose)
    if choices["loss_text"]:
        print(f"loss: {args.loss} on '{choices['loss_input_names'][0]}', {choices['loss_text']}")
    if report["error"]:
        print(f"  generating and binding the artifacts failed: {report['error']}")
    elif report["trainable"]:
        shapes = [graph.value_types[n].shape or () for n in graph.inputs]
        batch = any(shape[:1] and not isinstance(shape[0], int) for shape in shapes)
        sequence = any(isinstance(d, str) for shape in shapes for d in shape[1:])
        at = ", ".join(["batch size 2"] * batch + [f"sequence length {TRIAL_SEQUENCE_LENGTH}"] * sequence) \
            or "its fixed input shapes"
        print(f"odtrain can train this model (loss {args.loss}; a training step at {at} plans "
              f"{report['arena_bytes_at_batch_2']:,} bytes of arena)")


def _check(args) -> int:
    from ..artifacts import missing_support
    from ..graph.onnx_io import load_graph

    if args.ops:
        return _list_ops(args)
    if not args.model:
        raise ArgumentError("name a model to check (odtrain check MODEL.onnx), or list the supported ops with --ops")
    try:
        graph = load_graph(args.model, "model")
    except UnsupportedOpError as error:  # ops of a foreign domain: untrainable (1), as an op without a kernel is
        if args.json:
            print_json({"model": args.model, "trainable": False, "error": str(error)})
        print(f"odtrain check: error: {error}", file=sys.stderr)
        return 1
    if not args.loss_input and len(graph.outputs) > 1:  # name the ops nothing trains before asking for the loss input
        return _check_every_output(graph, args)
    choices = _training_choices(graph, args)
    no_kernel, no_gradient = missing_support(graph, choices["requires_grad"], choices["loss_input_names"])
    arena, trial_error = (None, None)
    if not no_kernel and not no_gradient:
        arena, trial_error = _trial_bind(args.model, choices)
    report = _check_report(args, graph, choices, no_kernel, no_gradient, arena, trial_error)
    if args.json:
        print_json(report)
    else:
        _print_check(args, graph, choices, report, no_kernel, no_gradient)
    if report["trainable"]:
        return 0
    problems = [f"{count(len(no_kernel), 'op')} without a kernel"] if no_kernel else []
    problems += [f"{count(len(no_gradient), 'op')} without a gradient rule"] if no_gradient else []
    problems += ["its artifacts cannot be generated or bound"] if trial_error else []
    advice = " (freeze the parameters before them, e.g. --train-last N)" if no_gradient and not no_kernel else ""
    print(f"odtrain check: error: '{args.model}' cannot be trained: {' and '.join(problems)}{advice}; "
          "details above", file=sys.stderr)
    return 1


def _check_every_output(graph, args) -> int:
    """For a model with several outputs and no --loss-input: name every op without a kernel, and every op without a
    gradient rule between a trainable parameter and any output, then stop (exit 1 when there are such ops, else the
    request for --loss-input, exit 2). README promises every op is named before any work."""
    from ..artifacts import choose_parameters, missing_support

    outputs = list(graph.outputs)
    trainable = choose_parameters(graph, outputs, args.requires_grad, args.freeze, args.train_last,
                                  lambda names: listed(names, args.verbose)).trainable
    no_kernel, no_gradient = missing_support(graph, trainable, outputs)
    asked = (f"the model has {len(outputs)} outputs {outputs}: name the one the loss scores with --loss-input NAME")
    if not no_kernel and not no_gradient:
        raise ArgumentError(asked)
    if args.json:
        print_json({"model": args.model, "trainable": False, "error": asked,
                    "no_kernel": [{"node": n.name, "op_type": n.op_type, "domain": n.domain} for n in no_kernel],
                    "no_gradient": [{"node": n.name, "op_type": n.op_type, "reason": r} for n, r in no_gradient]})
    else:
        print(f"model: {args.model} ({count(len(graph.nodes), 'node')}); outputs {', '.join(outputs)}")
        for node in no_kernel:
            print(f"  no kernel: {node.describe()}")
        for node, reason in no_gradient:
            print(f"  no gradient rule (towards some output): {node.describe()}" + (f" ({reason})" if reason else ""))
    problems = [f"{count(len(no_kernel), 'op')} without a kernel"] if no_kernel else []
    problems += [f"{count(len(no_gradient), 'op')} without a gradient rule"] if no_gradient else []
    print(f"odtrain check: error: '{args.model}' cannot be trained as it is: {' and '.join(problems)}; details "
          f"above. Besides, {asked}", file=sys.stderr)
    return 1


def _check_output(args) -> str:
    """The checkpoint path `odtrain prepare` will write, once the options allow writing it: a positive --lr, -o a
    folder, and --force where the folder holds artifacts already."""
    if args.lr <= 0:
        raise ArgumentError(f"--lr must be > 0, got {args.lr}")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ArgumentError(f"'{args.output}' is a file: -o names the folder to write the artifacts to; choose "
                            "a folder name such as "
                            f"'{os.path.splitext(args.output)[0] or 'model'}-artifacts'")
    checkpoint = ArtifactPaths.of(args.output).checkpoint
    if os.path.exists(checkpoint) and not args.force:
        raise ArgumentError(f"'{args.output}' already holds artifacts (a checkpoint); pass --force to replace "
                            "them, or choose another folder with -o")
    return checkpoint


def _remove_replaced_library(args) -> None:
    """Remove the kernel library of the artifacts just replaced (--force): --compile builds it anew."""
    from ..kernel_library import FOLDER

    stale = os.path.join(args.output, FOLDER)
    if os.path.isdir(stale):
        import shutil

        shutil.rmtree(stale)
        note(args, f"removed {stale}/, the kernel library of the artifacts replaced"
              + ("" if args.compile else f"; `odtrain compile {args.output}` builds theirs"))


def _prepared(args, choices, generated, checkpoint) -> dict:
    """What `odtrain prepare --json` prints: the files, the parameters and their sizes, the loss and optimizer."""
    from .. import checkpoint as checkpoint_file

    trainable, frozen = generated.trainable, generated.frozen
    paths = ArtifactPaths.find(args.output)
    stored = checkpoint_file.load(checkpoint).parameters  # views of the file: sizes without reading it
    sizes = {n: int(stored[n].size) for n in trainable + frozen}
    by_type = frozen_bytes({n: stored[n] for n in frozen})
    files = (paths.training_model, paths.eval_model, paths.optimizer_model, paths.checkpoint)
    return {"artifacts": args.output, "files": [os.path.basename(p) for p in files],
            "trainable": trainable, "frozen": frozen, "trainable_values": sum(sizes[n] for n in trainable),
            "frozen_values": sum(sizes[n] for n in frozen), "frozen_bytes_by_type": by_type,
            "left_out": choices["left_out"], "loss": args.loss,
            "loss_layout": choices["loss_text"], "optimizer": args.optimizer, "learning_rate": args.lr,
            "max_grad_norm": args.max_grad_norm, "qat": choices.get("qat") is not None}


def _compile(args) -> int:
    """`prepare --compile`: build the artifacts' kernels into ARTIFACT_DIR/kernels; the number of kernels."""
    from ..library_build import compile_artifacts

    manifest = compile_artifacts(args.output, batch_size=args.compile_batch_size,
                                 out=(lambda line: None) if args.json else print, target=args.compile_target,
                                 cpu=args.compile_cpu, sequence_length=args.compile_seq_len,
                                 input_shapes=input_shapes(args.compile_input_shape, "--compile-input-shape"))
    return len(manifest["entries"])


def _print_prepared(args, choices, result) -> None:
    """The text report of `odtrain prepare`: what was written, what trains, what is frozen, the data it feeds on."""
    from ..training import Session

    trainable, frozen, by_type = result["trainable"], result["frozen"], result["frozen_bytes_by_type"]
    inputs = Session(args.output, with_optimizer=False).inputs
    print(f"artifacts written to {args.output}/: {', '.join(result['files'])}")
    lora = choices.get("lora")
    if lora:
        from ..lora import is_adapter

        adapted = [n.rsplit(".lora_", 1)[0] for n in trainable if n.endswith(".lora_A")]
        others = [n for n in trainable if not is_adapter(n)]
        print(f"trainable: {result['trainable_values']:,} values: LoRA adapters of rank {lora.rank} (alpha "
              f"{lora.alpha:g}) on {count(len(adapted), 'weight')} ({listed(adapted, args.verbose)})"
              + (f", and {listed(others, args.verbose)}" if others else ""))
    else:
        print(f"trainable: {result['trainable_values']:,} values in {count(len(trainable), 'tensor')} "
              f"({listed(trainable, args.verbose)})")
    held = "" if set(by_type) <= {"float32"} else \
        ", held as " + ", ".join(f"{dtype} {format_bytes(n)}" for dtype, n in by_type.items())
    print(f"frozen: {result['frozen_values']:,} values in {count(len(frozen), 'tensor')}{held} "
          f"({listed(frozen, args.verbose)})" if frozen else "frozen: none")
    _print_left_out(choices["left_out"], args.verbose)
    layout = f", {choices['loss_text']}" if choices["loss_text"] else ""
    clipping = f", gradients clipped to a norm of {args.max_grad_norm:g}" if args.max_grad_norm is not None else ""
    print(f"loss: {args.loss} on '{choices['loss_input_names'][0]}'{layout}; optimizer: {args.optimizer}, "
          f"learning rate {args.lr:g}{clipping}")
    qat = choices.get("qat")
    if qat is not None:
        print(f"quantization-aware training: {qat.weight_dtype} weights per {'channel' if qat.per_channel else 'tensor'}, "
              f"{qat.activation_dtype} activations per tensor; `odtrain export` writes a QDQ model")
    print(f"training data feeds: {', '.join(s.describe() for s in inputs)}")


def _prepare(args) -> int:
    from .. import artifacts
    from ..graph.onnx_io import load_graph

    graph = load_graph(args.model, "model")
    choices = _training_choices(graph, args)
    checkpoint = _check_output(args)
    optimizer = _chosen_optimizer(args)
    # the model's outputs are what eval scores and export writes; a training step returns the loss alone
    loss_inputs = choices["loss_input_names"]
    predictions = [o for o in graph.outputs if o in loss_inputs] + [o for o in graph.outputs if o not in loss_inputs]
    properties = {"learning_rate": float(args.lr), "loss": args.loss, "optimizer": args.optimizer}
    del graph  # its mapping of the model file: generate_artifacts maps the file again
    model = _frozen_batch_norm_model(args) if args.freeze_batchnorm else args.model
    generated = artifacts.generate_artifacts(model, optimizer=optimizer, artifact_directory=args.output,
                                             eval_output_names=predictions, properties=properties,
                                             frozen_dtype=args.frozen_dtype, max_grad_norm=args.max_grad_norm,
                                             **_artifact_options(choices))
    _remove_replaced_library(args)
    result = _prepared(args, choices, generated, checkpoint)
    if args.compile:
        result["kernels"] = _compile(args)
    if args.json:
        print_json(result)
    else:
        _print_prepared(args, choices, result)
    return 0


def _frozen_batch_norm_model(args):
    """The model with its BatchNormalization layers using (and keeping) their running statistics in training."""
    import onnx

    from ..personalise import freeze_batch_norm

    model = onnx.load(args.model)
    rewritten, already = freeze_batch_norm(model)
    if rewritten + already == 0:
        raise ArgumentError(f"--freeze-batchnorm: '{args.model}' has no BatchNormalization layer")
    note(args, f"BatchNormalization: {count(rewritten + already, 'layer')} normalize with their running statistics "
         f"in training and keep them fixed ({rewritten} of them exported in training mode)")
    return model


def _add_selection_options(command) -> None:
    command.add_argument("--loss", choices=("ce", "mse", "bce", "l1"), default="ce",
                         help="cross-entropy (default), mean squared error, binary cross-entropy on logits, or L1")
    command.add_argument("--loss-input", metavar="NAME", help="the model output the loss scores "
                         "(default: the only output)")
    command.add_argument("--class-axis", choices=("1", "last"), help="for --loss ce: the classes are on axis 1 "
                         "(ONNX's scores [N, C, ...], labels [N, ...]) or on the last axis (logits [batch, seq, "
                         "vocab], labels [batch, seq]); default: the last axis when the output is [N, seq, C] with "
                         "a symbolic seq, else axis 1")
    command.add_argument("--ignore-index", type=int, metavar="LABEL", help="for --loss ce: labels with this value "
                         "(padding) do not count (default: -100 with the classes last, else none)")
    which = command.add_mutually_exclusive_group()
    which.add_argument("--requires-grad", nargs="+", metavar="NAME", help="parameters to train, by name or glob "
                       "pattern ('fc2.*'); the others are frozen")
    which.add_argument("--freeze", nargs="+", metavar="NAME", help="parameters to freeze, by name or glob "
                       "pattern; the others train")
    which.add_argument("--train-last", type=int, metavar="N", help="train only the last N layers with parameters "
                       "(parameters grouped by the node that uses them, in graph order)")
    command.add_argument("--train-biases", action="store_true", help="train the biases of every layer (Conv, Gemm, "
                         "normalization shifts, vectors added to a MatMul; TinyTL's bias-only update), besides what "
                         "--train-last, --requires-grad or --freeze choose; alone, only the biases train")
    command.add_argument("-v", "--verbose", action="store_true", help="list every parameter name (a long list "
                         "shows its first and last few)")


def _check_arguments(check) -> None:
    check.add_argument("model", nargs="?", metavar="MODEL.onnx", help="a forward-only ONNX model")
    _add_selection_options(check)
    check.add_argument("--ops", action="store_true", help="list the ops odtrain supports, with their gradients")
    check.add_argument("--json", action="store_true", help="print the report as JSON")


CHECK = Command(
    "check", help="tell whether odtrain can train an ONNX model",
    description=("Check that every op of the model has a kernel and, where a trainable parameter depends on it, a "
                 "gradient rule; list the nodes that do not; count trainable and frozen parameters; then generate "
                 "and bind the artifacts in a temporary folder. Exit code 1 when the model cannot be trained."),
    arguments=_check_arguments, run=_check)


def _prepare_arguments(prepare) -> None:
    prepare.add_argument("model", metavar="MODEL.onnx", help="a forward-only ONNX model")
    prepare.add_argument("-o", "--output", required=True, metavar="ARTIFACT_DIR", help="the folder to write")
    _add_selection_options(prepare)
    prepare.add_argument("--freeze-batchnorm", action="store_true", help="BatchNormalization layers normalize with "
                         "their running mean and variance in training too, as in inference, and keep them fixed "
                         "(for small batches of personal data; their scale and bias still train)")
    prepare.add_argument("--optimizer", choices=_optimizer_commands(), default="adamw", help="default: adamw")
    prepare.add_argument("--lr", type=float, default=1e-3, help="learning rate that `odtrain train` uses unless "
                         "told otherwise (default: 0.001)")
    prepare.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    prepare.add_argument("--max-grad-norm", type=float, metavar="C", help="clip all gradients together to this L2 "
                         "norm before each optimizer step, as torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    prepare.add_argument("--qat", action="store_true", help="quantization-aware training: fake-quantize the weights "
                         "(int8, symmetric, per channel) and inputs (uint8, per tensor) of Conv, MatMul and Gemm; "
                         "the exported model is then a QDQ model with int8 weights")
    prepare.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R on the weights "
                         "of matrix products instead of the weights (frozen; export merges the adapters back); "
                         "--requires-grad names parameters to train besides them (e.g. norms)")
    prepare.add_argument("--lora-alpha", type=float, metavar="ALPHA", help="scale the adapters' update by "
                         "ALPHA/R (default: 2R)")
    prepare.add_argument("--lora-targets", nargs="+", metavar="NAME", help="the weights to adapt, by name or glob "
                         "pattern of the weight or of the node that reads it, e.g. '*q_proj*' (default: every "
                         "weight that feeds a MatMul or Gemm)")
    prepare.add_argument("--lora-seed", type=int, default=0, help="seed of the adapters' initial values (default: 0)")
    prepare.add_argument("--frozen-dtype", choices=FROZEN_DTYPES, default="float32",
                         help="store and hold the frozen weight matrices (of products, embeddings, convolutions) "
                         "in this type: int8 per output channel with float32 scales, int4 in blocks of 32 along "
                         "the input axis with float32 scales (matrices only), or bfloat16; training reads them a "
                         "block at a time (default: float32)")
    prepare.add_argument("--optimizer-state-dtype", choices=STATE_DTYPES, default="float32",
                         help="AdamW's moments in float32, or int8: quantized in blocks, a quarter of the bytes "
                         "(default: float32)")
    prepare.add_argument("--force", action="store_true", help="replace artifacts already in ARTIFACT_DIR")
    prepare.add_argument("--compile", action="store_true", help="also build the kernels the artifacts use into "
                         "ARTIFACT_DIR/kernels (`odtrain compile`): the device then trains without compiling")
    prepare.add_argument("--compile-batch-size", type=int, default=32, metavar="B",
                         help="the batch the kernels are recorded at with --compile (default: 32)")
    prepare.add_argument("--compile-target", default=None, metavar="ARCH",
                         help="with --compile: the device's architecture, as `odtrain compile --target` (aarch64 "
                         "for a Raspberry Pi)")
    prepare.add_argument("--compile-cpu", default=None, metavar="NAME",
                         help="with --compile: the device's CPU, as `odtrain compile --cpu`")
    add_shape_arguments(prepare, "compile-")
    prepare.add_argument("--json", action="store_true", help="print the result as JSON")


PREPARE = Command(
    "prepare", help="generate training artifacts from an ONNX model",
    description=("Write the training, eval and optimizer models and the checkpoint for MODEL.onnx "
                 "(odtrain.artifacts.generate_artifacts). Every floating-point parameter trains unless "
                 "--requires-grad, --freeze or --train-last choose fewer."),
    arguments=_prepare_arguments, run=_prepare)
