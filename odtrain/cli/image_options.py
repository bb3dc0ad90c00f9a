"""--image-size and --normalize, shared by train, eval and predict: the options, and the image folder they read.

A value given on the command line wins; else the one `odtrain train` recorded in the artifact folder
(preprocessing.json, odtrain/images.py); else the model's own image size and no normalisation. So eval and
predict apply what training applied without the options repeated, and a second `train` keeps them too.
"""
from __future__ import annotations

from ..graph.errors import ArgumentError
from ..images import NORMALIZE_HELP, PREPROCESSING_FILE, parse_size, recorded
from .options import note


def add_image_options(command) -> None:
    group = command.add_argument_group("photos (a folder of images)")
    group.add_argument("--image-size", metavar="N|HxW", help="the size photos are scaled and centre-cropped to, for a "
                       "model whose input height and width are symbolic (default: the model's fixed size, else the "
                       f"size recorded in ARTIFACT_DIR/{PREPROCESSING_FILE} by train)")
    group.add_argument("--normalize", metavar="imagenet|none|MEAN,STD", help=f"per-channel normalisation after "
                       f"scaling pixels to [0, 1]: {NORMALIZE_HELP} (default: the recorded one, else none)")


def image_settings(args) -> tuple:
    """(image size, normalize) for a folder of photos: the options given, else those recorded in the folder."""
    stored = recorded(args.artifacts) or {}
    size = parse_size(args.image_size) if args.image_size is not None else None
    if size is None:
        size = stored.get("image_size")
    normalize = args.normalize if args.normalize is not None else stored.get("normalize")
    if stored and args.command == "train":
        changed = [f"{what} {new} (was {old})" for what, new, old in
                   (("image size", _size_text(size), _size_text(stored["image_size"])),
                    ("normalisation", normalize, stored["normalize"])) if new != old]
        if changed:
            note(args, f"this run changes {' and '.join(changed)} from {PREPROCESSING_FILE}, and records the new "
                 "settings: photos given to eval and predict will be preprocessed as in this run")
    return size, normalize


def refuse_without_photos(args) -> None:
    """Refuse --image-size and --normalize when the data holds no photos."""
    given = [flag for flag, value in (("--image-size", args.image_size), ("--normalize", args.normalize))
             if value is not None]
    if given:
        raise ArgumentError(f"{' and '.join(given)} preprocess photos: give a folder of images (one sub-folder per "
                            "class)")


def image_folder(args, folder: str, record_to: str | None = None):
    """The data_loading.ImageFolder a command reads, with the image settings of image_settings()."""
    from ..data_loading import ImageFolder

    size, normalize = image_settings(args)
    return ImageFolder(folder, args.skip_unreadable, report=lambda line: note(args, line), image_size=size,
                       normalize=normalize, record_to=record_to)


def _size_text(size) -> str | None:
    return None if size is None else f"{size[0]}x{size[1]}"
