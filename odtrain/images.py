"""Photos as a model's image input: size, crop, channel layout and normalisation, the same in train, eval and predict.

One photo becomes one sample of the model's image input in these steps (torchvision's usual ImageNet
evaluation transform, `Resize(size)` + `CenterCrop(size)` + `ToTensor()` + `Normalize(mean, std)`):
- decode with Pillow and convert to RGB (a 3-channel input) or grayscale (1 channel);
- scale, keeping the aspect ratio, so that the photo just covers the target height x width (for a
  square target: its shorter side becomes the size), with Pillow's bilinear filter, which widens its
  support when it shrinks (antialiasing, as torchvision's `antialias=True`);
- crop the centre height x width (its offsets rounded as torchvision's CenterCrop rounds them);
- divide by 255 (pixels in [0, 1]), then subtract `mean[c]` and divide by `std[c]` per channel;
- lay the sample out as the input declares it: NCHW ([N, C, H, W]), NHWC ([N, H, W, C]), [N, H, W] or
  flattened [N, H*W*C] (channels first, as a flattened NCHW tensor).

The layout is read off the input's shape: a 1 or 3 after the batch is NCHW's channel axis, else a 1 or 3
last is NHWC's. Height and width come from the input when they are numbers; an input whose height or
width is symbolic (a `torch.onnx.export` with dynamic axes) takes them from `image_size`, and refuses
without it, naming `--image-size`.

What a run used is `Preprocessing`, stored as `preprocessing.json` in the artifact folder (with the class
names of a folder of photos) when `odtrain train` reads photos; `eval` and `predict` read it back, so they
apply what training applied without the options repeated. A JSON file beside the models rather than the
checkpoint's property bag: it describes the inputs of every checkpoint of the folder (the last, the best)
and of the exported model, a person or an app deploying that model reads it without a safetensors reader,
and the checkpoint stays written by the training loop alone.

Imports numpy and odtrain's errors only; Pillow when a photo is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .graph.errors import ArgumentError, InputError

PREPROCESSING_FILE = "preprocessing.json"
FORMAT = "odtrain image preprocessing"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE_POLICY = ("scale (bilinear, antialiased) so the image covers height x width, keeping its aspect ratio; "
                 "crop the centre")
NORMALIZE_HELP = ("imagenet (mean 0.485/0.456/0.406, std 0.229/0.224/0.225), none (pixels in [0, 1]), or MEAN,STD on "
                  "the [0, 1] scale, each one number or one per channel joined by '/' (0.5,0.5 or "
                  "0.485/0.456/0.406,0.229/0.224/0.225)")


def parse_size(text) -> tuple[int, int]:
    """(height, width) from `N` (square), `HxW`, an int or a pair; ArgumentError naming --image-size otherwise."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        parts = list(text)
    elif isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        parts = [text, text]
    else:
        pieces = str(text).lower().replace("×", "x").split("x")
        parts = pieces * 2 if len(pieces) == 1 else pieces
    try:
        height, width = (int(str(p).strip()) for p in parts)
    except ValueError:
        raise ArgumentError(f"--image-size {text!r}: expected N (a square) or HEIGHTxWIDTH, e.g. 224 or "
                            "96x128") from None
    if height < 1 or width < 1:
        raise ArgumentError(f"--image-size {text!r}: height and width must be at least 1")
    return height, width


def parse_normalize(text: str, channels: int = 3) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std), one value per channel, of a --normalize value (see NORMALIZE_HELP)."""
    name = str(text).strip().lower()
    if name == "imagenet":
        mean, std = IMAGENET_MEAN, IMAGENET_STD
        if channels == 1:  # a grayscale pixel is the channels' average, and so are its statistics
            mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        return tuple(mean), tuple(std)
    if name == "none":
        return (0.0,) * channels, (1.0,) * channels
    halves = name.split(",")
    try:
        if len(halves) != 2:
            raise ValueError
        mean, std = ([float(v) for v in half.split("/")] for half in halves)
    except ValueError:
        raise ArgumentError(f"--normalize {text!r}: expected imagenet, none or MEAN,STD ({NORMALIZE_HELP})") from None
    for what, values in (("MEAN", mean), ("STD", std)):
        if len(values) not in (1, channels):
            raise ArgumentError(f"--normalize {text!r}: {what} has {len(values)} values; give one, or one per "
                                f"channel of the input ({channels})")
        if not all(np.isfinite(values)):
            raise ArgumentError(f"--normalize {text!r}: {what} must be finite numbers")
    if any(s <= 0 for s in std):
        raise ArgumentError(f"--normalize {text!r}: STD must be positive (each pixel is divided by it)")
    if any(abs(m) > 1 for m in mean) or any(s > 1 for s in std):
        raise ArgumentError(f"--normalize {text!r}: MEAN and STD are on the [0, 1] scale of pixels divided by 255; "
                            "for statistics on the 0-255 scale divide them by 255 (127.5 -> 0.5)")
    return tuple(mean * channels if len(mean) == 1 else mean), tuple(std * channels if len(std) == 1 else std)


@dataclass(frozen=True)
class Layout:
    """How an image input lays out one sample: NCHW, NHWC, NHW or flat; height and width are ints or the
    input's symbolic names."""

    layout: str
    channels: int
    height: object
    width: object

    @property
    def fixed(self) -> bool:
        return isinstance(self.height, int) and isinstance(self.width, int)


def layout_of(spec) -> Layout:
    """The layout of an image input (an InputSpec: name, shape, describe()), or InputError saying which shapes work."""
    dims = None if spec.shape is None else tuple(spec.shape[1:])
    if dims is not None and len(dims) == 3 and dims[0] in (1, 3):
        return Layout("NCHW", dims[0], dims[1], dims[2])
    if dims is not None and len(dims) == 3 and dims[2] in (1, 3):
        return Layout("NHWC", dims[2], dims[0], dims[1])
    if dims is not None and len(dims) == 2:
        return Layout("NHW", 1, dims[0], dims[1])
    if dims is not None and len(dims) == 1 and isinstance(dims[0], int):
        for channels in (1, 3):
            side = int(round(np.sqrt(dims[0] / channels)))
            if side * side * channels == dims[0]:
                return Layout("flat", channels, side, side)
    raise InputError(f"input {spec.describe()} is not an image shape odtrain can fill: use [N, C, H, W], "
                     "[N, H, W, C], [N, H, W] or a flattened square [N, H*W*C] with 1 or 3 channels")


def covering_size(width: int, height: int, target_width: int, target_height: int) -> tuple[int, int]:
    """(width, height) of an image scaled, aspect kept, to just cover the target: the side that binds becomes the
    target's, the other is truncated as torchvision's Resize truncates the longer side (in integers, so it never
    falls below its target by a rounding of the scale)."""
    if target_height * width >= target_width * height:  # the height binds
        return width * target_height // height, target_height
    return target_width, height * target_width // width


@dataclass(frozen=True)
class Preprocessing:
    """What turns a photo into a sample of one image input (see the module docstring)."""

    input: str
    layout: str
    channels: int
    height: int
    width: int
    normalize: str  # imagenet, none, or the MEAN,STD text given
    mean: tuple
    std: tuple

    @classmethod
    def resolve(cls, spec, image_size=None, normalize=None) -> "Preprocessing":
        """The preprocessing for input `spec`: its own height and width when they are numbers, else
        `image_size` (N, "HxW" or (H, W)); `normalize` as --normalize takes it (default none)."""
        shape = layout_of(spec)
        size = parse_size(image_size) if image_size is not None else None
        if shape.fixed:
            if size is not None and size != (shape.height, shape.width):
                raise ArgumentError(f"--image-size {size[0]}x{size[1]} does not fit input {spec.describe()}, whose "
                                    f"images are {shape.height}x{shape.width}; leave --image-size out")
            size = (shape.height, shape.width)
        elif size is None:
            raise ArgumentError(f"input {spec.describe()} has no fixed image size: give the size to resize photos "
                                "to with --image-size N (or HxW), e.g. the size the model was trained at "
                                "(from Python: odtrain.data_loading.ImageFolder(folder, image_size=N))")
        else:
            for axis, (dim, chosen) in enumerate(zip((shape.height, shape.width), size)):
                if isinstance(dim, int) and dim != chosen:
                    raise ArgumentError(f"--image-size {size[0]}x{size[1]} does not fit input {spec.describe()}, "
                                        f"whose {('height', 'width')[axis]} is {dim}")
        name = "none" if normalize is None else str(normalize).strip()
        mean, std = parse_normalize(name, shape.channels)
        if name.lower() in ("imagenet", "none"):
            name = name.lower()
        return cls(spec.name, shape.layout, shape.channels, size[0], size[1], name, mean, std)

    def sample_shape(self) -> tuple:
        """The shape of one sample, as the input lays it out."""
        c, h, w = self.channels, self.height, self.width
        return {"NCHW": (c, h, w), "NHWC": (h, w, c), "NHW": (h, w), "flat": (c * h * w,)}[self.layout]

    def pixels(self, image) -> np.ndarray:
        """A Pillow image as float32 [height, width, channels], scaled to cover, centre-cropped, normalised."""
        from PIL import Image

        image = image.convert("L" if self.channels == 1 else "RGB")
        size = covering_size(image.width, image.height, self.width, self.height)
        if size != image.size:
            image = image.resize(size, Image.BILINEAR)
        if size != (self.width, self.height):
            left, top = (int(round((size[0] - self.width) / 2)), int(round((size[1] - self.height) / 2)))
            image = image.crop((left, top, left + self.width, top + self.height))
        array = np.asarray(image, dtype=np.float32).reshape(self.height, self.width, self.channels) / np.float32(255)
        return (array - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)

    def sample(self, image) -> np.ndarray:
        """A Pillow image as one sample of the input (sample_shape())."""
        array = self.pixels(image)
        if self.layout in ("NCHW", "flat"):
            array = array.transpose(2, 0, 1)
        return np.ascontiguousarray(array).reshape(self.sample_shape())

    def read(self, path: str) -> np.ndarray:
        """One sample from an image file; Pillow's errors (UnidentifiedImageError, OSError) pass through."""
        from PIL import Image

        with Image.open(path) as image:
            return self.sample(image)

    def describe(self) -> str:
        normalised = {"none": "pixels in [0, 1]", "imagenet": "ImageNet mean and std"}.get(
            self.normalize, f"mean {'/'.join(f'{m:g}' for m in self.mean)}, std {'/'.join(f'{s:g}' for s in self.std)}")
        return (f"{self.height}x{self.width} {'RGB' if self.channels == 3 else 'grayscale'} ({self.layout}), "
                f"{normalised}")

    def to_dict(self, classes=None) -> dict:
        record = {"format": FORMAT, "version": 1, "input": self.input, "layout": self.layout,
                  "channels": self.channels, "height": self.height, "width": self.width, "resize": RESIZE_POLICY,
                  "scale": "pixels / 255", "normalize": self.normalize, "mean": list(self.mean),
                  "std": list(self.std)}
        if classes:
            record["classes"] = list(classes)
        return record


def record(folder, preprocessing: Preprocessing, classes=None) -> str:
    """Write `folder`/preprocessing.json (atomically: a temporary file renamed over it); its path."""
    path = os.path.join(os.fspath(folder), PREPROCESSING_FILE)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(preprocessing.to_dict(classes), file, indent=2)
        file.write("\n")
    os.replace(temporary, path)
    return path


def recorded(folder) -> dict | None:
    """The preprocessing recorded in artifact folder `folder`, or None when it has none; InputError naming a
    damaged file."""
    path = os.path.join(os.fspath(folder), PREPROCESSING_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            stored = json.load(file)
        if stored.get("format") != FORMAT:
            raise ValueError(f"its format is {stored.get('format')!r}, not {FORMAT!r}")
        size = (int(stored["height"]), int(stored["width"]))
        normalize = str(stored["normalize"])
        classes = stored.get("classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise ValueError("'classes' is not a list of names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"'{path}' cannot be read ({error}); delete it and give --image-size and --normalize "
                         "again (odtrain train writes it anew)") from None
    return {"image_size": size, "normalize": normalize, "classes": classes}


def record_beside(folder, model_path) -> tuple[str, str] | None:
    """Copy the preprocessing recorded in artifact folder `folder` beside an exported model, as
    `<model without .onnx>.preprocessing.json`, for whoever deploys that model; (its path, a one-line summary),
    or None when the folder records none."""
    source = os.path.join(os.fspath(folder), PREPROCESSING_FILE)
    stored = recorded(folder)  # refuses a damaged record by name
    if stored is None:
        return None
    model_path = os.fspath(model_path)
    stem = model_path[:-len(".onnx")] if model_path.endswith(".onnx") else model_path
    target = f"{stem}.preprocessing.json"
    with open(source, encoding="utf-8") as file:
        text = file.read()
    with open(target, "w", encoding="utf-8") as file:
        file.write(text)
    height, width = stored["image_size"]
    classes = stored["classes"]
    summary = (f"{height}x{width}, normalize {stored['normalize']}"
               + (f", classes {', '.join(classes)}" if classes else ""))
    return target, summary
