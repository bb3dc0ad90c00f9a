"""Federated learning with odtrain: devices train locally, a server averages their model differences.

- `averaging` (its names are this package's): the arithmetic on flat parameter buffers in plain numpy,
  no Flower needed: a client's training round, differences, FedAvg, clipping and Gaussian noise, a
  non-IID split of a dataset by label;
- `flower`: the same rounds run by Flower's ClientApp and ServerApp (`pip install "odtrain[flower]"`);
- `demo` and `rounds`: `odtrain federated`, the demo classifier averaged across simulated devices by
  one of three engines, and what those engines share (the data split, the per-round line, the files).
"""
from .averaging import (Trainer, add_gaussian_noise, apply_difference, clip_update, difference, evaluate, fedavg,
                        get_parameters, join_arrays, open_artifacts, parameter_layout, partition_by_label, privatize,
                        set_parameters, split_buffer, train_local)

__all__ = ["Trainer", "add_gaussian_noise", "apply_difference", "clip_update", "difference", "evaluate", "fedavg",
           "get_parameters", "join_arrays", "open_artifacts", "parameter_layout", "partition_by_label", "privatize",
           "set_parameters", "split_buffer", "train_local"]
