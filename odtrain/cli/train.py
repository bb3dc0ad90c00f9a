"""`odtrain train` (odtrain.training.fit), `odtrain eval` and `odtrain export` (the inference model).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..artifact_paths import ArtifactPaths
from ..graph.errors import ArgumentError
from ..graph.frozen import FROZEN_DTYPES
from ..graph.wording import count
from ..images import record_beside
from .image_options import add_image_options, image_folder, refuse_without_photos
from .options import (Command, add_audio_options, add_threads_option, audio_features, budget_size, note, print_json,
                      value_text)


def _data(args, paths, record_to=None):
    """The data a command reads: its paths, or windows of a text file with --tokenizer and --seq-len; a folder of
    photos records its preprocessing and classes in `record_to` (an artifact folder) once read."""
    if paths is None:
        return None
    texts = [p for p in paths if str(p).endswith(".txt")]
    audio = _audio_source(args, paths)
    if audio is not None:
        refuse_without_photos(args)
        return audio
    if len(paths) == 1 and os.path.isdir(paths[0]):
        return image_folder(args, paths[0], record_to)
    refuse_without_photos(args)
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
    from ..text import TextSource

    return TextSource(paths[0], args.tokenizer, args.seq_len, args.encoding)


def _audio_source(args, paths):
    """An AudioSource when the one path is a folder of clips or audio options were given, else None."""
    from ..audio import AudioSource, is_audio_folder

    features = getattr(args, "audio_features", None)
    folder = len(paths) == 1 and os.path.isdir(paths[0]) and is_audio_folder(paths[0])
    if not folder:
        if features is not None:
            raise ArgumentError("--audio-features reads a folder of clips: give --data clips/, with one sub-folder "
                                "of .wav files per class")
        return None
    return AudioSource(paths[0], audio_features(args), args.sample_rate, args.skip_unreadable,
                       report=lambda line: note(args, line))


def _train(args) -> int:
    from ..api import CheckpointState
    from ..training import fit

    paths = ArtifactPaths.find(args.artifacts)
    properties = CheckpointState.load_checkpoint(paths.checkpoint).properties
    if not args.resume and properties.get("finished") == 0:
        note(args, f"'{paths.checkpoint}' holds an unfinished run (epoch {properties['epoch'] + 1}, step "
              f"{properties['step_in_epoch']}); this run starts anew from its parameters (--resume continues it)")
    result = fit(args.artifacts, _data(args, args.data, record_to=args.artifacts), val=_validation_data(args),
                 epochs=args.epochs, batch_size=args.batch_size, keep_best=args.keep_best, best_metric=args.best_metric,
                 early_stop=args.early_stop, plot=args.plot,
                 replay=_data(args, [args.replay]) if args.replay else None, replay_share=args.replay_share,
                 learning_rate=args.lr, lr_schedule=args.lr_schedule, warmup_steps=args.warmup, seed=args.seed,
                 checkpoint_every=args.checkpoint_every, resume=args.resume, x=args.x, y=args.y,
                 log=None if args.json else print, progress=not args.json, stop_after_steps=args.stop_after_steps,
                 memory_budget=args.memory_budget)
    if args.json:
        print_json(result.to_dict())
    elif result.finished and not result.history:
        print(f"the run already finished its {count(result.epochs, 'epoch')}; nothing to do (give a larger --epochs "
              "with --resume to train further)")
    elif result.stopped_by in (None, "early_stop"):
        print(f"checkpoint: {result.checkpoint} ({count(result.epochs, 'epoch')}, {count(result.global_step, 'step')})")
        _print_best(result)
        if args.plot:
            print(f"curves: {args.plot} (loss and accuracy per epoch)")
    if result.stopped_by and result.stopped_by != "early_stop":
        print(f"odtrain train: stopped by {result.stopped_by} at epoch {result.epochs + 1}, step "
              f"{result.step_in_epoch}; saved {result.checkpoint}; add --resume to continue", file=sys.stderr)
        return 143 if result.stopped_by == "SIGTERM" else 130
    return 0


def _validation_data(args):
    """--val once or more: each path its own set, scored and reported by its name every epoch; .npy files
    together are one set (one file per model input)."""
    if args.val is None:
        return None
    if all(str(p).endswith(".npy") for p in args.val):
        return _data(args, args.val)
    return [_data(args, [p]) for p in args.val]


def _refuse_a_missing_checkpoint(path) -> None:
    """--checkpoint names a file that must exist; the best one exists once a run with --keep-best has judged."""
    if path is not None and not os.path.isfile(path):
        raise ArgumentError(f"checkpoint '{path}' does not exist; `odtrain train --keep-best --val PATH` writes the "
                            "best epoch's as ARTIFACT_DIR/checkpoint.best")


def _print_best(result) -> None:
    """The best epoch and where its checkpoint is, when the run judged one (--keep-best, --early-stop)."""
    best = result.best
    if not best or best["epoch"] is None:
        return
    kept = f"; kept in {best['checkpoint']}" if best["checkpoint"] else ""
    print(f"best: epoch {best['epoch']}, {best['metric'].replace('_', ' ')} {best['value']:.4g}{kept}")


def _eval(args) -> int:
    import math

    from ..training import evaluate

    _refuse_a_missing_checkpoint(args.checkpoint)
    metrics = evaluate(args.artifacts, _data(args, args.data), batch_size=args.batch_size, x=args.x, y=args.y,
                       checkpoint=args.checkpoint)
    finite = math.isfinite(metrics["loss"])
    if not finite:  # a NaN or infinite loss is a failure, whatever the accuracy says
        print(f"odtrain eval: error: the loss on {', '.join(map(str, args.data))} is {metrics['loss']}, not a score: the "
              "data hold no NaN or infinity, so the model's parameters or its computation give them (a diverged "
              "run? train again from an earlier checkpoint with a lower learning rate)", file=sys.stderr)
    if args.json:
        print_json(metrics)
        return 0 if finite else 2
    parts = [f"loss {metrics['loss']:.4f}"]
    if "perplexity" in metrics:
        parts.append(f"perplexity {metrics['perplexity']:.4g}")
    if "accuracy" in metrics:
        parts.append(f"accuracy {metrics['accuracy']:.1%}")
    if "mse" in metrics:
        parts += [f"MSE {metrics['mse']:.4g}", f"MAE {metrics['mae']:.4g}"]
    labelled = f" ({count(metrics['labels'], 'label')} counted)" if metrics.get("labels", metrics["samples"]) != metrics["samples"] else ""
    print(f"{', '.join(parts)} on {count(metrics['samples'], 'sample')}{labelled}")
    return 0 if finite else 2


def _export(args) -> int:
    from ..graph.onnx_io import load_graph
    from ..training import Session

    _refuse_a_missing_checkpoint(args.checkpoint)
    session = Session(args.artifacts, args.checkpoint, with_optimizer=False)
    if args.adapters_only:
        return _export_adapters(session, args)
    outputs = args.outputs or session.prediction_outputs
    if not outputs:
        raise ArgumentError(f"the eval model of '{args.artifacts}' computes only the loss; name the values to "
                            "export with --outputs NAME")
    session.module.export_model_for_inferencing(args.output, outputs, frozen_dtype=args.frozen_dtype)
    graph = load_graph(args.output, "inference model")
    result = {"model": args.output, "inputs": [value_text(graph, n) for n in graph.inputs],
              "outputs": [value_text(graph, n) for n in graph.outputs]}
    beside = record_beside(args.artifacts, args.output)  # what an app must do to a photo before the model
    if beside is not None:
        result["preprocessing"] = beside[0]
    if args.json:
        print_json(result)
    else:
        print(f"inference model written to {args.output}: {', '.join(result['inputs'])} -> "
              f"{', '.join(result['outputs'])}")
        if beside is not None:
            print(f"its inputs' preprocessing written to {beside[0]}: {beside[1]}")
    return 0


def _export_adapters(session, args) -> int:
    """The trained parameters of LoRA artifacts (adapters, and what trained besides them) as a safetensors file."""
    from ..lora import is_adapter, write_adapters

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
        print_json(result)
    else:
        print(f"adapters written to {args.output}: {count(len(trained), 'tensor')}, {count(nbytes, 'byte')} of parameters "
              f"({len(scales)} adapted weights)")
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
    add_image_options(command)
    add_audio_options(command, "audio clips (--data clips/, one sub-folder of .wav files per class)")


def _train_arguments(train) -> None:
    train.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    _add_data_options(train, "training data")
    train.add_argument("--val", action="append", metavar="PATH", help="validation data, in the same forms as --data; "
                       "give it more than once (e.g. the new data's held-out part and the base data's) to score each "
                       "set every epoch, by its file name; the first is the one --keep-best and --early-stop judge")
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
    train.add_argument("--memory-budget", type=budget_size, metavar="BYTES", default="auto",
                       help="cap each training step's arena (e.g. 40MB), recomputing activations in the backward "
                       "pass; fails before training, naming the smallest budget that works, if none fits; "
                       "'auto' (the default): what the machine has available (MemAvailable, a cgroup's limit "
                       "less its use) less the mapped frozen weights and a reserve of an eighth; 'none': no cap")
    best = train.add_argument_group("the best epoch and the curves")
    best.add_argument("--keep-best", action="store_true", help="also keep the checkpoint of the epoch with the best "
                      "validation metric (of the first --val) as ARTIFACT_DIR/checkpoint.best, beside "
                      "ARTIFACT_DIR/checkpoint (the last epoch's)")
    best.add_argument("--best-metric", choices=("loss", "accuracy"), default="loss", help="the validation metric "
                      "--keep-best and --early-stop judge by (default: loss, lower is better)")
    best.add_argument("--early-stop", type=int, metavar="N", help="stop after N epochs in a row without a better "
                      "validation metric (needs --val)")
    best.add_argument("--plot", metavar="CURVES.png", help="draw the training and validation loss (and accuracy) per "
                      "epoch to this file when the run ends (pip install matplotlib)")
    replay = train.add_argument_group("rehearsal (against forgetting the base data)")
    replay.add_argument("--replay", metavar="PATH", help="base data (the forms of --data) mixed into every batch, "
                        "so that training on new data does not erase what the model knew")
    replay.add_argument("--replay-share", type=float, default=0.25, metavar="F", help="with --replay: the share of "
                        "each batch drawn from the base data (default 0.25: a batch of 32 new samples gains 11 base "
                        "ones)")
    add_threads_option(train)
    train.add_argument("--json", action="store_true", help="print the result as JSON instead of progress")
    train.add_argument("--stop-after-steps", type=int, help=argparse.SUPPRESS)


TRAIN = Command(
    "train", help="train prepared artifacts on data",
    description=("Train in shuffled batches, validate after each epoch, and save the checkpoint "
                 "(ARTIFACT_DIR/checkpoint, with optimizer state) every --checkpoint-every steps and at each epoch's"
                 " end. Ctrl-C stops after the current step and saves; --resume continues exactly where the run "
                 "stopped."),
    arguments=_train_arguments, run=_train)


def _eval_arguments(evaluate) -> None:
    evaluate.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    _add_data_options(evaluate, "test data")
    evaluate.add_argument("--batch-size", type=int, default=256, help="samples per step (default: 256)")
    evaluate.add_argument("--checkpoint", metavar="PATH", help="score this checkpoint instead of "
                          "ARTIFACT_DIR/checkpoint, e.g. ARTIFACT_DIR/checkpoint.best (train --keep-best)")
    add_threads_option(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")


EVAL = Command(
    "eval", help="score trained artifacts on data",
    description=("Run the eval model over the data: the mean loss, and accuracy for classifiers (cross-entropy, "
                 "binary cross-entropy) or MSE and MAE for regression."),
    arguments=_eval_arguments, run=_eval)


def _export_arguments(export) -> None:
    export.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.onnx", help="the file to write")
    export.add_argument("--checkpoint", metavar="PATH", help="export this checkpoint's parameters instead of "
                        "ARTIFACT_DIR/checkpoint's, e.g. ARTIFACT_DIR/checkpoint.best (train --keep-best)")
    export.add_argument("--outputs", nargs="+", metavar="NAME", help="values to output (default: the model's outputs)")
    export.add_argument("--frozen-dtype", choices=FROZEN_DTYPES, help="write frozen weights stored as int8, int4 "
                        "or bfloat16 (prepare --frozen-dtype) in this type: int8 read by DequantizeLinear (a QDQ "
                        "model), int4 by DequantizeLinear with block_size (opset 21), bfloat16 by Cast, LoRA "
                        "adapters beside them; default float32, adapters merged")
    export.add_argument("--adapters-only", action="store_true", help="write only the trained LoRA adapters (and "
                        "the parameters trained with them) as a safetensors file to -o, not the merged model")
    export.add_argument("--json", action="store_true", help="print the result as JSON")


EXPORT = Command(
    "export", help="write the trained inference model",
    description=("Write an ONNX inference model with the checkpoint's parameters embedded "
                 "(Module.export_model_for_inferencing); any ONNX runtime runs it."),
    arguments=_export_arguments, run=_export)
