"""Kernels: Softmax, LogSoftmax and LayerNormalization."""
from __future__ import annotations
