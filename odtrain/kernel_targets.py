"""The machines a kernel library is built for: triples, CPUs, the CPU features their code may use, C compilers.

- `TARGETS`: an architecture (`x86_64`, `aarch64`, as Linux names it) and its LLVM triple (Linux, glibc).
- A CPU: the host build takes Numba's (this machine's CPU and features). A build for a named CPU takes
  one of `CPUS`: each with the LLVM features that the kernels' code may use on it. LLVM gives some cores
  more (crc, crypto) that float kernels never emit, and a Raspberry Pi 4's cortex-a72 has no crypto
  extension: only the listed features are recorded in the manifest and checked on the device.
- `FLAGS`: how Linux names those features (/proc/cpuinfo's `flags` on x86, `Features` on aarch64), and,
  where /proc/cpuinfo does not describe the CPU the process runs on (qemu's user mode shows the host's),
  the aarch64 hardware capability bits (`getauxval(AT_HWCAP)`), which always do.
- The C compiler that links the library: `$CC` or `cc` for the host's architecture; for another one,
  ODTRAIN_CROSS_CC, else `CROSS_CC`'s (for aarch64, `aarch64-linux-gnu-gcc` from Debian's
  gcc-aarch64-linux-gnu, which brings the arm64 libgomp the launcher's OpenMP needs).

Imports nothing of odtrain's; llvmlite only inside the functions that emit code.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import shlex
import shutil

TARGETS = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}
DEFAULT_CPU = {"aarch64": "cortex-a72"}  # a Raspberry Pi 4's core (a Pi 5's: cortex-a76)
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
FLAGS = {  # LLVM's name of a feature that matters to the kernels' code -> Linux's
    "x86_64": {"sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
               "bmi": "bmi1", "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
               "avx512vl": "avx512vl", "avx512cd": "avx512cd", "avx512vnni": "avx512_vnni",
               "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "popcnt": "popcnt"},
    "aarch64": {"fp-armv8": "fp", "neon": "asimd", "fullfp16": "asimdhp", "rdm": "asimdrdm", "lse": "atomics",
                "rcpc": "lrcpc", "dotprod": "asimddp", "sve": "sve", "sve2": "sve2", "i8mm": "i8mm", "bf16": "bf16"},
}
# Linux's aarch64 hardware capability bits (asm/hwcap.h): AT_HWCAP, then AT_HWCAP2
_HWCAP = {"fp": 0, "asimd": 1, "aes": 3, "pmull": 4, "sha1": 5, "sha2": 6, "crc32": 7, "atomics": 8, "fphp": 9,
          "asimdhp": 10, "asimdrdm": 12, "lrcpc": 15, "asimddp": 20, "sve": 22}
_HWCAP2 = {"sve2": 1, "i8mm": 13, "bf16": 14}
_AT_HWCAP, _AT_HWCAP2 = 16, 26


class NoCompiler(Exception):
    """No C compiler for the target was found; the message says what to install."""


def host_arch() -> str:
    """This machine's architecture, as TARGETS names it."""
    machine = platform.machine().lower()
    return {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)


def cpu_features(target: str, cpu: str) -> str:
    """The LLVM features of a named CPU that the library's code may use; ValueError names the known CPUs."""
    known = CPUS.get(target, {})
    if cpu not in known:
        raise ValueError(f"no CPU '{cpu}' known for {target}: choose one of {', '.join(known)}")
    return known[cpu]


def cpu_flags(arch: str | None = None) -> set[str] | None:
    """This CPU's feature flags as Linux names them, or None where they cannot be read."""
    arch = arch or host_arch()
    key = {"x86_64": "flags", "aarch64": "Features"}.get(arch)
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if key and line.startswith(key):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if arch == "aarch64":
        try:
            getauxval = ctypes.CDLL(None).getauxval
        except (OSError, AttributeError):
            return None
        getauxval.restype = ctypes.c_ulong
        getauxval.argtypes = [ctypes.c_ulong]
        words = getauxval(_AT_HWCAP), getauxval(_AT_HWCAP2)
        return {name for word, bits in zip(words, (_HWCAP, _HWCAP2)) for name, bit in bits.items() if word >> bit & 1}
    return None


def missing_features(arch: str, features: str, flags: set[str]) -> list[str]:
    """The LLVM features of `features` (a '+a,+b' string) that matter to the code and that `flags` lacks."""
    names = FLAGS.get(arch, {})
    return [f[1:] for f in features.split(",") if f[:1] == "+" and f[1:] in names and names[f[1:]] not in flags]


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
    on each module it adds; the linked module's code measured ~5% faster for it)."""
    builder = _pass_builder(machine)
    passes = builder.getFunctionPassManager()
    for function in module.functions:
        if not function.is_declaration:
            passes.run(function, builder)


def optimise(module, machine) -> None:
    """The module passes, once, on the linked module (a second run measured no faster)."""
    builder = _pass_builder(machine)
    builder.getModulePassManager().run(module, builder)
