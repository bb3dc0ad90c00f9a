"""The kernel library: odtrain's kernels built ahead of time into one shared object, loaded with ctypes.

`odtrain compile` (odtrain/library_build/) writes a folder `kernels/` beside the artifacts, holding the shared
object and its manifest. A training process finds the library for its artifact folder, checks that it may
load it, and runs each step's calls inside it in one foreign call, the GIL released. One module per job:

- odtrain/kernel_library/abi.py: what crosses into the library: the folder's file names, a kernel's name and
  its arguments' signature, and the packed argument blocks of a step's calls (`pack`, `CallList`,
  `PreparedCall`);
- odtrain/kernel_library/loader.py: the manifest's checks and the refusals they give (`refusal_of`), a loaded
  library (`KernelLibrary`), and the library for an artifact folder (`find`);
- odtrain/kernel_library/messages.py: what a user reads: the `odtrain compile` command that builds a library
  and the one line of a step that cannot run without it;
- odtrain/kernel_library/digest.py: the digest of an artifact folder's models that a library records;
- odtrain/kernel_library/cpu.py: this CPU's architecture and features.

The names below are the ones the rest of odtrain imports from the package. Imports numpy and ctypes only, so
that a training process with a library never loads the compiler.
"""
from __future__ import annotations

from .abi import (FOLDER, LIBRARY_ENV, LIBRARY_FILE, MANIFEST_FILE, CallList, PreparedCall, argument_type, call_key,
                  kernel_name, pack, signature_of)
from .cpu import cpu_flags, host_arch, missing_features
from .digest import artifacts_digest
from .loader import (KernelLibrary, LibraryRefused, compiler_installed, find, forget, installed_version, library_folder_of,
                     refusal_of, unavailable)
from .messages import compile_command, missing_kernel, report_missing

__all__ = ["FOLDER", "LIBRARY_ENV", "LIBRARY_FILE", "MANIFEST_FILE", "CallList", "PreparedCall", "argument_type",
           "call_key", "kernel_name", "pack", "signature_of", "cpu_flags", "host_arch", "missing_features",
           "artifacts_digest", "KernelLibrary", "LibraryRefused", "compiler_installed", "find", "forget", "installed_version",
           "library_folder_of", "refusal_of", "unavailable", "compile_command", "missing_kernel", "report_missing"]
