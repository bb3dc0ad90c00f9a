"""LoRA as users configure it: `LoraConfig`, the weights its patterns name, and the adapters' file.

The graph rewrite (adapters into the forward graph, merged back into the weights for export) is
odtrain.graph.lora; this module turns a user's configuration into the weights it adapts, refusing
patterns that match nothing and named weights that cannot be adapted.
"""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field

import numpy as np

from .graph.errors import ArgumentError, ModelError
from .graph.lora import SUFFIX_A, SUFFIX_B, adaptable, matrices, reading_nodes, scales
from .graph.wording import name_list


@dataclass
class LoraConfig:
    """LoRA adapters of rank `rank` on the weights matching `target_params` (names or glob patterns), their
    update scaled by alpha/rank; `seed` draws the A matrices (odtrain.graph.lora_init)."""

    rank: int = 8
    alpha: float = 16.0
    target_params: list[str] = field(default_factory=lambda: ["*"])
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise ArgumentError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ArgumentError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if isinstance(self.target_params, str) or not self.target_params:
            raise ArgumentError("LoRA target_params must be a non-empty list of names or glob patterns")

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)


def target_weights(graph, config: LoraConfig) -> list[str]:
    """The weights `config` adapts, in graph order. A pattern names a matrix, or a node that reads one (its
    MatMul or Gemm, or the Transpose before it), and must match some matrix; a weight named exactly must be
    adaptable, while a glob skips matrices that are not product weights (an embedding)."""
    candidates = matrices(graph)
    reasons = adaptable(graph, candidates)
    readers = reading_nodes(graph, candidates)
    chosen = []
    for pattern in config.target_params:
        matched = [n for n in candidates if fnmatch.fnmatchcase(n, pattern)
                   or any(fnmatch.fnmatchcase(node, pattern) for node in readers[n])]
        if not matched:
            raise ArgumentError(_unmatched(pattern, candidates, reasons))
        for name in matched:
            if isinstance(reasons[name], str):
                if pattern == name:
                    raise ModelError(f"LoRA target '{name}' cannot be adapted: {reasons[name]}")
                continue
            chosen.append(name)
    if not chosen:
        raise ArgumentError(f"LoRA targets {config.target_params} match no weight that feeds a MatMul or Gemm")
    return [n for n in candidates if n in chosen]


def _unmatched(pattern: str, candidates: list[str], reasons) -> str:
    """Why `pattern` matches nothing, and what to write instead: examples of weight names and of the names
    of the products that read them."""
    if not candidates:
        return f"LoRA target '{pattern}' matches nothing: the model has no 2-D floating-point weight"
    products = [n for n in candidates if not isinstance(reasons[n], str)]
    weights = name_list(products or candidates)
    nodes = name_list([reasons[n][0].scope or reasons[n][0].name for n in products])
    return (f"LoRA target '{pattern}' matches no 2-D weight and no node that reads one. Name the weights (glob "
            f"patterns such as '*q_proj*' match either), e.g. weights: {weights}"
            + (f"; or the MatMul/Gemm nodes that read them (names or module paths): {nodes}" if products else ""))


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B)


def write_adapters(path, tensors: dict[str, np.ndarray], graph) -> dict[str, float]:
    """Write trained adapter tensors (safetensors; each adapted weight's alpha/rank in the metadata). Returns the
    scales."""
    import safetensors.numpy

    from .checkpoint import write_atomically  # whole or not at all, with a new file's mode (save_file's is 0600)

    adapted = scales(graph)
    write_atomically(os.fspath(path), safetensors.numpy.save({n: np.ascontiguousarray(v) for n, v in tensors.items()},
                                                             metadata={"format": "odtrain LoRA adapters",
                                                                       "scales": json.dumps(adapted)}))
    return adapted
