"""The `odtrain` command line (also `python -m odtrain`).

Each command is a `Command` record (odtrain/cli/options.py) in the module that runs it, and COMMANDS
below lists them in the order `odtrain --help` shows: the workflow (check whether odtrain can train a
model, prepare the artifacts, train, eval, predict, export the inference model), the reports (inspect,
memory, profile), then the tools (demo, warmup, compile, federated).

Exit code 0 on success; on a user error, one line on stderr and exit code 2; 1 when `check` finds
the model untrainable; 130 (SIGINT) or 143 (SIGTERM) when training stopped after saving; 141, silently,
when the reader of its output left (`| head`).
"""
from __future__ import annotations

import os
import sys

from ..graph.errors import OdtrainError
from ..graph.wording import count
from . import predict, prepare, reports, tools, train
from .options import Parser, note

COMMANDS = (prepare.CHECK, prepare.PREPARE, train.TRAIN, train.EVAL, predict.PREDICT, train.EXPORT, reports.INSPECT,
            reports.MEMORY, reports.PROFILE, tools.DEMO, tools.WARMUP, tools.COMPILE, tools.FEDERATED)


def build_parser() -> Parser:
    parser = Parser(prog="odtrain", description="Train ONNX models on the device that holds the data.")
    parser.add_argument("--version", action="version", version=f"odtrain {__import__('odtrain').__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        arguments = commands.add_parser(command.name, help=command.help, description=command.description)
        command.arguments(arguments)
        arguments.set_defaults(handler=command.run)
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
    from ..threads import available_cores, process_default

    threads, cores = getattr(args, "threads", None), available_cores()
    if isinstance(threads, int) and threads > cores:
        note(args, f"--threads {threads} with {count(cores, 'core')} for this process: each step is split into "
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
