"""Convolution, pooling, batch normalization, image activations (Clip, LeakyRelu, HardSigmoid, HardSwish), Dropout, Pad, Resize."""
from __future__ import annotations
