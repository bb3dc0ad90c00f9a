"""What the commands share: the record each registers, the parser, and the options and output several use."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable

from ..graph.wording import name_list


@dataclasses.dataclass(frozen=True)
class Command:
    """One `odtrain` command: its name, its line in `odtrain --help`, its own help's description, the function
    that adds its arguments to its parser, and the one that runs it on the parsed arguments (the exit code)."""

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported as one line on stderr (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def print_json(payload) -> None:
    print(json.dumps(payload, indent=2, default=str))


def listed(names: list[str], verbose: bool = False) -> str:
    """The names, comma-separated; a long list as its first and last few unless --verbose."""
    return name_list(names, verbose, "--verbose lists all")


def shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else "[?]"


def value_text(graph, name: str) -> str:
    t = graph.value_types.get(name)
    return f"{name} {t.dtype.name}{shape_text(t.shape)}" if t is not None else name


def add_threads_option(parser) -> None:
    parser.add_argument("--threads", type=int, metavar="N", help="threads of each step, kernels and BLAS together "
                        "(default: ODTRAIN_NUM_THREADS, else every core this process may run on)")


def byte_size(text: str) -> int:
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


def budget_size(text: str):
    """--memory-budget: a size, "auto" (odtrain.allocation.auto_budget) or "none" (no budget: None)."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return "auto" if word == "auto" else None
    return byte_size(text)


def note(args, line: str) -> None:
    print(f"odtrain {args.command}: note: {line}", file=sys.stderr)


def add_shape_arguments(command, prefix: str = "") -> None:
    """--seq-len and --input-shape (after `prefix`, e.g. "compile-"): the step inputs' axes besides the batch."""
    command.add_argument(f"--{prefix}seq-len", type=int, metavar="N", help="length of the inputs' other symbolic "
                         "axes (a language model's sequence)")
    command.add_argument(f"--{prefix}input-shape", nargs="+", action="extend", default=[], metavar="NAME=D0,D1,...",
                         help="the whole shape of one or more inputs (ids=4,16 mask=4,16), for inputs whose axes "
                         "the batch size and the sequence length do not give")


def input_shapes(items, option: str = "--input-shape") -> dict:
    """{input name: shape} from NAME=D0,D1,... items; a malformed one is refused by `option`."""
    from ..graph.errors import ArgumentError

    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise ArgumentError(f"{option} {item!r}: expected NAME=D0,D1,... with whole numbers") from None
        if not name or not shapes[name]:
            raise ArgumentError(f"{option} {item!r}: expected NAME=D0,D1,... (give ARTIFACT_DIR before {option})")
    return shapes


def add_audio_options(command, heading: str) -> None:
    """The clips' options of every command that reads them (train, eval, predict): the same features, so that
    a command scores or predicts on what training computed."""
    audio = command.add_argument_group(heading)
    audio.add_argument("--audio-features", choices=("log-mel",), help="compute features for a model whose input is "
                       "log-mel [batch, n_mels, frames] (default: feed the waveform [batch, samples])")
    audio.add_argument("--sample-rate", type=int, default=16000, metavar="HZ",
                       help="the model's sample rate; clips are resampled to it (default 16000)")
    audio.add_argument("--n-mels", type=int, default=40, metavar="N", help="mel bands (default 40)")
    audio.add_argument("--win-ms", type=float, default=25.0, metavar="MS", help="analysis window (default 25 ms)")
    audio.add_argument("--hop-ms", type=float, default=10.0, metavar="MS", help="hop between frames (default 10 ms)")
    audio.add_argument("--n-fft", type=int, default=512, metavar="N", help="DFT size (default 512)")


def audio_features(args):
    """The log-mel settings the audio options give (checked), or None for the waveform."""
    if getattr(args, "audio_features", None) != "log-mel":
        return None
    from ..audio import LogMel

    settings = LogMel(args.sample_rate, args.n_mels, args.win_ms, args.hop_ms, args.n_fft)
    settings.check()
    return settings
