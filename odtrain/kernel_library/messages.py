"""What the kernel library says to a user: the command that builds a library, and the one line of a step
that cannot run without one.

Where Numba is not installed (a device), a step whose kernels no library holds cannot run: the executor raises
KernelsUnavailableError before the step's first call, in one line that names why there is no library
(`without_library`, from the loader's `unavailable`) or the node, kernel and argument types the library lacks
(`missing_kernel`), and the `odtrain compile` command that builds them (`compile_command`). Where Numba is
installed, the kernels a library lacks compile through it, said once (`report_missing`).

Wording only: the loader (odtrain/kernel_library/loader.py) decides; this module says it. Standard library
and this package's ABI and CPU facts only.
"""
from __future__ import annotations

import os

from .abi import FOLDER, kernel_name, signature_of
from .cpu import DEFAULT_CPU, host_arch


def compile_command(artifact_folder) -> str:
    """The command that builds the library of `artifact_folder` for this machine, run where Numba is (the
    desktop, for another architecture)."""
    here = host_arch()
    target = f" --target {here}" if here in DEFAULT_CPU else ""
    folder = os.fspath(artifact_folder) if artifact_folder is not None else "ARTIFACT_DIR"
    return f"`odtrain compile {folder}{target}` (on a machine with odtrain's dependencies; its kernels/ folder " \
           f"then goes to {os.path.join(folder, FOLDER)} here)"


def without_library(why: str, artifact_folder) -> str:
    """The one line of a step that has no library (`why`) and no Numba, and what builds the library."""
    return (f"{why}, and Numba is not installed to compile the kernels instead: build the library with "
            f"{compile_command(artifact_folder)}")


def missing_kernel(where: str, kernel, args, library, artifact_folder, others: int = 0) -> str:
    """The one line of a call that `library` (a loaded KernelLibrary) lacks where Numba is not installed."""
    more = f" (and {others} more call{'s' if others != 1 else ''} it lacks)" if others else ""
    return (f"{where}: kernel {kernel_name(kernel)}({signature_of(args)}) is not in the kernel library "
            f"{library.folder}{more}, and Numba is not installed to compile it: rebuild the library with "
            f"{compile_command(artifact_folder)}")


def damaged_artifacts_record(folder: str, artifact_folder) -> str:
    """Why an artifact folder's own library is refused: its manifest's record of artifacts is damaged."""
    return (f"{folder}: damaged manifest (its 'artifacts' is not a list of records); rebuild it with "
            f"{compile_command(artifact_folder)}")


def built_for_other_artifacts(folder: str, built_for: str, artifact_folder) -> str:
    """Why an artifact folder's own library is refused: it was recorded on other artifacts (`built_for`)."""
    return (f"{folder}: built for other artifacts ({built_for}; their models differ from these): rebuild it with "
            f"{compile_command(artifact_folder)}")


_reported: set = set()  # (kernel name, signature) already said to compile through Numba in this process


def report_missing(calls) -> None:
    """Say once, on stderr and in the progress bar drawn now (odtrain.progress.announce), how many kernels of
    these calls (which a library lacks) compile through Numba."""
    from ..jit.ahead import FALLBACK_MESSAGE
    from ..progress import announce

    new = {(kernel_name(k) or repr(k), signature_of(a)) for k, a in calls if hasattr(k, "py_func")} - _reported
    if new:
        _reported.update(new)
        announce(f"odtrain: {FALLBACK_MESSAGE.format(count=len(new))}")
