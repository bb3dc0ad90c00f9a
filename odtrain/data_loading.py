"""Training data from files: `.npz` archives, `.npy` files and folders of images.

A `Dataset` holds one array per input of the training model (the model's own
inputs, then its label input, `labels` or `target`), all with the same
number of samples, already in the dtype and shape the model declares.

Which array feeds which input:
- `.npz`: an array named like the input; else the arrays named by `x`
  (the model's data inputs, in order) and `y` (the labels); else, for a model
  with one data input, the conventional names (`x`, `images`, `inputs`, ...
  and `y`, `labels`, `target`, ...).
- `.npy` files: one per input, in the model's input order.
- a folder of audio clips (odtrain/audio.py): one sub-folder per class, as for images.
- a folder: one sub-folder per class, named by the class; images are read
  with Pillow and preprocessed as odtrain/images.py says (scaled to cover the
  input's height and width, or `image_size` where those are symbolic, centre
  cropped, in [0, 1] then normalised per channel, in the input's layout); the
  label is the class's index in sorted order. Files that are not images,
  folders nested in a class folder and files beside the class folders are
  skipped and counted in one line (`ImageFolder(report=...)`, else a
  warning), hidden entries (`.DS_Store`) ignored; an image that cannot be
  decoded stops the load unless `skip_unreadable`, which counts it among
  the skipped.

Arrays are converted to the declared dtype when no information is lost
(float64 -> float32, int32 -> int64, integral floats -> int64 labels) and
reshaped when a sample has the right number of elements (8x8 images for a
64-wide input). Nothing is unpickled. Floating-point data holding a NaN or an
infinity is refused when it is loaded (`refuse_nonfinite`), naming the file,
the input and the first such sample: a step would only say that the loss
diverged.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from .audio import AUDIO_EXTENSIONS, AudioSource, is_audio_folder
from .images import Preprocessing, record
from .graph.errors import ArgumentError, ArtifactNotFoundError, InputError
from .graph.wording import count

DATA_ALIASES = ("x", "X", "inputs", "input", "images", "features", "data")
LABEL_ALIASES = ("y", "Y", "labels", "label", "targets", "target")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


@dataclass(frozen=True)
class InputSpec:
    """One input of the training model: name, dtype, shape (ints, or strings for symbolic dims)."""

    name: str
    dtype: np.dtype
    shape: tuple | None
    is_label: bool = False

    def describe(self) -> str:
        dims = "?" if self.shape is None else ", ".join(str(d) for d in self.shape)
        return f"{self.name} {np.dtype(self.dtype).name}[{dims}]"


@dataclass
class Dataset:
    """Arrays feeding the training model's inputs, sample-aligned along axis 0."""

    inputs: list[InputSpec]
    arrays: list[np.ndarray]
    source: str = "arrays"
    classes: list[str] | None = field(default=None)
    files: list[str] | None = None  # the file each sample was read from (a folder of images or clips)
    preprocessing: Preprocessing | None = None  # how photos became samples (a folder of images)

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0]) if self.arrays else 0

    def take(self, index) -> list[np.ndarray]:
        return [array[index] for array in self.arrays]

    def batches(self, batch_size: int, order=None, start: int = 0):
        """Yield lists of arrays of `batch_size` samples (the last may be smaller), from batch `start` on."""
        samples = len(self)
        order = np.arange(samples) if order is None else order
        for begin in range(start * batch_size, samples, batch_size):
            yield self.take(order[begin:begin + batch_size])

    @property
    def labels(self) -> np.ndarray | None:
        for spec, array in zip(self.inputs, self.arrays):
            if spec.is_label:
                return array
        return None


def load(paths, inputs: list[InputSpec], x=None, y=None) -> Dataset:
    """A Dataset from one `.npz` file, one folder of images, or one `.npy` file per input."""
    paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if not paths:
        raise ArgumentError("no data given: pass an .npz file, a folder of images or .npy files")
    for path in paths:
        if not os.path.exists(path):
            raise ArtifactNotFoundError(f"data file '{path}' does not exist")
    first = paths[0]
    if (x or y) and not (len(paths) == 1 and first.endswith(".npz")):
        raise ArgumentError("--x/--y name arrays inside an .npz file; .npy files feed the inputs in order "
                            f"({', '.join(s.name for s in inputs)})")
    if len(paths) == 1 and os.path.isdir(first):
        if is_audio_folder(first):
            return load_audio_folder(AudioSource(first), inputs)
        return load_image_folder(first, inputs)
    if len(paths) == 1 and first.endswith(".npz"):
        return _load_npz(first, inputs, list(x or []), y)
    if all(p.endswith(".npy") for p in paths):
        if len(paths) != len(inputs):
            raise ArgumentError(f"{len(paths)} .npy files for a model with {len(inputs)} inputs "
                                f"({', '.join(s.name for s in inputs)}): give one file per input, in that order")
        arrays = [_read_npy(p) for p in paths]
        return from_arrays(dict(zip([s.name for s in inputs], arrays)), inputs, source=" ".join(paths))
    raise ArgumentError(f"cannot read data from {' '.join(paths)}: give one .npz file, one folder of images "
                        "(a sub-folder per class) or one .npy file per model input")


def from_arrays(arrays, inputs: list[InputSpec], source: str = "arrays", classes=None, files=None) -> Dataset:
    """A Dataset from a dict {input name: array} or a sequence of arrays in the inputs' order."""
    if isinstance(arrays, Dataset):
        return arrays
    if not isinstance(arrays, dict):
        arrays = list(arrays)
        if len(arrays) != len(inputs):
            raise InputError(f"{len(arrays)} arrays for a model with {len(inputs)} inputs "
                             f"({', '.join(s.name for s in inputs)})")
        arrays = dict(zip([s.name for s in inputs], arrays))
    missing = [s.name for s in inputs if s.name not in arrays]
    if missing:
        raise InputError(f"{source}: no data for inputs {missing}; the model takes "
                         f"{', '.join(s.describe() for s in inputs)}")
    converted = [_conform(np.asarray(arrays[s.name]), s, source) for s in inputs]
    lengths = {s.name: a.shape[0] for s, a in zip(inputs, converted)}
    if len(set(lengths.values())) > 1:
        raise InputError(f"{source}: the arrays hold different numbers of samples: {lengths}")
    if converted and converted[0].shape[0] == 0:
        raise InputError(f"{source}: the data holds no samples")
    dataset = Dataset(list(inputs), converted, source, classes, files)
    refuse_nonfinite(dataset)
    return dataset


# rows checked at a time: np.isfinite's boolean copy of a large token or image array stays small
_FINITE_CHUNK_BYTES = 64 << 20


def first_nonfinite(dataset: Dataset) -> tuple[str, int, tuple, float] | None:
    """(input name, sample index, position inside the sample, value) of the first NaN or infinity in the
    dataset's floating-point arrays, or None when every value is finite. Reads each array in chunks of rows."""
    for spec, array in zip(dataset.inputs, dataset.arrays):
        if array.dtype.kind != "f" or not array.size:
            continue
        rows = max(1, _FINITE_CHUNK_BYTES // max(1, array[0].nbytes if array.ndim > 1 else array.itemsize))
        for begin in range(0, len(array), rows):
            finite = np.isfinite(array[begin:begin + rows])
            if not finite.all():
                first = tuple(int(i) for i in np.argwhere(~finite)[0])  # within the chunk
                where = (begin + first[0],) + first[1:]
                return spec.name, where[0], where[1:], float(array[where])
    return None


def refuse_nonfinite(dataset: Dataset) -> None:
    """Refuse data holding a NaN or an infinity, naming its source (and the sample's file), the input, the first
    such sample and how many there are; training on it would only report a diverged loss."""
    found = first_nonfinite(dataset)
    if found is None:
        return
    name, sample, position, value = found
    array = dataset.arrays[[s.name for s in dataset.inputs].index(name)]
    rows = max(1, _FINITE_CHUNK_BYTES // max(1, array[0].nbytes if array.ndim > 1 else array.itemsize))
    bad = sum(int((~np.isfinite(array[b:b + rows].reshape(len(array[b:b + rows]), -1))).any(axis=1).sum())
              for b in range(sample, len(array), rows))
    where = f" ('{dataset.files[sample]}')" if dataset.files else ""
    inside = f" at position {', '.join(map(str, position))}" if position else ""
    shown = "NaN" if np.isnan(value) else ("infinity" if value > 0 else "-infinity")
    raise InputError(f"{dataset.source}: sample {sample}{where} of input '{name}' holds {shown}{inside} "
                     f"({bad:,} of {len(dataset):,} samples hold NaN or infinite values); fix or drop those samples")


def _check_member_size(archive, name: str) -> None:
    """InputError when array `name` of an open .npz declares more bytes than its member holds: numpy allocates
    the declared array before reading it, so a damaged shape would ask for memory the file never justifies."""
    member = archive.zip.getinfo(name + ".npy" if name + ".npy" in archive.zip.namelist() else name)
    with archive.zip.open(member) as file:
        version = np.lib.format.read_magic(file)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(file)
        header = file.tell()
    count = int(np.prod(shape, dtype=object))  # Python integers: a damaged shape does not wrap around
    if dtype.hasobject or count * dtype.itemsize > member.file_size - header:
        raise InputError(f"array '{name}' declares {shape} {dtype}, more than its {member.file_size:,} bytes hold")


def _read_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as error:
        raise InputError(f"data file '{path}' cannot be read without unpickling ({error}); save plain "
                         "numeric arrays") from None
    except OSError as error:
        raise InputError(f"data file '{path}' is not a readable .npy file ({error})") from None


def _refuse_other_than_npz(path: str) -> None:
    """Refuse a file that is not a zip archive by what it is: numpy would try to unpickle anything else and say
    so, which blames pickling for a file of the wrong kind."""
    with open(path, "rb") as file:
        head = file.read(6)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):  # a zip's first entry, or the end record of an empty zip
        return
    if head == b"\x93NUMPY":
        raise InputError(f"data file '{path}' is a single .npy array, not an .npz archive (a zip of .npy arrays): "
                         "rename it to .npy and give one .npy file per model input, or save the arrays with "
                         "numpy.savez")
    what = "the file is empty" if not head else f"the file starts {head!r}"
    raise InputError(f"data file '{path}' is not an .npz archive (a zip of .npy arrays; {what}): save the "
                     "arrays with numpy.savez(path, input=..., labels=...)")


def _load_npz(path: str, inputs: list[InputSpec], x: list[str], y: str | None) -> Dataset:
    _refuse_other_than_npz(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                _check_member_size(archive, name)
            stored = {name: archive[name] for name in archive.files}
    except InputError as error:
        raise InputError(f"data file '{path}' is damaged: {error}") from None
    except ValueError as error:
        if "pickle" in str(error):
            raise InputError(f"data file '{path}' cannot be read without unpickling ({error}); save plain "
                             "numeric arrays") from None
        raise InputError(f"data file '{path}' is not a readable .npz archive ({error})") from None
    except Exception as error:  # zipfile.BadZipFile, OSError, EOFError, a damaged header's SyntaxError
        raise InputError(f"data file '{path}' is not a readable .npz archive ({error})") from None
    data_inputs = [s for s in inputs if not s.is_label]
    label_inputs = [s for s in inputs if s.is_label]
    chosen: dict[str, str] = {}
    for name in x + ([y] if y else []):
        if name not in stored:
            raise InputError(f"data file '{path}' has no array '{name}'; it holds {sorted(stored)}")
    if x:
        if len(x) != len(data_inputs):
            raise ArgumentError(f"--x names {len(x)} arrays, but the model has {len(data_inputs)} data inputs "
                                f"({', '.join(s.name for s in data_inputs)})")
        chosen.update({s.name: a for s, a in zip(data_inputs, x)})
    if y:
        if not label_inputs:
            raise ArgumentError("--y names a label array, but the model takes no labels (its loss is its own output)")
        chosen[label_inputs[0].name] = y
    for spec in inputs:
        if spec.name in chosen:
            continue
        if spec.name in stored:
            chosen[spec.name] = spec.name
            continue
        aliases = LABEL_ALIASES if spec.is_label else (DATA_ALIASES if len(data_inputs) == 1 else ())
        found = [a for a in aliases if a in stored and a not in chosen.values()]
        if len(found) != 1:
            raise InputError(f"data file '{path}' holds arrays {sorted(stored)}; none is clearly the model's input "
                             f"'{spec.name}'. Name the arrays like the inputs "
                             f"({', '.join(s.name for s in inputs)}) or pick them with --x NAME and --y NAME")
        chosen[spec.name] = found[0]
    return from_arrays({name: stored[array] for name, array in chosen.items()}, inputs, source=f"data file '{path}'")


def _conform(array: np.ndarray, spec: InputSpec, source: str) -> np.ndarray:
    """`array` in the dtype and per-sample shape that `spec` declares, or an InputError saying why not."""
    what = f"{source}: array for input '{spec.name}'"
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise InputError(f"{what} has dtype {array.dtype}; it must be numeric ({np.dtype(spec.dtype).name})")
    target = np.dtype(spec.dtype)
    if array.dtype != target:
        if target.kind in "iub" and array.dtype.kind == "f" and not np.all(array == np.round(array)):
            raise InputError(f"{what} holds non-integer values ({array.dtype}); the model takes "
                             f"{target.name} class indices")
        array = array.astype(target)
    if spec.shape is None or array.ndim == 0:
        if array.ndim == 0:
            raise InputError(f"{what} is a scalar; it needs one entry per sample along axis 0")
        return array
    want = spec.shape[1:]
    got = array.shape[1:]
    if len(want) == len(got) and all(isinstance(w, str) or w == g for w, g in zip(want, got)):
        return array
    if all(isinstance(w, int) for w in want) and np.prod(want, dtype=np.int64) == np.prod(got, dtype=np.int64):
        return array.reshape((array.shape[0],) + tuple(want))
    raise InputError(f"{what} has samples of shape {list(got)}; the model's input is {spec.describe()}")


@dataclass
class ImageFolder:
    """A folder of images, one sub-folder per class, read with these choices: `skip_unreadable` leaves out
    images that cannot be decoded (counted) instead of stopping; `report` receives the line that says what
    was skipped and why (default: a warning); `image_size` (N, "HxW" or (H, W)) for an input whose height and
    width are symbolic, `normalize` ("imagenet", "none" or "MEAN,STD"; odtrain/images.py); `record_to`, an
    artifact folder where the preprocessing and the class names are written (preprocessing.json) once the
    images are read."""

    folder: str
    skip_unreadable: bool = False
    report: object = None
    image_size: object = None
    normalize: str | None = None
    record_to: str | None = None

    def dataset(self, inputs: list[InputSpec]) -> Dataset:
        dataset = load_image_folder(self.folder, inputs, self.skip_unreadable, self.report, self.image_size,
                                    self.normalize)
        if self.record_to is not None:
            record(self.record_to, dataset.preprocessing, dataset.classes)
        return dataset


def _skipped_line(folder: str, skipped: dict[str, list[str]], read: int) -> str:
    """One line saying how many entries of an image folder were skipped, why, and an example of each."""
    nouns = {"not an image": ("other file", "other files"),
             "nested folder": ("folder inside a class folder", "folders inside class folders"),
             "outside the classes": ("file beside the class folders", "files beside the class folders"),
             "unreadable": ("unreadable image", "unreadable images")}
    parts = [f"{count(len(paths), *nouns[why])} (e.g. '{paths[0]}')" for why, paths in skipped.items() if paths]
    total = sum(len(paths) for paths in skipped.values())
    return (f"image folder '{folder}': read {count(read, 'image')} ({', '.join(IMAGE_EXTENSIONS)}), skipped "
            f"{count(total, 'entry', 'entries')}: " + ", ".join(parts))


def load_image_folder(folder: str, inputs: list[InputSpec], skip_unreadable: bool = False, report=None,
                      image_size=None, normalize: str | None = None) -> Dataset:
    """Images in one sub-folder per class, preprocessed for the model's data input (odtrain/images.py: its size,
    else `image_size`; `normalize`); labels are class indices.
    What is not read (other files, nested folders, with `skip_unreadable` images that cannot be decoded)
    is counted and reported in one line (see ImageFolder)."""
    data_inputs = [s for s in inputs if not s.is_label]
    label_inputs = [s for s in inputs if s.is_label]
    if len(data_inputs) != 1 or len(label_inputs) != 1 or np.dtype(label_inputs[0].dtype).kind not in "iu":
        raise ArgumentError(f"a folder of images trains a classifier with one image input and integer labels; "
                            f"this model takes {', '.join(s.describe() for s in inputs)}")
    try:
        import PIL  # noqa: F401  (its absence is named before any file is read)
    except ImportError:
        raise ArgumentError(f"reading the images in '{folder}' needs Pillow: pip install Pillow") from None
    spec = data_inputs[0]
    preprocessing = Preprocessing.resolve(spec, image_size, normalize)
    entries = sorted(e for e in os.listdir(folder) if not e.startswith("."))
    classes = [e for e in entries if os.path.isdir(os.path.join(folder, e))]
    if not classes:
        raise InputError(f"image folder '{folder}' has no sub-folders; put the images of each class in a "
                         "sub-folder named by the class")
    skipped: dict[str, list[str]] = {"not an image": [], "nested folder": [], "unreadable": [],
                                     "outside the classes": [e for e in entries if e not in classes]}
    images, labels, files = [], [], []
    for index, name in enumerate(classes):
        directory = os.path.join(folder, name)
        for file in sorted(os.listdir(directory)):
            path = os.path.join(directory, file)
            if file.startswith("."):  # hidden: a system's own files (.DS_Store), not data
                continue
            if os.path.isdir(path):
                skipped["nested folder"].append(os.path.join(name, file))
                continue
            if not file.lower().endswith(IMAGE_EXTENSIONS):
                skipped["not an image"].append(os.path.join(name, file))
                continue
            try:
                images.append(preprocessing.read(path))
            except Exception as error:  # PIL.UnidentifiedImageError, OSError
                if not skip_unreadable:
                    raise InputError(f"image '{path}' cannot be read ({error}); --skip-unreadable (skip_unreadable="
                                     "True) leaves such images out and counts them") from None
                skipped["unreadable"].append(os.path.join(name, file))
                continue
            labels.append(index)
            files.append(path)
    if any(skipped.values()):
        line = _skipped_line(folder, skipped, len(images))
        if report is not None:
            report(line)
        else:
            warnings.warn(line, stacklevel=2)
    if not images:
        raise InputError(f"image folder '{folder}' holds no images ({', '.join(IMAGE_EXTENSIONS)}) in its "
                         f"class sub-folders {classes}")
    dataset = from_arrays({spec.name: np.stack(images), label_inputs[0].name: np.asarray(labels, dtype=np.int64)},
                          inputs, source=f"image folder '{folder}'", classes=classes, files=files)
    dataset.preprocessing = preprocessing
    return dataset


def load_audio_folder(source: AudioSource, inputs: list[InputSpec]) -> Dataset:
    """Clips in one sub-folder per class (odtrain/audio.py), as the model's audio input; labels are class
    indices. Unreadable clips stop the run by name, or are left out and counted (source.skipped)."""
    data_inputs = [s for s in inputs if not s.is_label]
    labels = [s for s in inputs if s.is_label]
    if len(data_inputs) != 1 or len(labels) != 1 or np.dtype(labels[0].dtype).kind not in "iu":
        raise ArgumentError(f"a folder of clips trains a classifier with one audio input and integer labels; "
                            f"this model takes {', '.join(s.describe() for s in inputs)}")
    spec, folder = data_inputs[0], source.folder
    length = source.length(spec)
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)) and not d.startswith("."))
    if not classes:
        raise InputError(f"audio folder '{folder}' has no sub-folders; put the clips of each class in a "
                         "sub-folder named by the class")
    rows, targets, files, total = [], [], [], 0
    for index, name in enumerate(classes):
        directory = os.path.join(folder, name)
        for file in sorted(os.listdir(directory)):
            if not file.lower().endswith(AUDIO_EXTENSIONS):
                continue
            total += 1
            path = os.path.join(directory, file)
            try:
                rows.append(source.clip(path, length))
            except InputError as error:
                if not source.skip_unreadable:
                    raise InputError(f"{error} (--skip-unreadable leaves such files out)") from None
                source.skipped.append((path, str(error)))
                continue
            targets.append(index)
            files.append(path)
    if source.skipped and source.report is not None:
        source.report(f"skipped {len(source.skipped)} of {total} clips that cannot be read; the first: "
                      f"{source.skipped[0][1]}")
    if not rows:
        raise InputError(f"audio folder '{folder}' holds no readable clips ({', '.join(AUDIO_EXTENSIONS)}) in its "
                         f"class sub-folders {classes}")
    return from_arrays({spec.name: np.stack(rows), labels[0].name: np.asarray(targets, dtype=np.int64)}, inputs,
                       source=f"audio folder '{folder}'", classes=classes, files=files)
