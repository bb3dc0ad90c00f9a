"""The keyword spotter's personalisation, timed: odtrain's, or PyTorch doing the same fine-tuning.

    python benchmarks/audio/personalise.py odtrain ARTIFACTS CLIPS [--epochs 10] [--batch-size 16]
    /work/torchref/bin/python benchmarks/audio/personalise.py torch benchmarks/audio/kws.pt CLIPS [--train-last 3]

Both train the same parameters (odtrain: what ARTIFACTS were prepared with; PyTorch: the last
--train-last layers with parameters, as `odtrain prepare --train-last` picks them) with AdamW at the same
learning rate, in training mode (BatchNorm's running statistics update), on the clips of CLIPS in the same
batches, and print one line: samples, the median step time after the first epoch, the whole loop's time,
the time of the epochs after the first (warm), and the process's peak RSS. The first epoch compiles or
loads kernels; pair the two under `farm-bench --vs` for whole-process figures.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np


def _report(system: str, samples: int, steps: list, epochs: list) -> None:
    warm = steps[len(steps) // len(epochs):] or steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{system}: {samples} clips, step median {1000 * float(np.median(warm)):.1f} ms, epochs 2-{len(epochs)} "
          f"{sum(epochs[1:]):.2f} s, all {sum(epochs):.2f} s, peak RSS {peak:.0f} MiB")


def _odtrain(args) -> None:
    from odtrain.audio import AudioSource
    from odtrain.training import Session

    session = Session(args.model)
    data = session.dataset(AudioSource(args.clips))
    module, optimizer = session.module, session.optimizer
    module.train()
    order = np.random.default_rng(0).permutation(len(data))
    steps, epochs = [], []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for batch in data.batches(args.batch_size, order):
            begin = time.perf_counter()
            module(*batch)
            optimizer.step()
            module.lazy_reset_grad()
            steps.append(time.perf_counter() - begin)
        epochs.append(time.perf_counter() - start)
    _report("odtrain", len(data), steps, epochs)


def _torch(args) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from train_kws import KeywordSpotter, load

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = KeywordSpotter()
    model.load_state_dict(torch.load(args.model))
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    trainable = [p for m in layers[-args.train_last:] for p in m.parameters(recurse=False)]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, eps=1e-6, weight_decay=0.0)  # odtrain prepare's defaults
    x, y = load(args.clips)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    model.train()
    steps, epochs = [], []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for first in range(0, len(y), args.batch_size):
            batch = order[first:first + args.batch_size]
            begin = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps.append(time.perf_counter() - begin)
        epochs.append(time.perf_counter() - start)
    _report("pytorch", len(y), steps, epochs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("odtrain", "torch"))
    parser.add_argument("model", help="odtrain: the artifact folder; torch: the state dict (kws.pt)")
    parser.add_argument("clips")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-last", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.003)
    args = parser.parse_args(argv)
    (_odtrain if args.system == "odtrain" else _torch)(args)


if __name__ == "__main__":
    main()
