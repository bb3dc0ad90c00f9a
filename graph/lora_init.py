"""The seeded initial values of LoRA adapters, in numpy alone.

A LoRA adapter of a weight W (in_features inputs, out_features outputs) is a pair
    A [in_features, rank], Kaiming-uniform as PEFT initialises it (a = √5, so bound = 1/√in_features)
    B [rank, out_features], zeros,
so that W + (alpha/rank)·A·B starts equal to W. A's values depend only on the seed and the weight's
name (its UTF-8 bytes join the seed), not on which other weights are adapted or in which order.

This module imports numpy only and nothing of the package, so that a script outside odtrain (the
PyTorch golden generator in benchmarks/decoders) loads it by path and draws the same values.
"""
from __future__ import annotations

import numpy as np


def lora_a(weight_name: str, in_features: int, rank: int, seed: int) -> np.ndarray:
    """A [in_features, rank] float32, uniform in ±1/√in_features, drawn from (seed, the name's bytes)."""
    rng = np.random.default_rng([int(seed), *weight_name.encode("utf-8")])
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(in_features, rank)).astype(np.float32)


def lora_b(rank: int, out_features: int) -> np.ndarray:
    """B [rank, out_features] float32 zeros."""
    return np.zeros((rank, out_features), dtype=np.float32)
