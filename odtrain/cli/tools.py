"""`odtrain demo`, `odtrain warmup` (the JIT's cache filled), `odtrain compile` (the kernel library) and
`odtrain federated` (federated averaging across simulated devices).
"""
from __future__ import annotations

import json

from ..graph.errors import ArgumentError
from ..federated.demo import ENGINES
from ..trial_steps import DEFAULT_WARMUP_BATCH
from ..kernel_library.cpu import TARGETS
from ..library_build.targets import CPUS
from .options import Command, add_shape_arguments, input_shapes


def _demo(args) -> int:
    from ..demo import run

    result = run(args.output, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
                 out=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


def _warmup(args) -> int:
    import json

    from ..trial_steps import warmup

    result = warmup(args.artifact_dir, args.batch_size, input_shapes(args.input_shape), out=(lambda line: None) if args.json else print,
                    sequence_length=args.seq_len)
    if args.json:
        print(json.dumps(result))
    return 0


def _compile(args) -> int:
    from ..kernel_library import compiler_installed
    from ..library_build import compile_artifacts

    if not compiler_installed():  # the build is Numba's: the CLI says so in one line
        raise ModuleNotFoundError("No module named 'numba'", name="numba")
    folders = args.artifact_dir or [None]
    if args.output is None and (len(folders) > 1 or folders[0] is None):
        raise ArgumentError("odtrain compile without ARTIFACT_DIR (the demo classifier's kernels) or with several "
                            "folders needs the library's folder: give -o DIR")
    compile_artifacts(folders, args.output, args.batch_size, args.thread_counts, target=args.target, cpu=args.cpu,
                      sequence_length=args.seq_len, input_shapes=input_shapes(args.input_shape))
    return 0


def _federated(args) -> int:
    from ..federated.demo import run

    result = run(args.clients, args.rounds, args.engine, args.output, args.local_epochs, args.batch_size, args.lr,
                 args.alpha, args.seed, args.clip_norm, args.noise_multiplier, args.superlink, args.timeout,
                 out=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


def _demo_arguments(demo) -> None:
    demo.add_argument("-o", "--output", default="odtrain-demo", help="artifact folder (default: ./odtrain-demo)")
    demo.add_argument("--epochs", type=int, default=15, help="passes over the training digits (default: 15)")
    demo.add_argument("--batch-size", type=int, default=32, help="samples per step (default: 32)")
    demo.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 0.01)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the held-out split and the "
                      "batch order (default: 0)")
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object")


DEMO = Command(
    "demo", help="train a small classifier on the bundled 8x8 digits, end to end",
    description=("Generate artifacts for a built-in classifier, train it on the 8x8 handwritten digits shipped with "
                 "odtrain, print held-out accuracy and peak memory, and write an inference model."),
    arguments=_demo_arguments, run=_demo)


def _warmup_arguments(command) -> None:
    command.add_argument("artifact_dir", nargs="?", default=None, metavar="ARTIFACT_DIR",
                         help="folder written by generate_artifacts (default: the demo classifier)")
    command.add_argument("--batch-size", type=int, default=DEFAULT_WARMUP_BATCH,
                         help=f"batch size of the steps, the first symbolic axis (default: {DEFAULT_WARMUP_BATCH})")
    add_shape_arguments(command)
    command.add_argument("--json", action="store_true", help="print the results as one JSON object")


WARMUP = Command(
    "warmup", help="compile (or load) every kernel a set of artifacts needs, before the first step",
    description=("Run a training step, an optimizer step and an eval step of the artifacts on zero-valued inputs, so"
                 " that every kernel they use is compiled into the cache (or checked to load from it): the first "
                 "real step in a later process then compiles nothing. Without ARTIFACT_DIR, the built-in demo "
                 "classifier. The cache folder is ODTRAIN_CACHE_DIR when set (else NUMBA_CACHE_DIR, else Numba's "
                 "choice: next to the kernels, or ~/.cache/numba when the package folder is read-only)."),
    arguments=_warmup_arguments, run=_warmup)


def _compile_arguments(command) -> None:
    command.add_argument("artifact_dir", nargs="*", default=None, metavar="ARTIFACT_DIR",
                         help="folder written by generate_artifacts; several make one library for them all "
                         "(with -o); none: the demo classifier (with -o)")
    command.add_argument("-o", "--output", default=None, metavar="DIR", help="the library's folder "
                         "(default: ARTIFACT_DIR/kernels)")
    command.add_argument("--batch-size", type=int, default=32,
                         help="the batch size above 1 the steps are recorded at, besides batch 1 (default 32); the "
                         "library serves every batch size: this sets only the memory the recording binds")
    command.add_argument("--threads", type=int, action="append", default=None, metavar="N", dest="thread_counts",
                         help="a thread count the device runs at (repeatable; default: 1 and the device's cores: this "
                         "machine's, or 4 for another architecture, a Raspberry Pi's)")
    command.add_argument("--target", default=None, choices=sorted(TARGETS),
                         help="the device's architecture (default: this machine's); aarch64 from an x86_64 machine "
                         "needs a cross compiler (aarch64-linux-gnu-gcc, or ODTRAIN_CROSS_CC)")
    command.add_argument("--cpu", default=None, metavar="NAME",
                         help="the device's CPU (default: this machine's; for aarch64 cortex-a72, a Raspberry Pi 4's; "
                         "cortex-a76 for a Pi 5); known: " + "; ".join(f"{t}: {', '.join(c)}" for t, c in CPUS.items()))
    add_shape_arguments(command)


COMPILE = Command(
    "compile", help="build the kernels a set of artifacts needs into a native library, ahead of time",
    description=("Record every kernel, at every signature, that a training step, an optimizer step and an eval step "
                 "of the artifacts call (at 1 thread and at this machine's cores; at batch 1 and --batch-size, and "
                 "for inputs with a sequence axis at length 1 and --seq-len; every call that can split into parallel"
                 " parts recorded split as well, so that the library serves every batch size and sequence length), "
                 "compile them with Numba and link them into one shared library with its manifest, by default in "
                 "ARTIFACT_DIR/kernels/. A training process that finds it there loads it with ctypes: no kernel "
                 "compiles, Numba is not imported for the kernels it holds."),
    arguments=_compile_arguments, run=_compile)


def _federated_arguments(command) -> None:
    command.add_argument("--clients", type=int, default=3, help="simulated devices, each with its own share of "
                         "the digits (default: 3)")
    command.add_argument("--rounds", type=int, default=3, help="rounds of federated averaging (default: 3)")
    command.add_argument("--engine", choices=ENGINES, default="auto",
                         help="auto: Flower's simulation when flwr[simulation] is installed, else inprocess")
    command.add_argument("--superlink", metavar="HOST:PORT", help="deployment on a running SuperLink whose SuperNodes "
                         "have node config partition-id/num-partitions (default: start them on loopback)")
    command.add_argument("-o", "--output", default="odtrain-federated", help="work folder (default: ./odtrain-federated)")
    command.add_argument("--local-epochs", type=int, default=3, help="epochs each client trains on its share in "
                         "a round (default: 3)")
    command.add_argument("--batch-size", type=int, default=32, help="samples per client step (default: 32)")
    command.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate on the clients (default: 0.01)")
    command.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew (smaller: more skew; "
                         "default: 0.5)")
    command.add_argument("--clip-norm", type=float, default=None, help="clip each client's update to this L2 norm "
                         "(default: no clipping)")
    command.add_argument("--noise-multiplier", type=float, default=0.0,
                         help="Gaussian noise of std noise-multiplier * clip-norm on each client's update (default: 0)")
    command.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the data split, the label "
                         "skew and the batch order (default: 0)")
    command.add_argument("--timeout", type=float, default=600.0, help="seconds a Flower run may take (default: 600)")
    command.add_argument("--json", action="store_true", help="print the results as one JSON object")


FEDERATED = Command(
    "federated", help="federated averaging of the demo classifier across simulated devices",
    description=("Share the bundled 8x8 digits among clients non-IID by label, train the demo classifier with FedAvg"
                 " and print the global model's held-out loss and accuracy after every round. Engines: inprocess (no"
                 " Flower), simulation (flwr[simulation]), deployment (a SuperLink and SuperNodes)."),
    arguments=_federated_arguments, run=_federated)
