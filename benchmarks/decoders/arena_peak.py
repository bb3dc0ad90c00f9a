"""What a training step's arena holds at its peak: the values alive then, largest first, and why each is kept.

    python arena_peak.py ARTIFACT_DIR [--batch 4 --seq 128 --top 25 --memory-budget BYTES]

Binds the training step as a first call at that shape would (no step runs), finds the step of the plan
where the most arena bytes are alive, and prints, for each value alive there: its bytes, the op that
wrote it, and the nodes that read it after the peak (backward nodes: the reason it is kept). Then the
same bytes summed by (writer op, first later reader op), which names the kinds of saved activations.
"""
from __future__ import annotations

import argparse
import os
from collections import defaultdict

from odtrain.graph.ops import lookup

MIB = 1024 * 1024


def alive_at_peak(step):
    """(peak step, live bytes there, [(value, bytes, writer node, readers after the peak)]) of an ExecutableStep."""
    plan, order = step.plan, step.step_plan.order
    profile = plan.live_profile()
    peak = int(profile.argmax())
    writer = {o: node for node in order for o in node.outputs if o}
    readers = defaultdict(list)
    for index, node in enumerate(order, start=1):
        shape_only = lookup(node).shape_only
        for k, name in enumerate(node.inputs):
            if name and index > peak and k not in shape_only:  # contents read, not only the shape
                readers[name].append(node)
    rows = []
    for group in plan.groups:
        if not group.start <= peak <= group.end:
            continue
        members = [m for m in group.values if plan.written.get(m, group.start) <= peak]
        value = max(members, key=lambda m: plan.written.get(m, group.start)) if members else group.values[0]
        later = [r for m in group.values for r in readers.get(m, [])]
        rows.append((value, group.nbytes, writer.get(value), later))
    rows.sort(key=lambda row: -row[1])
    return peak, int(profile[peak]), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--memory-budget", type=int, default=None)
    args = parser.parse_args(argv)
    from odtrain.api import CheckpointState, Module

    state = CheckpointState.load_checkpoint(os.path.join(args.artifacts, "checkpoint"))
    module = Module(os.path.join(args.artifacts, "training_model.onnx"), state, memory_budget=args.memory_budget)
    step = module.executable_step_at(args.batch, True, args.seq)
    plan = step.plan
    peak, live, rows = alive_at_peak(step)
    print(f"arena {plan.arena_bytes / MIB:.1f} MiB, lower bound {plan.lower_bound / MIB:.1f} MiB, "
          f"peak at step {peak} of {plan.steps} ({step.step_plan.order[peak - 1].op_type if peak else '-'}): "
          f"{live / MIB:.1f} MiB in {len(rows)} values; recomputed nodes {step.recomputed}")
    for value, nbytes, node, later in rows[:args.top]:
        reads = ", ".join(sorted({r.op_type for r in later})) or "(graph output)"
        print(f"{nbytes / MIB:9.2f} MiB  {(node.op_type if node else 'feed'):<22} {value[:60]:<60} read by {reads}")
    kinds = defaultdict(lambda: [0, 0])
    for value, nbytes, node, later in rows:
        key = (node.op_type if node else "feed", later[0].op_type if later else "(output)")
        kinds[key][0] += nbytes
        kinds[key][1] += 1
    print("\nby writer -> first later reader:")
    for (made, read), (nbytes, count) in sorted(kinds.items(), key=lambda item: -item[1][0]):
        print(f"{nbytes / MIB:9.2f} MiB  {count:4d} x  {made:<22} -> {read}")


if __name__ == "__main__":
    main()
