"""The install's build step besides copying the sources: the library of the demo's kernels.

`pip install .` builds the kernels that `odtrain demo` runs (its training, eval and optimizer steps and
its inference check: odtrain.library_build.compile_artifacts without artifacts) with Numba and the
system's C compiler into odtrain/data/kernels/ of the package it installs (odtrain.demo.LIBRARY), so
that the demo compiles nothing at run time. That is 12 kernels: about 20 s here, a few minutes on a
Raspberry Pi; any other model's library is built where its artifacts are prepared (`odtrain compile`,
`odtrain prepare --compile`).

The build needs what the kernels need, so the project's own dependencies (pyproject.toml, one list)
are this step's build requirements too (setup_requires, which setuptools' backend hands to pip).
The package, with its library, is then specific to this machine kind (the wheel says so).

Skipped, with a line saying why, for an editable install, when ODTRAIN_BUILD_LIBRARY=0, or when the
build fails (no C compiler, for one): the demo's kernels then compile through Numba on first use. A
library left in a reused build/ by an earlier install is removed first, so it is never packed instead.
With ODTRAIN_BUILD_LIBRARY=0 the distribution holds no native code and its wheel is pure Python
(`py3-none-any`): the wheel a device of another architecture installs (`ODTRAIN_BUILD_LIBRARY=0 pip
wheel --no-deps .`), its kernels coming from a library built for it (`odtrain compile --target`).
"""
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.config.pyprojecttoml import read_configuration
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_SWITCH = "ODTRAIN_BUILD_LIBRARY"
BUILD = "import sys; from odtrain.library_build import compile_artifacts; compile_artifacts(None, sys.argv[1])"


class BuildWithLibrary(build_py):
    """build_py, then the demo's kernel library into the package being built."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the sources stay where they are; `odtrain compile -o odtrain/data/kernels` builds it there
        package = os.path.abspath(self.build_lib)
        target = os.path.join(package, "odtrain", "data", "kernels")
        # an earlier install's library in a reused build/ must not be packed when this one is not built
        shutil.rmtree(target, ignore_errors=True)
        if not builds_library():
            print(f"odtrain: {BUILD_SWITCH}=0: the demo's kernel library is not built", file=sys.stderr)
            return
        with tempfile.TemporaryDirectory(prefix="odtrain-build-cache-") as cache:
            paths = [package, *filter(None, [os.environ.get("PYTHONPATH")])]  # pip's build environment: kept
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1",
                       ODTRAIN_CACHE_DIR=cache)
            env.pop("NUMBA_CACHE_DIR", None)  # Numba's cache goes to the scratch folder, not into the package
            try:
                subprocess.run([sys.executable, "-c", BUILD, target], cwd=package, env=env, check=True)
            except (OSError, subprocess.CalledProcessError) as error:
                shutil.rmtree(target, ignore_errors=True)  # nor what the failed build left
                print(f"odtrain: the demo's kernel library was not built ({error}); `odtrain demo` compiles its "
                      "kernels through Numba on first use instead", file=sys.stderr)


def builds_library() -> bool:
    """Whether this build makes the demo's native library (ODTRAIN_BUILD_LIBRARY is not 0)."""
    return os.environ.get(BUILD_SWITCH, "1").strip() != "0"


class MachineSpecific(Distribution):
    """A package that holds a native library has its wheel tagged for this platform; without the library
    (ODTRAIN_BUILD_LIBRARY=0) it is pure Python."""

    def has_ext_modules(self):
        return builds_library()


# the library's build needs what the kernels need; a pure build needs nothing besides setuptools
setup(cmdclass={"build_py": BuildWithLibrary}, distclass=MachineSpecific,
      setup_requires=read_configuration(os.path.join(HERE, "pyproject.toml"))["project"]["dependencies"]
      if builds_library() else [])
