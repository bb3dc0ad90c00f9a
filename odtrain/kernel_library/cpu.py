"""The CPU a kernel library runs on: its architecture, the features its code may use, and whether this CPU has them.

- `TARGETS`: an architecture (`x86_64`, `aarch64`, as Linux names it) and its LLVM triple (Linux, glibc).
- `FLAGS`: how Linux names the LLVM features that matter to the kernels' code (/proc/cpuinfo's `flags`
  on x86, `Features` on aarch64), and, where /proc/cpuinfo does not describe the CPU the process runs on
  (qemu's user mode shows the host's), the aarch64 hardware capability bits (`getauxval(AT_HWCAP)`),
  which always do.

Device-side: standard library only (a device loads a library with numpy and ctypes alone). The build
tool's own facts (named CPUs, C compilers) are in odtrain/library_build/targets.py.
"""
from __future__ import annotations

import ctypes
import platform

TARGETS = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}
DEFAULT_CPU = {"aarch64": "cortex-a72"}  # a Raspberry Pi 4's core (a Pi 5's: cortex-a76)
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


def host_arch() -> str:
    """This machine's architecture, as TARGETS names it."""
    machine = platform.machine().lower()
    return {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)


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
