import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

DATA = pathlib.Path(__file__).parent / "data"

# The suite runs the JIT's kernels: the kernel modules hold Numba's dispatchers from the start, so that the
# kernels a test imports by name are the ones the bindings return (kernels/jit.py)
from odtrain.kernels.jit import load as _load_compiler  # noqa: E402

_load_compiler()


def reference_model(name: str):
    """(forward.onnx path, meta dict, golden npz) of a model exported from PyTorch, kept in tests/data."""
    folder = DATA / name
    return folder / "forward.onnx", json.loads((folder / "meta.json").read_text()), np.load(folder / "golden.npz")


def reference_artifacts(name: str, directory, optimizer: str = "AdamW"):
    """Cross-entropy artifacts of a reference model, with its meta.json's trainable and frozen parameters,
    written to `directory` (returned)."""
    from odtrain import artifacts

    path, meta, _ = reference_model(name)
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=directory)
    return directory


@pytest.fixture(scope="session")
def mlp_reference():
    return reference_model("mlp")


@pytest.fixture(scope="session")
def mlp_artifacts(tmp_path_factory, mlp_reference):
    """AdamW artifacts of the reference MLP, with the logits as an additional output."""
    from odtrain import artifacts

    path, meta, _ = mlp_reference
    directory = tmp_path_factory.mktemp("mlp_artifacts")
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory, additional_output_names=["output"])
    return directory


@pytest.fixture(scope="session")
def mlp_kernel_library(tmp_path_factory):
    """The reference MLP's AdamW artifacts with a kernel library in kernels/ built for them at threads 1 and 2,
    holding the demo's kernels too (what `pip install .` builds for it). A build costs tens of seconds, so the
    modules that need this library share one; they read the folder and copy it before changing anything."""
    from odtrain import kernel_library
    from odtrain.library_build import compile_artifacts

    folder = reference_artifacts("mlp", tmp_path_factory.mktemp("mlp-library"))
    compile_artifacts([folder, None], folder / kernel_library.FOLDER, thread_counts=(1, 2), out=lambda line: None)
    return folder


def odtrain_main(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command line `odtrain argv`; argparse's exits become exit codes."""
    from odtrain import cli

    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
