"""Training the reference MLP (784-500-10, ReLU, cross-entropy, AdamW).

MLPTraining: one warm training step (forward, loss, backward, optimizer update),
one eval step, peak memory, and the size of the planned memory arena.
MLPColdStart: a fresh process from `import` to the first completed training
step, with the Numba cache empty (cold) or filled by an earlier process (warm).
"""
import subprocess
import sys

import numpy as np

from . import common

MODEL = "mlp"
FEATURES, CLASSES = 784, 10
WARMUP_STEPS = 2


class MLPTraining:
    params = [16, 64, 256]
    param_names = ["batch"]

    def setup(self, batch):
        self.module, self.optimizer = common.open_training(common.artifacts(MODEL))
        self.x, self.y = common.classification_batch(batch, FEATURES, CLASSES)
        for _ in range(WARMUP_STEPS):  # compiles or loads the kernels, binds the plans
            self._train_step()
            self._eval_step()

    def _train_step(self):
        self.module(self.x, self.y)
        self.optimizer.step()
        self.module.lazy_reset_grad()

    def _eval_step(self):
        self.module.eval()
        self.module(self.x, self.y)
        self.module.train()

    def time_train_step(self, batch):
        self._train_step()

    def time_eval_step(self, batch):
        self._eval_step()

    def peakmem_train_step(self, batch):
        self._train_step()

    def track_arena_bytes(self, batch):
        return common.last_plan(self.module).arena_bytes

    track_arena_bytes.unit = "bytes"

    def track_arena_over_lower_bound(self, batch):
        """Arena size over its lower bound, the most bytes live at any one step (1.0: no placement waste)."""
        plan = common.last_plan(self.module)
        return plan.arena_bytes / max(plan.lower_bound, 1)

    track_arena_over_lower_bound.unit = "ratio"


FIRST_STEP = """
import os
os.environ["NUMBA_CACHE_DIR"] = {cache_dir!r}
import numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.artifact_paths import ArtifactPaths
paths = ArtifactPaths.of({artifacts!r})
state = CheckpointState.load_checkpoint(paths.checkpoint)
module = Module(paths.training_model, state, paths.eval_model)
optimizer = Optimizer(paths.optimizer_model, module)
batch = np.load(paths.directory + "/batch.npz")
module(batch["x"], batch["y"])
optimizer.step()
module.lazy_reset_grad()
"""


class MLPColdStart:
    """Seconds from a fresh interpreter to the first completed step at batch 64: imports, checkpoint,
    Module, Optimizer, kernel compilation (cold) or cache loading (warm), one step.
    The artifacts and the batch are written beforehand, by setup in the parent process."""

    warmup_time = 0
    repeat = (2, 5, 30.0)
    timeout = 300

    def setup(self):
        self.artifacts = common.artifacts(MODEL)
        if not (self.artifacts / "batch.npz").exists():
            x, y = common.classification_batch(64, FEATURES, CLASSES)
            np.savez(self.artifacts / "batch.npz", x=x, y=y)
        self.warm_cache = self.artifacts / "numba-cache-warm"
        if not self.warm_cache.exists():  # one process that compiles and fills the cache
            subprocess.run([sys.executable, "-c", self._first_step(self.warm_cache)], check=True)

    def _first_step(self, cache_dir):
        return FIRST_STEP.format(cache_dir=str(cache_dir), artifacts=str(self.artifacts))

    def timeraw_first_step_cold_cache(self):
        return self._first_step(common.scratch_dir("numba-cold"))

    def timeraw_first_step_warm_cache(self):
        return self._first_step(self.warm_cache)
