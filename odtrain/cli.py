"""The `odtrain` command line (also `python -m odtrain`).

Exit code 0 on success; on a user error, one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from .graph.errors import OdtrainError


def _demo(args) -> int:
    from .demo import run

    result = run(args.output, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
                 out=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="odtrain", description="Train ONNX models on the device that holds the data.")
    parser.add_argument("--version", action="version", version=f"odtrain {__import__('odtrain').__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="train a small classifier on the bundled 8x8 digits, end to end",
                               description="Generate artifacts for a built-in classifier, train it on the 8x8 "
                               "handwritten digits shipped with odtrain, print held-out accuracy and peak memory, "
                               "and write an inference model.")
    demo.add_argument("-o", "--output", default="odtrain-demo", help="artifact folder (default: ./odtrain-demo)")
    demo.add_argument("--epochs", type=int, default=15)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except OdtrainError as error:
        print(f"odtrain {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"odtrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
