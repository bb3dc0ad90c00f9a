"""Time to the first training step in a new process, with and without `odtrain warmup` beforehand.

Each sample is a fresh interpreter (asv's timeraw_), timed from its first import to the end of the
first training step and optimizer step: imports, CheckpointState, Module, Optimizer, kernels compiled
(cold: an empty ODTRAIN_CACHE_DIR) or loaded (warm: a folder filled by `odtrain warmup` in setup),
the memory plan bound, one step. `timeraw_imports` is the floor no cache removes: numpy, scipy's BLAS
module (Numba's np.dot reaches BLAS through it), numba, onnx and odtrain.api.

Models: the reference MLP (tests/data/mlp, batch 64) and MobileNetV2 (tests/data/mobilenetv2_full,
batch 8) when its folder exists and every op it uses has a rule and a kernel; otherwise setup raises
NotImplementedError, which asv reports as skipped.
"""
import os
import subprocess
import sys

import numpy as np

from . import common

MODELS = {"mlp": 64, "mobilenetv2_full": 8}

CACHE_ENV_CODE = """
import os
os.environ.pop("NUMBA_CACHE_DIR", None)
os.environ["ODTRAIN_CACHE_DIR"] = {cache_dir!r}
"""

FIRST_STEP = """
import numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.artifact_paths import ArtifactPaths
paths = ArtifactPaths.of({artifacts!r})
state = CheckpointState.load_checkpoint(paths.checkpoint)
module = Module(paths.training_model, state, paths.eval_model)
optimizer = Optimizer(paths.optimizer_model, module)
batch = np.load({batch!r})
module(*[batch[name] for name in batch.files])
optimizer.step()
module.lazy_reset_grad()
"""

IMPORTS = """
import numpy
import scipy.linalg.cython_blas
import numba
import onnx
import odtrain.api
"""


class ColdStart:
    params = list(MODELS)
    param_names = ["model"]
    warmup_time = 0
    number = 1
    repeat = (1, 3, 120.0)
    timeout = 1800

    def setup(self, model):
        folder = common.model_dir(model)
        if not (folder / "forward.onnx").is_file() or not (folder / "meta.json").is_file():
            raise NotImplementedError(f"no reference model in {folder}")
        from odtrain import OdtrainError

        try:
            self.artifacts = common.artifacts(model)
        except OdtrainError as error:  # an op without a rule yet
            raise NotImplementedError(f"{model}: {error}") from None
        self.batch = self.artifacts / "first_batch.npz"
        if not self.batch.exists():
            from odtrain import trial_steps
            from odtrain.api import CheckpointState, Module
            from odtrain.artifact_paths import ArtifactPaths

            paths = ArtifactPaths.of(self.artifacts)
            state = CheckpointState.load_checkpoint(paths.checkpoint)
            module = Module(paths.training_model, state)
            meta = common.meta(model)  # MobileNetV2's file leaves its image size symbolic: meta.json gives it
            shape = [MODELS[model], *meta["input_shape"][1:]]
            inputs = trial_steps.zero_inputs(module, MODELS[model], input_shapes={meta["input_name"]: shape})
            rng = np.random.default_rng(common.SEED)
            for i, array in enumerate(inputs):  # random images, labels 0
                if array.dtype.kind == "f":
                    inputs[i] = rng.standard_normal(array.shape).astype(array.dtype)
            np.savez(self.batch, **{f"input{i}": a for i, a in enumerate(inputs)})
        self.warm_cache = self.artifacts / "kernel-cache-warm"
        if not self.warm_cache.exists():  # `odtrain warmup` in its own process fills the cache
            env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
            env["ODTRAIN_CACHE_DIR"] = str(self.warm_cache)
            meta = common.meta(model)
            shape = ",".join(str(d) for d in [MODELS[model], *meta["input_shape"][1:]])
            done = subprocess.run([sys.executable, "-m", "odtrain", "warmup", str(self.artifacts),
                                   "--batch-size", str(MODELS[model]), "--input-shape", f"{meta['input_name']}={shape}"],
                                  env=env, capture_output=True, text=True)
            if done.returncode == 2:  # a user-level error: an op without a kernel yet
                raise NotImplementedError(f"{model}: {done.stderr.strip()}")
            done.check_returncode()

    def _first_step(self, cache_dir):
        return (FIRST_STEP.format(artifacts=str(self.artifacts), batch=str(self.batch)),
                CACHE_ENV_CODE.format(cache_dir=str(cache_dir)))

    def timeraw_first_step_cold(self, model):
        """Empty kernel cache: every kernel compiles."""
        return self._first_step(common.scratch_dir("kernels-cold"))

    def timeraw_first_step_after_warmup(self, model):
        """Kernel cache filled by `odtrain warmup`: every kernel loads."""
        return self._first_step(self.warm_cache)


class ImportFloor:
    """The imports of a first step, in a fresh interpreter: the part a kernel cache does not remove."""

    warmup_time = 0
    number = 1
    repeat = (3, 10, 30.0)

    def timeraw_imports(self):
        return IMPORTS
