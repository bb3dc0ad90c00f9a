"""Photos of drawn shapes, for README's image walk-through: `python -m odtrain.shapes FOLDER`.

Writes FOLDER/train/<class>/NN.png and FOLDER/val/<class>/NN.png for the classes circle, square and
triangle: one filled shape a photo, dark grey on a light ground (each of a random shade, slightly tinted),
upright within 15 degrees, at a random place and size, with pixel noise, in photos of random width and
height (64 to 160 pixels, so a run exercises scaling and centre cropping). Shades and poses vary little:
an untrained MobileNetV2 learns the shapes from 48 photos, not just the training photos themselves.
The same seed writes the same files, byte for byte, on every machine: the drawing is Pillow's integer
rasteriser and the randomness numpy's PCG64 seeded by (seed, split, class, index).

Needs Pillow (pip install Pillow).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

CLASSES = ("circle", "square", "triangle")
SPLITS = {"train": 16, "val": 8}  # photos a class, per split


def draw(kind: str, rng: np.random.Generator):
    """One photo (a Pillow RGB image) of a shape of `kind`."""
    from PIL import Image, ImageDraw

    width, height = (int(v) for v in rng.integers(64, 161, size=2))
    background = tuple(int(v) for v in rng.integers(200, 256) + rng.integers(-8, 9, size=3))
    colour = tuple(int(v) for v in rng.integers(0, 60) + rng.integers(-8, 9, size=3))
    image = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(image)
    radius = float(rng.uniform(0.25, 0.42)) * min(width, height)
    centre_x = width / 2 + float(rng.uniform(-0.1, 0.1)) * width
    centre_y = height / 2 + float(rng.uniform(-0.1, 0.1)) * height
    if kind == "circle":
        pen.ellipse((centre_x - radius, centre_y - radius, centre_x + radius, centre_y + radius), fill=colour)
    else:
        corners = 4 if kind == "square" else 3
        turn = float(rng.uniform(-0.25, 0.25)) - math.pi / 2  # upright, give or take 15 degrees
        pen.polygon([(centre_x + radius * math.cos(turn + 2 * math.pi * k / corners),
                      centre_y + radius * math.sin(turn + 2 * math.pi * k / corners)) for k in range(corners)],
                    fill=colour)
    noise = rng.integers(-12, 13, size=(height, width, 3))
    pixels = np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def make(folder, seed: int = 0, counts: dict | None = None) -> dict:
    """Write the photos under `folder`; {split: number of photos written}."""
    written = {}
    for split_index, (split, per_class) in enumerate((counts or SPLITS).items()):
        for class_index, kind in enumerate(CLASSES):
            directory = os.path.join(os.fspath(folder), split, kind)
            os.makedirs(directory, exist_ok=True)
            for index in range(per_class):
                rng = np.random.default_rng([seed, split_index, class_index, index])
                draw(kind, rng).save(os.path.join(directory, f"{index:02d}.png"))
        written[split] = per_class * len(CLASSES)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m odtrain.shapes", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write train/ and val/, one sub-folder per class")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawings (default 0)")
    args = parser.parse_args(argv)
    try:
        written = make(args.folder, args.seed)
    except ImportError:
        print("python -m odtrain.shapes: error: drawing the photos needs Pillow: pip install Pillow", file=sys.stderr)
        return 2
    parts = ", ".join(f"{args.folder}/{split}/ ({count} photos)" for split, count in written.items())
    print(f"photos of {', '.join(CLASSES)} written to {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
