"""Rehearsal: base samples mixed into every batch of new ones, so that learning the new does not erase the old.

    fit("artifacts", "new.npz", val=["new-val.npz", "base-val.npz"], replay="base.npz", replay_share=0.25)

- An epoch is still one pass over the new data, in fit's order and batches;
  to each batch of B new samples, `round(B * share / (1 - share))` base
  samples are added, so that base samples are `share` of every batch (a
  batch of 32 new samples at share 0.25 trains on 43: 32 new, 11 base).
- The base samples of a batch are drawn without replacement from the
  replay set by a generator seeded with the run's seed, the batch's
  position in the epoch and the first new sample's index in it: the same
  batch gets the same base samples, so a resumed run repeats the
  uninterrupted one's batches exactly.
- The epoch's loss, sample count and samples/s count the new samples
  (`new_samples`); the loss of a step is the batch's mean, base samples
  included.
"""
from __future__ import annotations

import numpy as np

from .graph.errors import ArgumentError

DEFAULT_SHARE = 0.25
_STREAM = 0x5EA1  # keeps the replay draws apart from the epoch orders seeded by [seed, epoch]


def replay_count(batch: int, share: float) -> int:
    """Base samples added to a batch of `batch` new ones so that they are `share` of it (at least one)."""
    return max(1, int(round(batch * share / (1.0 - share))))


class ReplayMix:
    """The training set with base samples mixed into each batch; stands where fit uses a Dataset."""

    def __init__(self, new, base, share: float = DEFAULT_SHARE, seed: int = 0):
        if not 0.0 < share < 1.0:
            raise ArgumentError(f"the replay share is the fraction of each batch drawn from the base data: give a "
                                f"number between 0 and 1 (exclusive), got {share}")
        if [(s.name, s.is_label) for s in new.inputs] != [(s.name, s.is_label) for s in base.inputs]:
            raise ArgumentError(f"the replay data {base.source} does not feed the same inputs as the training data")
        self.new, self.base, self.share, self.seed = new, base, float(share), int(seed)
        self.inputs, self.source, self.classes = new.inputs, new.source, new.classes
        self.last_new = 0

    def __len__(self) -> int:
        return len(self.new)

    @property
    def labels(self):
        return self.new.labels

    def batches(self, batch_size: int, order=None, start: int = 0):
        """fit's batches of new samples, each with its share of base samples appended."""
        order = np.arange(len(self.new)) if order is None else order
        for index, batch in enumerate(self.new.batches(batch_size, order, start), start):
            first = int(order[index * batch_size])
            rng = np.random.default_rng([self.seed, _STREAM, index, first])
            wanted = min(replay_count(len(batch[0]), self.share), len(self.base))
            picked = np.sort(rng.choice(len(self.base), size=wanted, replace=False))
            self.last_new = len(batch[0])
            yield [np.concatenate([new, base]) for new, base in zip(batch, self.base.take(picked))]

    def new_samples(self, batch) -> int:
        """How many of the last batch yielded are new samples (fit asks right after receiving it)."""
        return self.last_new


def new_samples(train_set, batch) -> int:
    """The new samples of a training batch: all of them, unless `train_set` mixes in replayed ones."""
    return train_set.new_samples(batch) if isinstance(train_set, ReplayMix) else len(batch[0])
