"""The `odtrain` command line (also `python -m odtrain`).

Commands, in the order of the workflow: check (can odtrain train this model?), prepare (the
artifacts), train (odtrain.training.fit), eval, export (the inference model), inspect, memory (what a
training step at a batch size holds, odtrain.memory), profile (where its time goes, odtrain.profile).

Exit code 0 on success; on a user error, one line on stderr and exit code 2; 1 when `check` finds
the model untrainable; 130 (SIGINT) or 143 (SIGTERM) when training stopped after saving; 141, silently,
when the reader of its output left (`| head`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .artifact_paths import ArtifactPaths, refuse_a_model
from .graph.errors import ArgumentError, ArtifactNotFoundError, OdtrainError, UnsupportedOpError
from .allocation import format_bytes
from .graph.frozen import FROZEN_DTYPES, frozen_bytes
from .graph.optimizers import STATE_DTYPES
from .graph.wording import count, name_list


def _demo(args) -> int:
    from .demo import run

    result = run(args.output, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
                 out=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported as one line on stderr (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _print_json(payload) -> None:
    print(json.dumps(payload, indent=2, default=str))


def _names(names: list[str], verbose: bool = False) -> str:
    """The names, comma-separated; a long list as its first and last few unless --verbose."""
    return name_list(names, verbose, "--verbose lists all")


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else "[?]"


def _value(graph, name: str) -> str:
    t = graph.value_types.get(name)
    return f"{name} {t.dtype.name}{_shape(t.shape)}" if t is not None else name


def _loss_type(name: str):
    from .artifacts import LossType

    return {"ce": LossType.CrossEntropyLoss, "mse": LossType.MSELoss, "bce": LossType.BCEWithLogitsLoss,
            "l1": LossType.L1Loss}[name]


# ---- check and prepare: which parameters train, and whether they can --------------------------------


def _loss_layout(graph, loss_inputs, args) -> tuple[int | None, int | None, str]:
    """(class_axis, ignore_index, what to tell the user) for --loss ce: the flags, else detected from the output."""
    from .graph.losses import detect_class_axis

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
    from .artifacts import choose_parameters

    loss_inputs = _loss_inputs(graph, args.loss_input)
    choice = choose_parameters(graph, loss_inputs, args.requires_grad, args.freeze, args.train_last,
                               lambda names: _names(names, args.verbose))
    class_axis, ignore_index, loss_text = _loss_layout(graph, loss_inputs, args)
    choices = {"requires_grad": choice.trainable, "frozen_params": choice.frozen, "loss": _loss_type(args.loss),
               "loss_input_names": loss_inputs, "class_axis": class_axis, "ignore_index": ignore_index,
               "left_out": choice.left_out, "loss_text": loss_text}
    if getattr(args, "qat", False):
        from .artifacts import QatConfig

        choices["qat"] = QatConfig()
    if getattr(args, "lora_rank", None):  # adapters train, with the parameters --requires-grad names
        from .artifacts import LoraConfig

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

    from . import artifacts
    from .api import CheckpointState, Module

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


def _print_left_out(left_out: dict, verbose: bool = False) -> None:
    """One line per reason, naming the initializers the default selection left out for it."""
    reasons: dict[str, list[str]] = {}
    for name, why in left_out.items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        print(f"  left out: {_names(names, verbose)}: {why}")


def _check(args) -> int:
    from collections import Counter

    from .artifacts import missing_support
    from .graph.onnx_io import load_graph
    from .graph.ops import OPS

    if args.ops:
        rows = sorted(OPS.values(), key=lambda o: (o.domain, o.op_type))
        if args.json:
            _print_json([{"op": o.op_type, "domain": o.domain, "gradient": o.gradient is not None,
                          "no_gradient_reason": o.no_grad_reason} for o in rows])
            return 0
        for o in rows:
            name = f"{o.domain}::{o.op_type}" if o.domain else o.op_type
            print(f"{name:<36} {'gradient rule' if o.gradient else 'no gradient: ' + (o.no_grad_reason or 'none')}")
        return 0
    if not args.model:
        raise ArgumentError("name a model to check (odtrain check MODEL.onnx), or list the supported ops with --ops")
    try:
        graph = load_graph(args.model, "model")
    except UnsupportedOpError as error:  # ops of a foreign domain: untrainable (1), as an op without a kernel is
        if args.json:
            _print_json({"model": args.model, "trainable": False, "error": str(error)})
        print(f"odtrain check: error: {error}", file=sys.stderr)
        return 1
    choices = _training_choices(graph, args)
    trainable, frozen, loss_inputs = choices["requires_grad"], choices["frozen_params"], choices["loss_input_names"]
    no_kernel, no_gradient = missing_support(graph, trainable, loss_inputs)
    arena, trial_error = (None, None)
    if not no_kernel and not no_gradient:
        arena, trial_error = _trial_bind(args.model, choices)
    sizes = {n: int(graph.initializers[n].size) for n in trainable + frozen}
    ok = not no_kernel and not no_gradient and trial_error is None
    report = {
        "model": args.model, "trainable": ok, "loss": args.loss,
        "inputs": [_value(graph, n) for n in graph.inputs], "outputs": [_value(graph, n) for n in graph.outputs],
        "ops": dict(Counter(node.op_type for node in graph.nodes)),
        "no_kernel": [{"node": n.name, "op_type": n.op_type, "domain": n.domain} for n in no_kernel],
        "no_gradient": [{"node": n.name, "op_type": n.op_type, "reason": r} for n, r in no_gradient],
        "parameters": {"trainable": sum(sizes[n] for n in trainable), "frozen": sum(sizes[n] for n in frozen),
                       "trainable_tensors": trainable, "frozen_tensors": frozen},
        "left_out": choices["left_out"], "loss_layout": choices["loss_text"], "error": trial_error,
        "arena_bytes_at_batch_2": arena,
    }
    if args.json:
        _print_json(report)
    else:
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
        frozen_text = f" in {count(len(frozen), 'tensor')} ({_names(frozen, args.verbose)})" if frozen else ""
        print(f"parameters: {p['trainable']:,} trainable in {count(len(trainable), 'tensor')} "
              f"({_names(trainable, args.verbose)}); {p['frozen']:,} frozen{frozen_text}")
        _print_left_out(choices["left_out"], args.verbose)
        if choices["loss_text"]:
            print(f"loss: {args.loss} on '{loss_inputs[0]}', {choices['loss_text']}")
        if trial_error:
            print(f"  generating and binding the artifacts failed: {trial_error}")
        elif ok:
            sequence = any(isinstance(d, str) for n in graph.inputs for d in (graph.value_types[n].shape or ())[1:])
            at = f"batch size 2, sequence length {TRIAL_SEQUENCE_LENGTH}" if sequence else "batch size 2"
            print(f"odtrain can train this model (loss {args.loss}; a training step at {at} plans {arena:,} bytes "
                  "of arena)")
    if ok:
        return 0
    problems = [f"{count(len(no_kernel), 'op')} without a kernel"] if no_kernel else []
    problems += [f"{count(len(no_gradient), 'op')} without a gradient rule"] if no_gradient else []
    problems += ["its artifacts cannot be generated or bound"] if trial_error else []
    advice = " (freeze the parameters before them, e.g. --train-last N)" if no_gradient and not no_kernel else ""
    print(f"odtrain check: error: '{args.model}' cannot be trained: {' and '.join(problems)}{advice}; "
          "details above", file=sys.stderr)
    return 1


def _prepare(args) -> int:
    from . import artifacts, checkpoint as checkpoint_file
    from .graph.onnx_io import load_graph

    graph = load_graph(args.model, "model")
    choices = _training_choices(graph, args)
    trainable, frozen, loss_inputs = choices["requires_grad"], choices["frozen_params"], choices["loss_input_names"]
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
    if args.optimizer == "sgd" and args.weight_decay:
        raise ArgumentError("--weight-decay applies to AdamW only")
    if args.optimizer == "sgd" and args.optimizer_state_dtype != "float32":
        raise ArgumentError("--optimizer-state-dtype applies to AdamW's moments only; SGD keeps no moments")
    optimizer = {"adamw": artifacts.AdamW(weight_decay=args.weight_decay, state_dtype=args.optimizer_state_dtype),
                 "sgd": artifacts.SGD()}[args.optimizer]
    # the model's outputs are what eval scores and export writes; a training step returns the loss alone
    predictions = [o for o in graph.outputs if o in loss_inputs] + [o for o in graph.outputs if o not in loss_inputs]
    qat = choices.get("qat")
    properties = {"learning_rate": float(args.lr), "loss": args.loss, "optimizer": args.optimizer}
    del graph  # its mapping of the model file: generate_artifacts maps the file again
    generated = artifacts.generate_artifacts(args.model, optimizer=optimizer, artifact_directory=args.output,
                                             eval_output_names=predictions, properties=properties,
                                             frozen_dtype=args.frozen_dtype, **_artifact_options(choices))
    trainable, frozen = generated.trainable, generated.frozen
    from .kernel_library import FOLDER

    stale = os.path.join(args.output, FOLDER)
    if os.path.isdir(stale):  # the library of the artifacts just replaced (--force): --compile builds it anew
        import shutil

        shutil.rmtree(stale)
        _note(args, f"removed {stale}/, the kernel library of the artifacts replaced"
              + ("" if args.compile else f"; `odtrain compile {args.output}` builds theirs"))
    paths = ArtifactPaths.find(args.output)
    stored = checkpoint_file.load(checkpoint).parameters  # views of the file: sizes without reading it
    sizes = {n: int(stored[n].size) for n in trainable + frozen}
    by_type = frozen_bytes({n: stored[n] for n in frozen})
    files = (paths.training_model, paths.eval_model, paths.optimizer_model, paths.checkpoint)
    result = {"artifacts": args.output, "files": [os.path.basename(p) for p in files],
              "trainable": trainable, "frozen": frozen, "trainable_values": sum(sizes[n] for n in trainable),
              "frozen_values": sum(sizes[n] for n in frozen), "frozen_bytes_by_type": by_type,
              "left_out": choices["left_out"], "loss": args.loss,
              "loss_layout": choices["loss_text"], "optimizer": args.optimizer, "learning_rate": args.lr,
              "qat": qat is not None}
    if args.compile:
        from .cache import input_shapes
        from .kernel_build import compile_artifacts

        manifest = compile_artifacts(args.output, batch_size=args.compile_batch_size,
                                     out=(lambda line: None) if args.json else print, target=args.compile_target,
                                     cpu=args.compile_cpu, sequence_length=args.compile_seq_len,
                                     input_shapes=input_shapes(args.compile_input_shape, "--compile-input-shape"))
        result["kernels"] = len(manifest["entries"])
    if args.json:
        _print_json(result)
        return 0
    from .training import Session

    inputs = Session(args.output, with_optimizer=False).inputs
    print(f"artifacts written to {args.output}/: {', '.join(result['files'])}")
    lora = choices.get("lora")
    if lora:
        from .lora import is_adapter

        adapted = [n.rsplit(".lora_", 1)[0] for n in trainable if n.endswith(".lora_A")]
        others = [n for n in trainable if not is_adapter(n)]
        print(f"trainable: {result['trainable_values']:,} values: LoRA adapters of rank {lora.rank} (alpha "
              f"{lora.alpha:g}) on {count(len(adapted), 'weight')} ({_names(adapted, args.verbose)})"
              + (f", and {_names(others, args.verbose)}" if others else ""))
    else:
        print(f"trainable: {result['trainable_values']:,} values in {count(len(trainable), 'tensor')} "
              f"({_names(trainable, args.verbose)})")
    held = "" if set(by_type) <= {"float32"} else \
        ", held as " + ", ".join(f"{dtype} {format_bytes(n)}" for dtype, n in by_type.items())
    print(f"frozen: {result['frozen_values']:,} values in {count(len(frozen), 'tensor')}{held} "
          f"({_names(frozen, args.verbose)})" if frozen else "frozen: none")
    _print_left_out(choices["left_out"], args.verbose)
    layout = f", {choices['loss_text']}" if choices["loss_text"] else ""
    print(f"loss: {args.loss} on '{loss_inputs[0]}'{layout}; optimizer: {args.optimizer}, learning rate {args.lr:g}")
    if qat is not None:
        print(f"quantization-aware training: {qat.weight_dtype} weights per {'channel' if qat.per_channel else 'tensor'}, "
              f"{qat.activation_dtype} activations per tensor; `odtrain export` writes a QDQ model")
    print(f"training data feeds: {', '.join(s.describe() for s in inputs)}")
    return 0


# ---- train, eval, export, inspect ------------------------------------------------------------------------


def _add_threads_option(parser) -> None:
    parser.add_argument("--threads", type=int, metavar="N", help="threads of each step, kernels and BLAS together "
                        "(default: ODTRAIN_NUM_THREADS, else every core this process may run on)")


def _byte_size(text: str) -> int:
    """'40MB', '1.5GiB', '500000' -> bytes (decimal and binary units)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip()
    split = len(number.rstrip("KMGIB"))
    try:
        value = float(number[:split]) * units[number[split:]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: use bytes or a unit such as 40MB or 1.5GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got '{text}'")
    return int(value)


def _budget(text: str):
    """--memory-budget: a size, or "auto" (odtrain.allocation.auto_budget)."""
    return "auto" if text.strip().lower() == "auto" else _byte_size(text)


def _data(args, paths):
    """The data a command reads: its paths, or windows of a text file with --tokenizer and --seq-len."""
    if paths is None:
        return None
    texts = [p for p in paths if str(p).endswith(".txt")]
    audio = _audio_source(args, paths)
    if audio is not None:
        return audio
    if len(paths) == 1 and os.path.isdir(paths[0]):
        from .data import ImageFolder

        return ImageFolder(paths[0], args.skip_unreadable, report=lambda line: _note(args, line))
    if args.skip_unreadable:
        raise ArgumentError("--skip-unreadable leaves out unreadable images of a folder (or clips): give --data "
                            "FOLDER, with one sub-folder of images or .wav clips per class")
    if args.tokenizer is None:
        if args.encoding != "utf-8":
            raise ArgumentError("--encoding reads a text file: give --tokenizer and a .txt file too")
        if texts:
            raise ArgumentError(f"'{texts[0]}' is text: give the tokenizer that encodes it with --tokenizer "
                                "tokenizer.json, and --seq-len N")
        if args.seq_len is not None:
            raise ArgumentError("--seq-len cuts a text file into windows: give --tokenizer and a .txt file too")
        return paths
    if len(paths) != 1 or args.seq_len is None:
        raise ArgumentError("with --tokenizer give one text file (--data corpus.txt) and the window length "
                            "(--seq-len N)")
    from .text import TextSource

    return TextSource(paths[0], args.tokenizer, args.seq_len, args.encoding)


def _note(args, line: str) -> None:
    print(f"odtrain {args.command}: note: {line}", file=sys.stderr)


def _audio_source(args, paths):
    """An AudioSource when the one path is a folder of clips or audio options were given, else None."""
    from .audio import AudioSource, LogMel, is_audio_folder

    features = getattr(args, "audio_features", None)
    folder = len(paths) == 1 and os.path.isdir(paths[0]) and is_audio_folder(paths[0])
    if not folder:
        if features is not None:
            raise ArgumentError("--audio-features reads a folder of clips: give --data clips/, with one sub-folder "
                                "of .wav files per class")
        return None
    settings = None
    if features == "log-mel":
        settings = LogMel(args.sample_rate, args.n_mels, args.win_ms, args.hop_ms, args.n_fft)
        settings.check()
    return AudioSource(paths[0], settings, args.sample_rate, args.skip_unreadable,
                       report=lambda line: _note(args, line))


def _train(args) -> int:
    from .api import CheckpointState
    from .training import fit

    paths = ArtifactPaths.find(args.artifacts)
    properties = CheckpointState.load_checkpoint(paths.checkpoint).properties
    if not args.resume and properties.get("finished") == 0:
        _note(args, f"'{paths.checkpoint}' holds an unfinished run (epoch {properties['epoch'] + 1}, step "
              f"{properties['step_in_epoch']}); this run starts anew from its parameters (--resume continues it)")
    result = fit(args.artifacts, _data(args, args.data), val=_data(args, args.val), epochs=args.epochs,
                 batch_size=args.batch_size,
                 learning_rate=args.lr, lr_schedule=args.lr_schedule, warmup_steps=args.warmup, seed=args.seed,
                 checkpoint_every=args.checkpoint_every, resume=args.resume, x=args.x, y=args.y,
                 log=None if args.json else print, progress=not args.json, stop_after_steps=args.stop_after_steps,
                 memory_budget=args.memory_budget)
    if args.json:
        _print_json(result.to_dict())
    elif result.finished and not result.history:
        print(f"the run already finished its {count(result.epochs, 'epoch')}; nothing to do (give a larger --epochs "
              "with --resume to train further)")
    elif not result.stopped_by:
        print(f"checkpoint: {result.checkpoint} ({count(result.epochs, 'epoch')}, {count(result.global_step, 'step')})")
    if result.stopped_by:
        print(f"odtrain train: stopped by {result.stopped_by} at epoch {result.epochs + 1}, step "
              f"{result.step_in_epoch}; saved {result.checkpoint}; add --resume to continue", file=sys.stderr)
        return 143 if result.stopped_by == "SIGTERM" else 130
    return 0


def _eval(args) -> int:
    from .training import evaluate

    metrics = evaluate(args.artifacts, _data(args, args.data), batch_size=args.batch_size, x=args.x, y=args.y)
    if args.json:
        _print_json(metrics)
        return 0
    parts = [f"loss {metrics['loss']:.4f}"]
    if "perplexity" in metrics:
        parts.append(f"perplexity {metrics['perplexity']:.4g}")
    if "accuracy" in metrics:
        parts.append(f"accuracy {metrics['accuracy']:.1%}")
    if "mse" in metrics:
        parts += [f"MSE {metrics['mse']:.4g}", f"MAE {metrics['mae']:.4g}"]
    labelled = f" ({count(metrics['labels'], 'label')} counted)" if metrics.get("labels", metrics["samples"]) != metrics["samples"] else ""
    print(f"{', '.join(parts)} on {count(metrics['samples'], 'sample')}{labelled}")
    return 0


def _export(args) -> int:
    from .graph.onnx_io import load_graph
    from .training import Session

    session = Session(args.artifacts, with_optimizer=False)
    if args.adapters_only:
        return _export_adapters(session, args)
    outputs = args.outputs or session.prediction_outputs
    if not outputs:
        raise ArgumentError(f"the eval model of '{args.artifacts}' computes only the loss; name the values to "
                            "export with --outputs NAME")
    session.module.export_model_for_inferencing(args.output, outputs, frozen_dtype=args.frozen_dtype)
    graph = load_graph(args.output, "inference model")
    result = {"model": args.output, "inputs": [_value(graph, n) for n in graph.inputs],
              "outputs": [_value(graph, n) for n in graph.outputs]}
    if args.json:
        _print_json(result)
    else:
        print(f"inference model written to {args.output}: {', '.join(result['inputs'])} -> "
              f"{', '.join(result['outputs'])}")
    return 0


def _export_adapters(session, args) -> int:
    """The trained parameters of LoRA artifacts (adapters, and what trained besides them) as a safetensors file."""
    from .lora import is_adapter, write_adapters

    state = session.state
    trained = [n for n, p in state.parameters.items() if p.requires_grad]
    if not any(is_adapter(n) for n in trained):
        raise ArgumentError(f"'{args.artifacts}' has no LoRA adapters; prepare the model with --lora-rank R, or "
                            "export the whole model without --adapters-only")
    scales = write_adapters(args.output, {n: state.parameters[n].data for n in trained},
                            session.module.graph(training=False))
    nbytes = sum(state.parameters[n].data.nbytes for n in trained)
    result = {"adapters": args.output, "tensors": trained, "bytes": nbytes, "scales": scales}
    if args.json:
        _print_json(result)
    else:
        print(f"adapters written to {args.output}: {count(len(trained), 'tensor')}, {count(nbytes, 'byte')} of parameters "
              f"({len(scales)} adapted weights)")
    return 0


def _inspect(args) -> int:
    from . import checkpoint as checkpoint_file
    from .training import Session

    target = args.target
    if target.endswith(".onnx"):
        refuse_a_model(target)
    if os.path.isdir(target):
        paths = ArtifactPaths.of(target)
    elif os.path.isfile(target):
        paths = ArtifactPaths.of(os.path.dirname(target) or ".", checkpoint=target)
    else:
        raise ArtifactNotFoundError(f"'{target}' is neither an artifact folder nor a checkpoint file")
    folder, checkpoint = paths.directory, paths.checkpoint
    contents = checkpoint_file.load(checkpoint)
    parameters = [{"name": n, "shape": list(a.shape), "dtype": a.dtype.name, "trainable": n in contents.trainable}
                  for n, a in contents.parameters.items()]
    optimizer = dict(contents.optimizer or {})
    if contents.optimizer is not None:
        optimizer["state"] = sorted(contents.optimizer_tensors)
    report = {"checkpoint": checkpoint, "nominal": contents.nominal, "parameters": parameters,
              "properties": contents.properties, "optimizer": optimizer or None, "memory_plan": None}
    plans = {}
    if not paths.missing("training_model", "eval_model"):
        module = Session(folder, checkpoint=checkpoint, with_optimizer=False).module
        try:
            plans = {"training step": module.bind_at(args.batch_size, True, args.seq_len).plan,
                     "eval step": module.bind_at(args.batch_size, False, args.seq_len).plan}
            report["memory_plan"] = {"batch_size": args.batch_size, **{
                name: {"arena_bytes": p.arena_bytes, "lower_bound": p.lower_bound, "ops": p.steps}
                for name, p in plans.items()}}
        except ArgumentError as error:
            report["memory_plan"] = {"skipped": str(error)}
    if args.json:
        _print_json(report)
        return 0
    import numpy as np

    values = {True: 0, False: 0}
    for p in parameters:
        values[p["trainable"]] += int(np.prod(p["shape"], dtype=np.int64))
    print(f"checkpoint: {checkpoint}" + (" (nominal: shapes only)" if contents.nominal else ""))
    print(f"parameters: {count(len(parameters), 'tensor')}; {count(values[True], 'trainable value')}, {values[False]:,} frozen")
    width = max(len(p["name"]) for p in parameters) if parameters else 0
    for p in parameters:
        print(f"  {p['name']:<{width}}  {p['dtype']:<8} {_shape(p['shape']):<16} "
              f"{'trainable' if p['trainable'] else 'frozen'}")
    print("properties:" + ("" if contents.properties else " (none)"))
    width = max((len(k) for k in contents.properties), default=0)
    for key, value in contents.properties.items():
        print(f"  {key:<{width}}  {value:.6g}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    if optimizer:
        print(f"optimizer: {optimizer['kind']}, step {optimizer['step']}, learning rate "
              f"{optimizer['learning_rate']:.6g}; state: {', '.join(optimizer['state']) or '(none)'}")
    else:
        print("optimizer: no state saved yet")
    plan_info = report["memory_plan"]
    if plan_info is None:
        print("memory plan: no training and eval models beside the checkpoint")
    elif "skipped" in plan_info:
        print(f"memory plan: skipped ({plan_info['skipped']})")
    else:
        print(f"memory plan at batch size {args.batch_size}:")
        for name, p in plans.items():
            print(f"  {name + ':':<15} arena {p.arena_bytes:,} B, lower bound {p.lower_bound:,} B "
                  f"({p.arena_bytes / max(p.lower_bound, 1):.2f}x), {count(p.steps, 'op')}")
            if args.plan:
                print("    " + p.render().replace("\n", "\n    "))
    return 0


def _memory(args) -> int:
    from . import memory

    if args.batch_size < 1:
        raise ArgumentError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.plot:
        from .memory_plot import require_matplotlib

        require_matplotlib()  # before the plans are bound
    result = memory.from_artifacts(args.artifacts, args.batch_size, args.budget, args.seq_len)
    budget = (f"memory budget {memory.format_bytes(args.budget)} ({args.budget:,} B)" if args.budget
              else "no memory budget")
    if args.plot:
        from .memory_plot import plot_timeline

        folder = os.path.basename(os.path.normpath(args.artifacts))
        plot_timeline(result, args.plot, f"{folder}: training step at batch size {args.batch_size}, {budget}")
    if args.json:
        _print_json({"artifacts": args.artifacts, "batch_size": args.batch_size, "budget_bytes": args.budget,
                     **result.to_dict(), "plot": args.plot})
        return 0
    sequence = f", sequence length {args.seq_len}" if args.seq_len else ""
    print(f"memory of {args.artifacts} at batch size {args.batch_size}{sequence}, {budget}")
    print(result.render())
    if args.plot:
        print(f"timeline of the training step written to {args.plot}")
    return 0


def _profile(args) -> int:
    from .profile import profile_artifacts

    report = profile_artifacts(args.artifacts, args.batch_size, steps=args.steps, threads=args.threads,
                               clock=args.clock, sequence_length=args.seq_len)
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report.render(top=args.top))
    return 0


def _add_data_options(command, what: str) -> None:
    command.add_argument("--data", action="append", required=True, metavar="PATH",
                         help=f"{what}: an .npz file, a folder of images (one sub-folder per class), .npy "
                         "files, one per model input in input order (--data x.npy --data y.npy), or a text file "
                         "for a language model (with --tokenizer and --seq-len)")
    command.add_argument("--x", action="append", metavar="NAME", help="the .npz array feeding the model's data "
                         "input, once per data input (default: the array named like the input, or x, images, inputs)")
    command.add_argument("--y", metavar="NAME", help="the .npz array of labels or targets "
                         "(default: 'labels'/'target', or y)")
    command.add_argument("--tokenizer", metavar="TOKENIZER.json", help="for a language model: encode the text file "
                         "given to --data with this tokenizers file (pip install tokenizers)")
    command.add_argument("--seq-len", type=int, metavar="N", help="with --tokenizer: windows of N tokens, each "
                         "token's label the next one")
    command.add_argument("--encoding", default="utf-8", help="with --tokenizer: the text file's encoding, e.g. "
                         "latin-1, cp1252, utf-16 (default: utf-8)")
    command.add_argument("--skip-unreadable", action="store_true", help="with a folder of images or clips: leave "
                         "out the files that cannot be read (corrupt, empty, truncated, too short, another "
                         "encoding) and say how many (default: stop at the first)")
    audio = command.add_argument_group("audio clips (--data clips/, one sub-folder of .wav files per class)")
    audio.add_argument("--audio-features", choices=("log-mel",), help="compute features for a model whose input is "
                       "log-mel [batch, n_mels, frames] (default: feed the waveform [batch, samples])")
    audio.add_argument("--sample-rate", type=int, default=16000, metavar="HZ",
                       help="the model's sample rate; clips are resampled to it (default 16000)")
    audio.add_argument("--n-mels", type=int, default=40, metavar="N", help="mel bands (default 40)")
    audio.add_argument("--win-ms", type=float, default=25.0, metavar="MS", help="analysis window (default 25 ms)")
    audio.add_argument("--hop-ms", type=float, default=10.0, metavar="MS", help="hop between frames (default 10 ms)")
    audio.add_argument("--n-fft", type=int, default=512, metavar="N", help="DFT size (default 512)")


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
    command.add_argument("-v", "--verbose", action="store_true", help="list every parameter name (a long list "
                         "shows its first and last few)")


def _add_training_commands(commands) -> None:
    check = commands.add_parser(
        "check", help="tell whether odtrain can train an ONNX model",
        description="Check that every op of the model has a kernel and, where a trainable parameter depends on "
        "it, a gradient rule; list the nodes that do not; count trainable and frozen parameters; then generate "
        "and bind the artifacts in a temporary folder. Exit code 1 when the model cannot be trained.")
    check.add_argument("model", nargs="?", metavar="MODEL.onnx", help="a forward-only ONNX model")
    _add_selection_options(check)
    check.add_argument("--ops", action="store_true", help="list the ops odtrain supports, with their gradients")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(handler=_check)

    prepare = commands.add_parser(
        "prepare", help="generate training artifacts from an ONNX model",
        description="Write the training, eval and optimizer models and the checkpoint for MODEL.onnx "
        "(odtrain.artifacts.generate_artifacts). Every floating-point parameter trains unless "
        "--requires-grad, --freeze or --train-last choose fewer.")
    prepare.add_argument("model", metavar="MODEL.onnx", help="a forward-only ONNX model")
    prepare.add_argument("-o", "--output", required=True, metavar="ARTIFACT_DIR", help="the folder to write")
    _add_selection_options(prepare)
    prepare.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="default: adamw")
    prepare.add_argument("--lr", type=float, default=1e-3, help="learning rate that `odtrain train` uses unless "
                         "told otherwise (default: 0.001)")
    prepare.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
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
    from .cache import add_shape_arguments

    add_shape_arguments(prepare, "compile-")
    prepare.add_argument("--json", action="store_true", help="print the result as JSON")
    prepare.set_defaults(handler=_prepare)

    train = commands.add_parser(
        "train", help="train prepared artifacts on data",
        description="Train in shuffled batches, validate after each epoch, and save the checkpoint "
        "(ARTIFACT_DIR/checkpoint, with optimizer state) every --checkpoint-every steps and at each epoch's end. "
        "Ctrl-C stops after the current step and saves; --resume continues exactly where the run stopped.")
    train.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    _add_data_options(train, "training data")
    train.add_argument("--val", action="append", metavar="PATH", help="validation data, in the same forms as --data")
    train.add_argument("--epochs", type=int, help="number of epochs (default: 1, or the resumed run's)")
    train.add_argument("--batch-size", type=int, help="samples per step (default: 32)")
    train.add_argument("--lr", type=float, help="learning rate (default: the checkpoint's, from `odtrain prepare` "
                       "or the last run)")
    train.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"),
                       help="learning-rate decay after the warm-up (default: constant)")
    train.add_argument("--warmup", type=int, metavar="STEPS", help="steps of linear learning-rate warm-up "
                       "(default: 0)")
    train.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="also save every STEPS steps "
                       "(default: at each epoch's end only)")
    train.add_argument("--resume", action="store_true", help="continue the run stored in the checkpoint")
    train.add_argument("--seed", type=int, help="seed of the batch order and of Dropout's masks (default: 0)")
    train.add_argument("--memory-budget", type=_budget, metavar="BYTES",
                       help="cap each training step's arena (e.g. 40MB), recomputing activations in the backward "
                       "pass; fails before training, naming the smallest budget that works, if none fits; "
                       "'auto': what the machine has available (MemAvailable) less the mapped frozen weights "
                       "and a reserve of an eighth")
    _add_threads_option(train)
    train.add_argument("--json", action="store_true", help="print the result as JSON instead of progress")
    train.add_argument("--stop-after-steps", type=int, help=argparse.SUPPRESS)
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser(
        "eval", help="score trained artifacts on data",
        description="Run the eval model over the data: the mean loss, and accuracy for classifiers "
        "(cross-entropy, binary cross-entropy) or MSE and MAE for regression.")
    evaluate.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    _add_data_options(evaluate, "test data")
    evaluate.add_argument("--batch-size", type=int, default=256, help="samples per step (default: 256)")
    _add_threads_option(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    evaluate.set_defaults(handler=_eval)

    export = commands.add_parser(
        "export", help="write the trained inference model",
        description="Write an ONNX inference model with the checkpoint's parameters embedded "
        "(Module.export_model_for_inferencing); any ONNX runtime runs it.")
    export.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.onnx", help="the file to write")
    export.add_argument("--outputs", nargs="+", metavar="NAME", help="values to output (default: the model's outputs)")
    export.add_argument("--frozen-dtype", choices=FROZEN_DTYPES, help="write frozen weights stored as int8, int4 "
                        "or bfloat16 (prepare --frozen-dtype) in this type: int8 read by DequantizeLinear (a QDQ "
                        "model), int4 by DequantizeLinear with block_size (opset 21), bfloat16 by Cast, LoRA "
                        "adapters beside them; default float32, adapters merged")
    export.add_argument("--adapters-only", action="store_true", help="write only the trained LoRA adapters (and "
                        "the parameters trained with them) as a safetensors file to -o, not the merged model")
    export.add_argument("--json", action="store_true", help="print the result as JSON")
    export.set_defaults(handler=_export)

    inspect = commands.add_parser(
        "inspect", help="show a checkpoint's parameters, properties, optimizer state and memory plan",
        description="Show the parameters (name, dtype, shape, trainable), the property bag, the optimizer "
        "state and, for an artifact folder, the memory plan of a training and an eval step at --batch-size.")
    inspect.add_argument("target", metavar="ARTIFACT_DIR|CHECKPOINT", help="an artifact folder or a checkpoint file")
    inspect.add_argument("--batch-size", type=int, default=32, help="batch size of the memory plan (default: 32)")
    inspect.add_argument("--seq-len", type=int, metavar="N", help="length of the inputs' other symbolic axes "
                         "(a language model's sequence) in the memory plan")
    inspect.add_argument("--plan", action="store_true", help="also print each plan's timeline")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_inspect)

    memory = commands.add_parser(
        "memory", help="predict the memory of a training step at a batch size",
        description="Bind the training step (and the eval step) at --batch-size without running it and report "
        "its memory: parameters, gradient buffer, optimizer state, the arena against its lower bound and "
        "against no reuse, folded constants, recomputed nodes, and the predicted peak. The Python/Numba "
        "runtime floor is not included.")
    memory.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    memory.add_argument("--batch-size", type=int, required=True, help="samples per step")
    memory.add_argument("--seq-len", type=int, metavar="N", help="length of the inputs' other symbolic axes "
                        "(a language model's sequence)")
    memory.add_argument("--budget", type=_byte_size, metavar="BYTES", help="plan the training step under this "
                        "arena budget (e.g. 40MB), recomputing activations as `train --memory-budget` does")
    memory.add_argument("--json", action="store_true", help="print the report as JSON (sizes in bytes)")
    memory.add_argument("--plot", metavar="FILE.png", help="also draw the training step's live bytes per step, "
                        'by category (needs matplotlib: pip install matplotlib)')
    memory.set_defaults(handler=_memory)

    profile = commands.add_parser(
        "profile", help="show where a training step's time goes",
        description="Run the training step at --batch-size with a clock around each kernel call and report "
        "the time per node and per op type, for the forward pass, the backward pass and the optimizer; the "
        "matrix products' time and GF/s against this machine's float32 GEMM peak (measured here, at 1 thread "
        "and at the step's and the machine's thread counts). The parameters train during the run; the "
        "checkpoint file is not written.")
    profile.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    profile.add_argument("--batch-size", type=int, required=True, help="samples per step")
    profile.add_argument("--seq-len", type=int, metavar="N", help="length of the inputs' other symbolic axes "
                         "(a language model's sequence)")
    profile.add_argument("--steps", type=int, default=10, help="profiled steps, after 2 warm-up steps (default: 10)")
    profile.add_argument("--threads", type=int, help="threads for the run (default: odtrain's setting)")
    profile.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time (default), or the "
                         "process's CPU time, all threads summed: steadier on a busy machine, blind to parallel speed-up")
    profile.add_argument("--top", type=int, default=15, help="nodes listed, the slowest first (default: 15)")
    profile.add_argument("--json", action="store_true", help="print every node and op type as JSON (times in ms)")
    profile.set_defaults(handler=_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="odtrain", description="Train ONNX models on the device that holds the data.")
    parser.add_argument("--version", action="version", version=f"odtrain {__import__('odtrain').__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_training_commands(commands)
    demo = commands.add_parser("demo", help="train a small classifier on the bundled 8x8 digits, end to end",
                               description="Generate artifacts for a built-in classifier, train it on the 8x8 "
                               "handwritten digits shipped with odtrain, print held-out accuracy and peak memory, "
                               "and write an inference model.")
    demo.add_argument("-o", "--output", default="odtrain-demo", help="artifact folder (default: ./odtrain-demo)")
    demo.add_argument("--epochs", type=int, default=15, help="passes over the training digits (default: 15)")
    demo.add_argument("--batch-size", type=int, default=32, help="samples per step (default: 32)")
    demo.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 0.01)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the held-out split and the "
                      "batch order (default: 0)")
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object")
    demo.set_defaults(handler=_demo)
    from .cache import add_command as add_warmup_command

    add_warmup_command(commands)
    from .kernel_build import add_command as add_compile_command

    add_compile_command(commands)
    from .federated import add_command as add_federated_command

    add_federated_command(commands)
    return parser


# odtrain's dependencies a device may leave out (it trains through a kernel library with numpy alone): a command
# that needs one of them says so in one line, exit 2
DESKTOP_MODULES = {"numba": "numba", "llvmlite": "llvmlite", "scipy": "scipy", "onnx": "onnx"}


def needs_desktop(command: str, module: str) -> str:
    """The line of a command that needs `module`, which this device does not have installed."""
    return (f"`odtrain {command}` needs {DESKTOP_MODULES[module]}, which is not installed here (a device with numpy "
            f"and odtrain only trains through a kernel library): run it where odtrain's dependencies are installed "
            f"(`pip install odtrain`, or `pip install {DESKTOP_MODULES[module]}` here)")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    from .threads import available_cores, process_default

    threads, cores = getattr(args, "threads", None), available_cores()
    if isinstance(threads, int) and threads > cores:
        _note(args, f"--threads {threads} with {count(cores, 'core')} for this process: each step is split into "
              f"{threads} parts, as on {threads} cores (the same results), and they run on the {count(cores, 'core')}: "
              f"no faster than --threads {cores}")
    try:
        with process_default(threads):
            code = args.handler(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:  # stdout's reader left (`odtrain inspect DIR --json | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a writer the closed pipe stopped
    except OdtrainError as error:
        message = str(error).replace("\n", " ")
        print(f"odtrain {args.command}: error: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in DESKTOP_MODULES:
            raise
        print(f"odtrain {args.command}: error: {needs_desktop(args.command, error.name.split('.')[0])}",
              file=sys.stderr)
        return 2
    except OSError as error:  # a file the command writes or reads, outside odtrain's own checks
        print(f"odtrain {args.command}: error: {error.strerror or error}"
              + (f": '{error.filename}'" if error.filename else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"odtrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
