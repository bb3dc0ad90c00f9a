"""The fused element-wise chain: a node that only a bound step holds (graph/elementwise_fusion.py makes it
once types are bound), never an artifact on disk, so it has no gradient rule and its type rule is never asked
for; its kernel is kernels/fused_elementwise.py's.

Every output may overwrite any input of its size: the kernel reads each point's inputs before it writes that
point's outputs, and no point reads another's.
"""
from __future__ import annotations

from .registry import ODTRAIN_DOMAIN, op

FUSED_OP = "FusedElementwise"
MAX_OUTPUTS, MAX_INPUTS = 8, 32  # the in-place pairs the planner may use (a chain has fewer in practice)


@op(FUSED_OP, ODTRAIN_DOMAIN, inplace=tuple((o, i) for o in range(MAX_OUTPUTS) for i in range(MAX_INPUTS)))
def _fused_types(node, types, consts):
    raise NotImplementedError(f"{node.describe()}: a fused node is made in a bound step, where every type is known")
