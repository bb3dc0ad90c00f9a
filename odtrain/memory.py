"""What a training session holds in memory, predicted from its buffers and plans.

    report = odtrain.memory.report(module)
    print(report.render())

Counted: the flat parameter buffer, the gradient buffer, the optimizer's
moment buffers, and for each bound plan (one per input shape, train and
eval) its arena and the constants folded for it. `training_bytes` is what
training adds on top of a loaded checkpoint: everything but the parameters.
The Python, numpy and Numba runtime (imports and loaded kernels) is the
process's floor and is not part of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass
class PlanMemory:
    mode: str  # "train" or "eval"
    shapes: tuple
    arena_bytes: int
    lower_bound: int
    constant_bytes: int
    recomputed_nodes: int


@dataclass
class MemoryReport:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    plans: list[PlanMemory] = field(default_factory=list)

    @property
    def arena_bytes(self) -> int:
        return sum(p.arena_bytes for p in self.plans)

    @property
    def training_bytes(self) -> int:
        """Bytes training adds to a loaded checkpoint: gradients, optimizer state, arenas, folded constants."""
        return self.gradient_bytes + self.optimizer_bytes + sum(p.arena_bytes + p.constant_bytes for p in self.plans)

    def render(self) -> str:
        lines = [f"parameters        {self.parameter_bytes / MIB:10.2f} MiB",
                 f"gradients         {self.gradient_bytes / MIB:10.2f} MiB",
                 f"optimizer state   {self.optimizer_bytes / MIB:10.2f} MiB"]
        for p in self.plans:
            shapes = ", ".join(f"{name}{list(shape)}" for name, shape in p.shapes)
            extra = f", {p.recomputed_nodes} nodes recomputed" if p.recomputed_nodes else ""
            lines.append(f"{p.mode:<5} arena       {p.arena_bytes / MIB:10.2f} MiB  (lower bound "
                         f"{p.lower_bound / MIB:.2f} MiB, {p.arena_bytes / max(p.lower_bound, 1):.3f}x; {shapes}{extra})")
        lines.append(f"training adds     {self.training_bytes / MIB:10.2f} MiB to the loaded checkpoint")
        return "\n".join(lines)


def report(module) -> MemoryReport:
    """The memory of a Module and of the plans it has bound so far (run a step of each shape first)."""
    state = module._state
    store = state._store
    optimizer = state._optimizer
    result = MemoryReport(
        parameter_bytes=store.flat.nbytes + sum(a.nbytes for a in store.others.values()),
        gradient_bytes=store.grad_flat.nbytes,
        optimizer_bytes=sum(m.nbytes for m in optimizer.moments.values()) if optimizer else 0)
    sessions = [("train", module._train)] + ([("eval", module._eval)] if module._eval is not None else [])
    for mode, session in sessions:
        for signature, bound in session.plans.items():
            shapes = tuple(item for item in signature if isinstance(item, tuple))
            result.plans.append(PlanMemory(mode, shapes, bound.plan.arena_bytes, bound.plan.lower_bound,
                                           bound.constant_bytes, bound.recomputed))
    return result
