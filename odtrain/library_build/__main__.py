"""`python -m odtrain.library_build SPEC OUT`: the build process that `link.build` starts (a fresh process, in
which no kernel was compiled or loaded from Numba's cache)."""
import sys

from .link import build_here

build_here(sys.argv[1], sys.argv[2])
