"""`odtrain predict ARTIFACT_DIR PATH...`: the most probable classes of each input, with their names.

What it reads, as `train` reads data: image files and folders of them (every image under a folder, in
sorted order, class sub-folders or not), preprocessed as `train` recorded in preprocessing.json
(odtrain/images.py; --image-size and --normalize override); audio clips and folders of them
(odtrain/audio.py); `.npz` files (each sample of the arrays named like the model's data inputs, or
picked with --x); a text file with --tokenizer and --seq-len (the next token after each window).

How: the eval model runs as `odtrain eval` runs it (odtrain.training.Session: the checkpoint, and the
artifact folder's kernel library when it has one, so a device without Numba predicts too), in batches
whose label input holds class 0 throughout: the eval model computes its loss from labels, and the
prediction output it returns does not depend on them. The probabilities are the softmax, in float64, of
that output (the logits the cross-entropy scores) over its class axis; a language model's are those of
the last position of each window.

Class names: preprocessing.json's `classes`, else the checkpoint's `classes` property (what `train`
records of a folder of clips); without them, classes are shown by index.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..graph.errors import ArgumentError, InputError
from .image_options import add_image_options, image_settings
from .options import Command, add_audio_options, add_threads_option, audio_features, print_json

TOP = 5


def _files_under(path: str, extensions: tuple) -> list[str]:
    """The files under a folder, in sorted order, with one of `extensions` (hidden entries left out)."""
    found = []
    for root, folders, files in os.walk(path):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files)
                  if not f.startswith(".") and f.lower().endswith(extensions)]
    return found


def _inputs(args, session) -> list[tuple[list[str], dict]]:
    """Groups of (a name for each sample, {data input: array}) from the paths, in the order given."""
    from ..audio import AUDIO_EXTENSIONS
    from ..data_loading import IMAGE_EXTENSIONS

    specs = [s for s in session.inputs if not s.is_label]
    groups, images, clips = [], [], []

    def flush():  # consecutive images (or clips) make one group, so they share batches
        if images:
            groups.append(_image_group(args, specs, list(images)))
            images.clear()
        if clips:
            groups.append(_clip_group(args, specs, list(clips)))
            clips.clear()

    for path in args.paths:
        if not os.path.exists(path):
            raise InputError(f"'{path}' does not exist")
        if os.path.isdir(path):
            found_images, found_clips = _files_under(path, IMAGE_EXTENSIONS), _files_under(path, AUDIO_EXTENSIONS)
            if not found_images and not found_clips:
                raise InputError(f"folder '{path}' holds no images ({', '.join(IMAGE_EXTENSIONS)}) and no clips "
                                 f"({', '.join(AUDIO_EXTENSIONS)})")
            images += found_images
            clips += found_clips
        elif path.lower().endswith(IMAGE_EXTENSIONS):
            images.append(path)
        elif path.lower().endswith(AUDIO_EXTENSIONS):
            clips.append(path)
        else:
            flush()
            groups.append(_array_group(args, session, specs, path))
    flush()
    return groups


def _image_group(args, specs, paths: list[str]) -> tuple[list[str], dict]:
    from ..images import Preprocessing

    if len(specs) != 1:
        raise ArgumentError(f"photos feed a model with one image input; this one takes "
                            f"{', '.join(s.describe() for s in specs)}")
    try:
        import PIL  # noqa: F401  (its absence is named before any file is read)
    except ImportError:
        raise ArgumentError("reading images needs Pillow: pip install Pillow") from None
    size, normalize = image_settings(args)
    preprocessing = Preprocessing.resolve(specs[0], size, normalize)
    samples = []
    for path in paths:
        try:
            samples.append(preprocessing.read(path))
        except Exception as error:  # PIL.UnidentifiedImageError, OSError
            raise InputError(f"image '{path}' cannot be read ({error})") from None
    return paths, {specs[0].name: np.stack(samples).astype(specs[0].dtype)}


def _clip_group(args, specs, paths: list[str]) -> tuple[list[str], dict]:
    from ..audio import AudioSource

    if len(specs) != 1:
        raise ArgumentError(f"clips feed a model with one audio input; this one takes "
                            f"{', '.join(s.describe() for s in specs)}")
    source = AudioSource(os.path.dirname(paths[0]), audio_features(args), args.sample_rate)
    length = source.length(specs[0])
    samples = np.stack([source.clip(path, length) for path in paths])  # a clip holding NaN is refused by name
    return paths, {specs[0].name: samples.astype(specs[0].dtype)}


def _array_group(args, session, specs, path: str) -> tuple[list[str], dict]:
    """Each sample of an .npz file, or each window of a text file."""
    from .. import data_loading

    if path.endswith(".txt"):
        if args.tokenizer is None or args.seq_len is None:
            raise ArgumentError(f"'{path}' is text: give the tokenizer that encodes it with --tokenizer "
                                "tokenizer.json, and --seq-len N")
        from ..text import TextSource

        dataset = TextSource(path, args.tokenizer, args.seq_len).dataset(session.inputs)
        arrays = {s.name: a for s, a in zip(dataset.inputs, dataset.arrays) if not s.is_label}
        return [f"{path} window {i}" for i in range(len(dataset))], arrays
    if not path.endswith(".npz"):
        raise ArgumentError(f"cannot predict from '{path}': give images, a folder of images or clips, audio clips, "
                            "an .npz file or a text file (with --tokenizer and --seq-len)")
    dataset = data_loading.load(path, specs, x=args.x)
    return [f"{path} sample {i}" for i in range(len(dataset))], dict(zip([s.name for s in specs], dataset.arrays))


def _class_names(session) -> list[str] | None:
    from ..images import recorded

    stored = recorded(session.paths.directory) or {}
    if stored.get("classes"):
        return list(stored["classes"])
    names = session.state.properties.get("classes")
    try:
        return list(json.loads(names)) if isinstance(names, str) else None
    except ValueError:
        return None


def _placeholder_labels(spec, arrays: dict, specs) -> np.ndarray:
    """Class 0 in the label input's shape: its symbolic axes as the data inputs bind them."""
    bound = {}
    for data_spec in specs:
        for dim, size in zip(data_spec.shape or (), arrays[data_spec.name].shape):
            if isinstance(dim, str):
                bound.setdefault(dim, size)
    batch = len(next(iter(arrays.values())))
    shape = [batch if axis == 0 else bound.get(dim, dim) for axis, dim in enumerate(spec.shape or (batch,))]
    if any(isinstance(dim, str) for dim in shape):
        raise InputError(f"the label input {spec.describe()} has axes the data inputs do not give; predict cannot "
                         "build its placeholder")
    return np.zeros(shape, dtype=spec.dtype)


def probabilities(logits: np.ndarray, class_axis: int) -> np.ndarray:
    """Softmax over the class axis, in float64; a language model's (classes last) at the last position."""
    scores = np.asarray(logits, dtype=np.float64)
    if class_axis == -1:
        scores = scores[:, -1, :] if scores.ndim == 3 else scores
    elif scores.ndim != 2:
        raise InputError(f"the model's output has shape {list(scores.shape)}; predict scores one class per sample "
                         "([batch, classes])")
    scores = scores - scores.max(axis=-1, keepdims=True)
    exponentials = np.exp(scores)
    return exponentials / exponentials.sum(axis=-1, keepdims=True)


def predict(args, session) -> list[dict]:
    """[{"input": name, "top": [{"class": index, "name": ..., "probability": p}, ...]}, ...] for every input."""
    from ..graph.losses import cross_entropy_layout

    kind = session.loss_kind
    if kind != "ce" or not session.prediction_outputs:
        raise ArgumentError(f"'{args.artifacts}' holds a model trained with {kind or 'its own'} loss; predict gives "
                            "the class probabilities of a classifier trained with cross-entropy (prepare --loss ce). "
                            "Run the exported model (odtrain export) for other outputs")
    class_axis = cross_entropy_layout(session.module.graph(training=False))[0]
    if args.batch_size < 1 or (args.top is not None and args.top < 1):
        raise ArgumentError("--batch-size and --top must be at least 1")
    names = _class_names(session)
    tokenizer = None
    if args.tokenizer is not None:
        from ..text import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    specs = session.inputs
    data_specs = [s for s in specs if not s.is_label]
    label = next((s for s in specs if s.is_label), None)
    module = session.module
    module.eval()
    results = []
    for sample_names, arrays in _inputs(args, session):
        for begin in range(0, len(sample_names), args.batch_size):
            batch = {name: array[begin:begin + args.batch_size] for name, array in arrays.items()}
            feeds = [batch[s.name] if not s.is_label else _placeholder_labels(label, batch, data_specs) for s in specs]
            outputs = module(*feeds)
            chances = probabilities(outputs[1], class_axis)
            top = args.top if args.top is not None else min(TOP, len(names) if names else TOP)
            top = min(top, chances.shape[1])
            for offset, row in enumerate(chances):
                best = np.argsort(-row, kind="stable")[:top]
                results.append({"input": sample_names[begin + offset], "top": [
                    {"class": int(c), "name": _name(int(c), names, tokenizer), "probability": float(row[c])}
                    for c in best]})
    return results


def _name(index: int, names, tokenizer) -> str | None:
    if names is not None and index < len(names):
        return names[index]
    if tokenizer is not None:
        return repr(tokenizer.decode([index]))
    return None


def _predict(args) -> int:
    from ..training import Session

    session = Session(args.artifacts, with_optimizer=False)
    results = predict(args, session)
    if args.json:
        print_json(results)
        return 0
    for result in results:
        shown = [f"{item['name'] if item['name'] is not None else 'class ' + str(item['class'])} "
                 f"{item['probability']:.1%}" for item in result["top"]]
        print(f"{result['input']}: {', '.join(shown)}")
    return 0


def _predict_arguments(command) -> None:
    command.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`, trained")
    command.add_argument("paths", nargs="+", metavar="PATH", help="image files, folders of images or clips, audio "
                         "clips, .npz files, or a text file (with --tokenizer and --seq-len)")
    command.add_argument("--top", type=int, metavar="K", help=f"classes shown per input, most probable first "
                         f"(default: {TOP}, or fewer when the model has fewer named classes)")
    command.add_argument("--batch-size", type=int, default=32, help="samples per step (default: 32)")
    command.add_argument("--x", action="append", metavar="NAME", help="the .npz array feeding the model's data "
                         "input, once per data input (default: the array named like the input, or x, images, inputs)")
    command.add_argument("--tokenizer", metavar="TOKENIZER.json", help="for a language model: encode the text file "
                         "with this tokenizers file and show the next tokens decoded")
    command.add_argument("--seq-len", type=int, metavar="N", help="with --tokenizer: windows of N tokens")
    add_image_options(command)
    add_audio_options(command, "audio clips (the features training computed)")
    add_threads_option(command)
    command.add_argument("--json", action="store_true", help="print the predictions as JSON")


PREDICT = Command(
    "predict", help="the most probable classes of images, clips or samples",
    description=("Run the eval model on each input and print its most probable classes with their probabilities "
                 "(the softmax of the model's output), named by the class folders training read. Photos are "
                 "preprocessed as `odtrain train` recorded (ARTIFACT_DIR/preprocessing.json)."),
    arguments=_predict_arguments, run=_predict)
