"""`odtrain inspect`, `odtrain memory` (what a training step holds, odtrain.memory) and `odtrain profile`
(where its time goes, odtrain.profile).
"""
from __future__ import annotations

import os

from ..artifact_paths import ArtifactPaths, refuse_a_model
from ..graph.errors import ArgumentError, ArtifactNotFoundError
from ..graph.wording import count
from .options import Command, add_shape_arguments, byte_size, input_shapes, print_json, shape_text


def _inspect(args) -> int:
    from .. import checkpoint as checkpoint_file
    from ..training import Session

    target = args.target
    if target.endswith(".onnx"):
        refuse_a_model(target)
    if os.path.isdir(target):
        paths = ArtifactPaths.of(target)
    elif os.path.isfile(target):
        paths = ArtifactPaths.of(os.path.dirname(target) or ".", checkpoint=target)
    else:
        raise ArtifactNotFoundError(f"'{target}' is neither an artifact folder nor a checkpoint file")
    folder, checkpoint = paths.directory, paths.checkpoint
    contents = checkpoint_file.load(checkpoint)
    parameters = [{"name": n, "shape": list(a.shape), "dtype": a.dtype.name, "trainable": n in contents.trainable}
                  for n, a in contents.parameters.items()]
    optimizer = dict(contents.optimizer or {})
    if contents.optimizer is not None:
        optimizer["state"] = sorted(contents.optimizer_tensors)
    report = {"checkpoint": checkpoint, "nominal": contents.nominal, "parameters": parameters,
              "properties": contents.properties, "optimizer": optimizer or None, "memory_plan": None}
    plans = {}
    if not paths.missing("training_model", "eval_model"):
        module = Session(folder, checkpoint=checkpoint, with_optimizer=False).module
        try:
            shapes = input_shapes(args.input_shape)
            plans = {"training step": module.bind_at(args.batch_size, True, args.seq_len, shapes).plan,
                     "eval step": module.bind_at(args.batch_size, False, args.seq_len, shapes).plan}
            report["memory_plan"] = {"batch_size": args.batch_size, **{
                name: {"arena_bytes": p.arena_bytes, "lower_bound": p.lower_bound, "ops": p.steps}
                for name, p in plans.items()}}
        except ArgumentError as error:
            report["memory_plan"] = {"skipped": str(error)}
    if args.json:
        print_json(report)
        return 0
    import numpy as np

    values = {True: 0, False: 0}
    for p in parameters:
        values[p["trainable"]] += int(np.prod(p["shape"], dtype=np.int64))
    print(f"checkpoint: {checkpoint}" + (" (nominal: shapes only)" if contents.nominal else ""))
    print(f"parameters: {count(len(parameters), 'tensor')}; {count(values[True], 'trainable value')}, {values[False]:,} frozen")
    width = max(len(p["name"]) for p in parameters) if parameters else 0
    for p in parameters:
        print(f"  {p['name']:<{width}}  {p['dtype']:<8} {shape_text(p['shape']):<16} "
              f"{'trainable' if p['trainable'] else 'frozen'}")
    print("properties:" + ("" if contents.properties else " (none)"))
    width = max((len(k) for k in contents.properties), default=0)
    for key, value in contents.properties.items():
        print(f"  {key:<{width}}  {value:.6g}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    if optimizer:
        print(f"optimizer: {optimizer['kind']}, step {optimizer['step']}, learning rate "
              f"{optimizer['learning_rate']:.6g}; state: {', '.join(optimizer['state']) or '(none)'}")
    else:
        print("optimizer: no state saved yet")
    plan_info = report["memory_plan"]
    if plan_info is None:
        print("memory plan: no training and eval models beside the checkpoint")
    elif "skipped" in plan_info:
        print(f"memory plan: skipped ({plan_info['skipped']})")
    else:
        print(f"memory plan at batch size {args.batch_size}:")
        for name, p in plans.items():
            print(f"  {name + ':':<15} arena {p.arena_bytes:,} B, lower bound {p.lower_bound:,} B "
                  f"({p.arena_bytes / max(p.lower_bound, 1):.2f}x), {count(p.steps, 'op')}")
            if args.plan:
                print("    " + p.render().replace("\n", "\n    "))
    return 0


def _memory(args) -> int:
    from .. import memory

    if args.batch_size < 1:
        raise ArgumentError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.plot:
        from ..memory import require_matplotlib

        require_matplotlib()  # before the plans are bound
    result = memory.from_artifacts(args.artifacts, args.batch_size, args.budget, args.seq_len,
                                   input_shapes(args.input_shape))
    budget = (f"memory budget {memory.format_bytes(args.budget)} ({args.budget:,} B)" if args.budget
              else "no memory budget")
    if args.plot:
        from ..memory import plot_timeline

        folder = os.path.basename(os.path.normpath(args.artifacts))
        plot_timeline(result, args.plot, f"{folder}: training step at batch size {args.batch_size}, {budget}")
    if args.json:
        print_json({"artifacts": args.artifacts, "batch_size": args.batch_size, "budget_bytes": args.budget,
                     **result.to_dict(), "plot": args.plot})
        return 0
    sequence = f", sequence length {args.seq_len}" if args.seq_len else ""
    print(f"memory of {args.artifacts} at batch size {args.batch_size}{sequence}, {budget}")
    print(result.render())
    if args.plot:
        print(f"timeline of the training step written to {args.plot}")
    return 0


def _profile(args) -> int:
    from ..profile import profile_artifacts

    report = profile_artifacts(args.artifacts, args.batch_size, steps=args.steps, threads=args.threads,
                               clock=args.clock, sequence_length=args.seq_len,
                               input_shapes=input_shapes(args.input_shape))
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.render(top=args.top))
    return 0


def _inspect_arguments(inspect) -> None:
    inspect.add_argument("target", metavar="ARTIFACT_DIR|CHECKPOINT", help="an artifact folder or a checkpoint file")
    inspect.add_argument("--batch-size", type=int, default=32, help="batch size of the memory plan (default: 32)")
    add_shape_arguments(inspect)
    inspect.add_argument("--plan", action="store_true", help="also print each plan's timeline")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")


INSPECT = Command(
    "inspect", help="show a checkpoint's parameters, properties, optimizer state and memory plan",
    description=("Show the parameters (name, dtype, shape, trainable), the property bag, the optimizer state and, "
                 "for an artifact folder, the memory plan of a training and an eval step at --batch-size."),
    arguments=_inspect_arguments, run=_inspect)


def _memory_arguments(memory) -> None:
    memory.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    memory.add_argument("--batch-size", type=int, required=True, help="samples per step")
    add_shape_arguments(memory)
    memory.add_argument("--budget", type=byte_size, metavar="BYTES", help="plan the training step under this "
                        "arena budget (e.g. 40MB), recomputing activations as `train --memory-budget` does")
    memory.add_argument("--json", action="store_true", help="print the report as JSON (sizes in bytes)")
    memory.add_argument("--plot", metavar="FILE.png", help="also draw the training step's live bytes per step, "
                        'by category (needs matplotlib: pip install matplotlib)')


MEMORY = Command(
    "memory", help="predict the memory of a training step at a batch size",
    description=("Bind the training step (and the eval step) at --batch-size without running it and report its "
                 "memory: parameters, gradient buffer, optimizer state, the arena against its lower bound and "
                 "against no reuse, folded constants, recomputed nodes, and the predicted peak. The Python/Numba "
                 "runtime floor is not included."),
    arguments=_memory_arguments, run=_memory)


def _profile_arguments(profile) -> None:
    profile.add_argument("artifacts", metavar="ARTIFACT_DIR", help="a folder written by `odtrain prepare`")
    profile.add_argument("--batch-size", type=int, required=True, help="samples per step")
    add_shape_arguments(profile)
    profile.add_argument("--steps", type=int, default=10, help="profiled steps, after 2 warm-up steps (default: 10)")
    profile.add_argument("--threads", type=int, help="threads for the run (default: odtrain's setting)")
    profile.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time (default), or the "
                         "process's CPU time, all threads summed: steadier on a busy machine, blind to parallel speed-up")
    profile.add_argument("--top", type=int, default=15, help="nodes listed, the slowest first (default: 15)")
    profile.add_argument("--json", action="store_true", help="print every node and op type as JSON (times in ms)")


PROFILE = Command(
    "profile", help="show where a training step's time goes",
    description=("Run the training step at --batch-size with a clock around each kernel call and report the time per"
                 " node and per op type, for the forward pass, the backward pass and the optimizer; the matrix "
                 "products' time and GF/s against this machine's float32 GEMM peak (measured here, at 1 thread and "
                 "at the step's and the machine's thread counts). The parameters train during the run; the "
                 "checkpoint file is not written."),
    arguments=_profile_arguments, run=_profile)
