"""Where the compiled kernels are kept, and filling that cache before the first step.

Every kernel is an `@njit(cache=True)` function: the first process that needs
one compiles it (0.5-2 s each) and writes it to Numba's cache; later processes
load it (milliseconds). Where the cache lives:

- `NUMBA_CACHE_DIR` set by the user: there, untouched.
- `ODTRAIN_CACHE_DIR` set: there (odtrain sets `NUMBA_CACHE_DIR` from it
  before Numba is imported).
- neither: Numba's own choice, next to the kernels' sources
  (`odtrain/kernels/__pycache__`) when that folder is writable, else the
  user's cache folder (`$XDG_CACHE_HOME/numba` or `~/.cache/numba`). When
  neither is writable (a read-only system image and no home folder), odtrain
  picks a folder in the temporary directory, so that importing the kernels
  never fails for want of a cache.

Cached kernels compiled from other kernel sources than the installed ones are removed before the
first step (odtrain.kernel_sources: Numba does not see a change in a file a kernel calls into).

`configure()` runs when `odtrain` is imported and costs a few system calls.
`warmup()` (the `odtrain warmup` command) compiles or loads every kernel that
a training step, an optimizer step and an eval step of a set of artifacts
need, so that the first real step compiles nothing.
"""
from __future__ import annotations

import os
import sys
import time

from .graph.wording import count
from .kernel_sources import kernels_dir, loaded_dispatchers

CACHE_ENV = "ODTRAIN_CACHE_DIR"
NUMBA_ENV = "NUMBA_CACHE_DIR"
DEFAULT_WARMUP_BATCH = 32

_configured_source = None


def _writable(folder: str) -> bool:
    """Whether `folder` exists and can be written, or can be created (the nearest existing parent is writable)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def user_cache_dir() -> str:
    """Numba's user-wide cache folder (where it goes when the package folder is read-only)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba")


def configure() -> str:
    """Choose the cache folder before Numba is imported; returns how it was chosen.

    'NUMBA_CACHE_DIR' (the user's), 'ODTRAIN_CACHE_DIR', 'package' (next to the kernels' sources),
    'user' (the user's cache folder) or 'temporary'.
    """
    global _configured_source
    if os.environ.get(NUMBA_ENV):
        source = NUMBA_ENV
    elif os.environ.get(CACHE_ENV):
        _set_numba_cache_dir(os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV])))
        source = CACHE_ENV
    else:
        kernels = kernels_dir()
        pycache = os.path.join(kernels, "__pycache__")
        if _writable(pycache if os.path.isdir(pycache) else kernels):
            source = "package"
        elif _writable(user_cache_dir()):
            source = "user"
        else:
            import tempfile

            uid = os.getuid() if hasattr(os, "getuid") else "user"
            _set_numba_cache_dir(os.path.join(tempfile.gettempdir(), f"odtrain-numba-cache-{uid}"))
            source = "temporary"
    _configured_source = source
    return source


def _set_numba_cache_dir(path: str) -> None:
    os.environ[NUMBA_ENV] = path
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba imported first: its configuration is read already, and reread by the compiler
        config.CACHE_DIR = path


def cache_dir() -> str:
    """The folder the kernels are cached in (imports the kernels)."""
    chosen = os.environ.get(NUMBA_ENV)
    for dispatcher in kernel_dispatchers():
        path = getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
        if path:  # NUMBA_CACHE_DIR/<folder>_<hash of the sources' folder>, or the folder itself
            if chosen and os.path.dirname(path) == os.path.abspath(chosen):
                return os.path.abspath(chosen)
            return path
    return ""


def kernel_dispatchers() -> list:
    """Every Numba dispatcher of odtrain's kernel modules (imports them, through the executor)."""
    from . import executor  # noqa: F401  (the executor imports every kernel module)

    return loaded_dispatchers()


def kernel_stats() -> dict:
    """Counts over every kernel of this process so far: 'compiled' (cache misses: compiled here),
    'loaded' (cache hits: loaded from the cache), 'kernels' (dispatchers with a compiled signature),
    and 'compiled_kernels', the names of the kernels compiled."""
    compiled = loaded = used = 0
    names = []
    for dispatcher in kernel_dispatchers():
        stats = dispatcher.stats
        misses = sum(stats.cache_misses.values())
        compiled += misses
        loaded += sum(stats.cache_hits.values())
        used += bool(dispatcher.signatures)
        if misses:
            names.append(f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}")
    return {"compiled": compiled, "loaded": loaded, "kernels": used, "compiled_kernels": names}


def demo_artifacts(directory: str) -> str:
    """The demo classifier's artifacts, generated in `directory` (returned; odtrain.demo.demo_artifacts)."""
    from .demo import demo_artifacts as written

    return written(directory)


def zero_inputs(module, batch_size: int, input_shapes: dict | None = None, sequence_length: int | None = None) -> list:
    """Zero-valued inputs of a Module's current mode, as a step would see them: the first symbolic axis
    is `batch_size`, the other symbolic axes `sequence_length`; `input_shapes` gives whole shapes by input name."""
    import numpy as np

    from .graph.errors import ArgumentError

    input_shapes = input_shapes or {}
    feeds = []
    for name, declared in module.input_types(module.training).items():
        if name in input_shapes:
            shape = tuple(int(d) for d in input_shapes[name])
        elif declared.shape is None:
            raise ArgumentError(f"input '{name}' has no declared shape: give it with --input-shape {name}=D0,D1,...")
        else:
            shape = []
            for axis, dim in enumerate(declared.shape):
                if not isinstance(dim, str):
                    shape.append(int(dim))
                elif axis == 0:
                    shape.append(int(batch_size))
                elif sequence_length is not None:
                    shape.append(int(sequence_length))
                else:
                    raise ArgumentError(f"input '{name}' has a symbolic axis {axis} ('{dim}') besides the batch: "
                                        f"give its length with --seq-len N, or the whole shape with "
                                        f"--input-shape {name}=D0,D1,...")
            shape = tuple(shape)
        feeds.append(np.zeros(shape, dtype=declared.dtype))
    return feeds


def _kernel_activity() -> dict[str, tuple[int, int]]:
    """Each kernel of this process -> (signatures compiled, signatures loaded from the cache) so far."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}":
            (sum(d.stats.cache_misses.values()), sum(d.stats.cache_hits.values())) for d in kernel_dispatchers()}


def warmup(artifact_dir=None, batch_size: int = DEFAULT_WARMUP_BATCH, input_shapes: dict | None = None,
           out=print, sequence_length: int | None = None) -> dict:
    """Compile, or load from the cache, every kernel of a training step, an optimizer step and an eval step.

    `artifact_dir` holds training_model.onnx, checkpoint, and optionally eval_model.onnx and
    optimizer_model.onnx (the files generate_artifacts writes); None warms up the built-in demo
    classifier. The steps run on zero-valued inputs whose first symbolic axis is `batch_size` and whose
    other symbolic axes are `sequence_length`; `input_shapes` gives whole shapes by input name. Nothing is
    written to the artifacts. Returns the kernel counts and seconds: each kernel the steps used is counted
    once, as compiled (some signature of it was compiled) or loaded from the cache.
    """
    import tempfile

    from .artifact_paths import TRAINING_MODEL, ArtifactPaths, refuse_a_model
    from .graph.errors import ArgumentError, ArtifactNotFoundError

    if int(batch_size) < 1:
        raise ArgumentError(f"batch size must be >= 1, got {batch_size}")
    if sequence_length is not None and int(sequence_length) < 1:
        raise ArgumentError(f"sequence length must be >= 1, got {sequence_length}")
    started = time.perf_counter()
    scratch = None
    if artifact_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="odtrain-warmup-")
        directory = demo_artifacts(scratch.name)
        label = "the built-in demo classifier"
    else:
        directory = os.fspath(artifact_dir)
        refuse_a_model(directory)
        label = directory
        if not ArtifactPaths.of(directory).has("training_model"):
            raise ArtifactNotFoundError(f"'{directory}' has no {TRAINING_MODEL}: give the folder that "
                                        f"generate_artifacts wrote ({TRAINING_MODEL}, checkpoint, ...)")
    try:
        before = _kernel_activity()
        steps, shapes = run_steps(directory, int(batch_size), input_shapes or {}, sequence_length)
    finally:
        if scratch is not None:
            scratch.cleanup()
    after = _kernel_activity()
    compiled = loaded = 0
    for name, (misses, hits) in after.items():
        new_misses, new_hits = (misses, hits) if name not in before else (misses - before[name][0],
                                                                          hits - before[name][1])
        compiled += new_misses > 0
        loaded += new_misses == 0 and new_hits > 0
    result = {"artifacts": label, "batch_size": int(batch_size), "inputs": shapes, "steps": steps,
              "compiled": compiled, "loaded": loaded, "kernels": compiled + loaded, "cache_dir": cache_dir(),
              "cache_source": _configured_source, "seconds": time.perf_counter() - started}
    inputs = ", ".join(f"{name} [{', '.join(map(str, shape))}]" for name, shape in shapes.items())
    out(f"warmed up {label} on inputs {inputs} ({', '.join(steps)} steps): {count(result['kernels'], 'kernel')}, "
        f"{compiled} compiled and {loaded} loaded from the cache, in {result['seconds']:.1f} s")
    out(f"kernel cache: {result['cache_dir']}")
    return result


def run_steps(directory: str, batch_size: int, input_shapes: dict, sequence_length=None) -> tuple[list[str], dict]:
    import numpy as np

    from .api import CheckpointState, Module, Optimizer
    from .artifact_paths import ArtifactPaths
    from .executor import assert_finite, invoke

    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    has_eval = paths.has("eval_model")
    module = Module(paths.training_model, state, paths.eval_model if has_eval else None)
    optimizer = Optimizer(paths.optimizer_model, module) if paths.has("optimizer_model") else None
    steps = []
    feeds = zero_inputs(module.train(), batch_size, input_shapes, sequence_length)
    loss = module(*feeds)  # gradients written
    module(*feeds)  # gradients accumulated (no lazy_reset_grad in between)
    steps.append("train")
    if optimizer is not None:
        optimizer.step()
        steps.append("optimizer")
    module.lazy_reset_grad()
    if has_eval:
        module.eval()
        module(*zero_inputs(module, batch_size, input_shapes, sequence_length))
        module.train()
        steps.append("eval")
    first = loss[0] if isinstance(loss, (list, tuple)) else loss
    first = np.asarray(first)
    if first.dtype.kind == "f":  # the check of Module(check_finite=True)
        invoke(assert_finite, (np.zeros(1, dtype=first.dtype),), library=module.kernel_library)
    return steps, {name: list(array.shape) for name, array in zip(module.input_names(), feeds)}


def add_command(commands) -> None:
    """Add `odtrain warmup` to the CLI's subcommands."""
    command = commands.add_parser(
        "warmup", help="compile (or load) every kernel a set of artifacts needs, before the first step",
        description="Run a training step, an optimizer step and an eval step of the artifacts on zero-valued "
        "inputs, so that every kernel they use is compiled into the cache (or checked to load from it): the "
        "first real step in a later process then compiles nothing. Without ARTIFACT_DIR, the built-in demo "
        "classifier. The cache folder is ODTRAIN_CACHE_DIR when set (else NUMBA_CACHE_DIR, else Numba's "
        "choice: next to the kernels, or ~/.cache/numba when the package folder is read-only).")
    command.add_argument("artifact_dir", nargs="?", default=None, metavar="ARTIFACT_DIR",
                         help="folder written by generate_artifacts (default: the demo classifier)")
    command.add_argument("--batch-size", type=int, default=DEFAULT_WARMUP_BATCH,
                         help=f"batch size of the steps, the first symbolic axis (default: {DEFAULT_WARMUP_BATCH})")
    add_shape_arguments(command)
    command.add_argument("--json", action="store_true", help="print the results as one JSON object")
    command.set_defaults(handler=_command)


def add_shape_arguments(command, prefix: str = "") -> None:
    """--seq-len and --input-shape (after `prefix`, e.g. "compile-"): the step inputs' axes besides the batch."""
    command.add_argument(f"--{prefix}seq-len", type=int, metavar="N", help="length of the inputs' other symbolic "
                         "axes (a language model's sequence)")
    command.add_argument(f"--{prefix}input-shape", nargs="+", action="extend", default=[], metavar="NAME=D0,D1,...",
                         help="the whole shape of one or more inputs (ids=4,16 mask=4,16), for inputs whose axes "
                         "the batch size and the sequence length do not give")


def input_shapes(items, option: str = "--input-shape") -> dict:
    """{input name: shape} from NAME=D0,D1,... items; a malformed one is refused by `option`."""
    from .graph.errors import ArgumentError

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


def _command(args) -> int:
    import json

    result = warmup(args.artifact_dir, args.batch_size, input_shapes(args.input_shape), out=(lambda line: None) if args.json else print,
                    sequence_length=args.seq_len)
    if args.json:
        print(json.dumps(result))
    return 0

