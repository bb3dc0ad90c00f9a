"""Recurrent layers: GRU and LSTM, with backpropagation through time."""
from __future__ import annotations
