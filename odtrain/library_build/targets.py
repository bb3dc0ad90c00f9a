"""The machines a kernel library is built for: triples, CPUs, the CPU features their code may use, C compilers.

- `TARGETS`: an architecture (`x86_64`, `aarch64`, as Linux names it) and its LLVM triple (Linux, glibc).
- A CPU: the host build takes Numba's (this machine's CPU and features). A build for a named CPU takes
  one of `CPUS`: each with the LLVM features that the kernels' code may use on it. LLVM gives some cores
  more (crc, crypto) that float kernels never emit, and a Raspberry Pi 4's cortex-a72 has no crypto
  extension: only the listed features are recorded in the manifest and checked on the device.
- How a device reads its own CPU's features, and checks a library's against them, is device-side
  (odtrain/kernel_library/cpu.py).
- The C compiler that links the library: `$CC` or `cc` for the host's architecture; for another one,
  ODTRAIN_CROSS_CC, else `CROSS_CC`'s (for aarch64, `aarch64-linux-gnu-gcc` from Debian's
  gcc-aarch64-linux-gnu, which brings the arm64 libgomp the launcher's OpenMP needs).

Imports the device side's CPU facts (odtrain/kernel_library/cpu.py); llvmlite only inside the functions that
emit code.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil

from ..kernel_library.cpu import host_arch

DEVICE_CORES = {"aarch64": 4}  # the thread count a device of this architecture runs at (every Pi since the 2)
CROSS_CC_ENV = "ODTRAIN_CROSS_CC"
CROSS_CC = {"aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),  # (command, Debian's package)
            "x86_64": ("x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu")}
_V8_2 = "+fp-armv8,+neon,+fullfp16,+rdm,+lse,+rcpc,+dotprod"
CPUS = {
    "aarch64": {"generic": "+fp-armv8,+neon", "cortex-a53": "+fp-armv8,+neon", "cortex-a72": "+fp-armv8,+neon",
                "cortex-a55": _V8_2, "cortex-a76": _V8_2, "neoverse-n1": _V8_2},
    "x86_64": {"x86-64": "+sse2", "x86-64-v2": "+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt",
               "x86-64-v3": "+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2"},
}
class NoCompiler(Exception):
    """No C compiler for the target was found; the message says what to install."""


def cpu_features(target: str, cpu: str) -> str:
    """The LLVM features of a named CPU that the library's code may use; ValueError names the known CPUs."""
    known = CPUS.get(target, {})
    if cpu not in known:
        raise ValueError(f"no CPU '{cpu}' known for {target}: choose one of {', '.join(known)}")
    return known[cpu]


def c_compiler(target: str) -> list[str]:
    """The command that compiles and links C for `target`; NoCompiler says what to install."""
    if target == host_arch():
        return shlex.split(os.environ.get("CC", "cc"))
    named = os.environ.get(CROSS_CC_ENV, "").strip()
    if named:
        return shlex.split(named)
    command, package = CROSS_CC[target]
    if shutil.which(command):
        return [command]
    raise NoCompiler(
        f"no C compiler for {target} on this {host_arch()} machine: the kernel library's launcher links with one. "
        f"Install Debian's or Ubuntu's cross compiler (`apt-get install {package}`, which brings "
        f"{target}'s libgomp), or name another in {CROSS_CC_ENV} (a command that compiles and links for "
        f"{target}-linux-gnu with -fopenmp)")


def without_host_cpu(ir_text: str) -> str:
    """LLVM IR without the functions' CPU attributes (the build machine's CPU and features), so that the
    target machine's CPU and features apply."""
    return re.sub(r' ?"(?:target-cpu|target-features|tune-cpu)"="[^"]*"', "", ir_text)


def target_machine(triple: str, cpu: str, features: str):
    """llvmlite's target machine for position-independent code at O3."""
    from llvmlite import binding as llvm

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    target = llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features, opt=3, reloc="pic", codemodel="default")


def _pass_builder(machine):
    """llvmlite's pass builder at Numba's JIT settings: O3, loop vectorisation on, SLP vectorisation off."""
    from llvmlite import binding as llvm

    options = llvm.create_pipeline_tuning_options(speed_level=3)
    options.loop_vectorization = True
    options.slp_vectorization = False
    return llvm.create_pass_builder(machine, options)


def optimise_functions(module, machine) -> None:
    """The function passes on each function of one kernel's module, before it is linked (as Numba runs them
    on each module it adds; the linked module's code runs faster for it: benchmarks/README.md,
    "Figures moved out of the code")."""
    builder = _pass_builder(machine)
    passes = builder.getFunctionPassManager()
    for function in module.functions:
        if not function.is_declaration:
            passes.run(function, builder)


def optimise(module, machine) -> None:
    """The module passes, once, on the linked module (a second run measured no faster)."""
    builder = _pass_builder(machine)
    builder.getModulePassManager().run(module, builder)
