"""A kernel library for another machine: an aarch64 object built here, its link when a cross compiler exists,
and the CPU features a library's manifest names, checked where it loads.

The object holds four kernels (serial, parallel, a BLAS product, one that raises), built from Numba's
NUMBA_OPT=0 IR in a fresh process and optimised by llvmlite for a Raspberry Pi 4's cortex-a72 (~10 s).
"""
import ctypes
import ctypes.util
import os
import struct

import pytest

from odtrain.kernel_library import cpu
from odtrain.library_build import link, targets
from odtrain.graph.errors import ArgumentError
from odtrain.kernel_library import refusal_of

ENTRIES = [
    ("odtrain.kernels.elementwise:_unary", "int64,float32[1C],float32[1C]"),
    ("odtrain.kernels.elementwise:_unary_parts", "int64,float32[1C],float32[1C],int64[1C]"),
    ("odtrain.kernels.linalg:_gemm_batched", "float32[1C],float32[1C],float32[1C],int64,int64,int64,int64,int64,"
     "int64,int64,int64,int64[1C],int64[1C],int64[1C],float32[1C],float32"),
    ("odtrain.kernels.training:_class_loss", "float32[3C],int64[2C],float32[1C],bool,int64,int64,bool,float32[1C],"
     "float32[3C],bool"),
]
EM_AARCH64, ET_REL, ET_DYN = 183, 1, 3


def elf_symbols(data: bytes):
    """(file type, machine, {name: (defined, global)}) of a little-endian ELF64 file's symbol table."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a little-endian ELF64 file"
    kind, machine = struct.unpack_from("<HH", data, 16)
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    symbols = {}
    for _, section_type, _, _, offset, size, linked, _, _, _ in sections:
        if section_type != 2:  # SHT_SYMTAB
            continue
        strings = sections[linked][4]
        for at in range(offset + 24, offset + size, 24):  # the first entry is the null symbol
            name_at, info, _, index = struct.unpack_from("<IBBH", data, at)
            name = data[strings + name_at:data.index(b"\0", strings + name_at)].decode()
            if name:
                symbols[name] = (index != 0, info >> 4 == 1)  # SHN_UNDEF, STB_GLOBAL
    return kind, machine, symbols


@pytest.fixture(scope="module")
def aarch64_object(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aarch64")
    manifest = link.build(ENTRIES, folder, out=lambda line: None, target="aarch64", object_only=True)
    return folder, manifest


def test_an_aarch64_object_needs_only_the_launcher_the_error_path_and_the_c_library(aarch64_object):
    folder, manifest = aarch64_object
    assert manifest["triple"] == "aarch64-unknown-linux-gnu" and manifest["cpu"] == "cortex-a72"
    assert not manifest["skipped"]
    kind, machine, symbols = elf_symbols((folder / link.OBJECT_FILE).read_bytes())
    assert (kind, machine) == (ET_REL, EM_AARCH64)
    exported = {name for name, (defined, visible) in symbols.items() if defined and visible}
    assert exported == {e["symbol"] for e in manifest["entries"]}  # the wrappers only; the rest is internal
    undefined = {name for name, (defined, _) in symbols.items() if not defined}
    c_library = ctypes.CDLL(None), ctypes.CDLL(ctypes.util.find_library("m"))
    stubs = set(manifest["stubs"]["functions"]) | set(manifest["stubs"]["data"])
    unexpected = {n for n in undefined - link.LAUNCHER_SYMBOLS - stubs
                  if not any(hasattr(library, n) for library in c_library)}
    assert not unexpected, unexpected
    assert {"numba_parallel_for", "odtrain_cblas_sgemm"} <= undefined  # the parallel kernel, the product


def test_the_aarch64_object_links_with_a_cross_compiler(aarch64_object, tmp_path):
    folder, manifest = aarch64_object
    try:
        compiler = targets.c_compiler("aarch64")
    except targets.NoCompiler as missing:
        pytest.skip(f"no cross compiler here: {missing}")
    library = tmp_path / "library.so"
    link.link((folder / link.OBJECT_FILE).read_bytes(), manifest, compiler, str(library))
    kind, machine, symbols = elf_symbols(library.read_bytes())
    assert (kind, machine) == (ET_DYN, EM_AARCH64)
    assert {"odtrain_run", "odtrain_set_gemm"} | {e["symbol"] for e in manifest["entries"]} <= set(symbols)


def test_a_missing_cross_compiler_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv(targets.CROSS_CC_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    other = "aarch64" if cpu.host_arch() != "aarch64" else "x86_64"
    package = targets.CROSS_CC[other][1]
    with pytest.raises(ArgumentError, match=f"apt-get install {package}.*{targets.CROSS_CC_ENV}"):
        link.build(ENTRIES, tmp_path / "out", target=other)
    with pytest.raises(ArgumentError, match="cortex-a72, .*cortex-a76"):
        link.build(ENTRIES, tmp_path / "out", target="aarch64", cpu="cortex-a99", object_only=True)


def test_a_library_for_cpu_features_the_device_lacks_is_refused_by_name(aarch64_object, monkeypatch):
    _, manifest = aarch64_object
    here = cpu.host_arch()
    named = "cortex-a76" if here == "aarch64" else "x86-64-v3"
    features = targets.cpu_features(here, named)
    library = {**manifest, "triple": cpu.TARGETS[here], "cpu": named, "features": features}
    monkeypatch.setattr("odtrain.kernel_library.loader.cpu_flags", lambda arch=None: set(cpu.FLAGS[here].values()))
    assert refusal_of(library) == ""
    lacking = set(cpu.FLAGS[here].values()) - {cpu.FLAGS[here][features.split(",")[-1][1:]]}
    monkeypatch.setattr("odtrain.kernel_library.loader.cpu_flags", lambda arch=None: lacking)
    assert refusal_of(library) == f"built for {named}: CPU features {features.split(',')[-1][1:]}, which this CPU lacks"
    # what a Raspberry Pi 4 says (no crypto extension): a cortex-a72 library loads
    pi4 = {"fp", "asimd", "evtstrm", "crc32", "cpuid"}
    assert cpu.missing_features("aarch64", targets.cpu_features("aarch64", "cortex-a72"), pi4) == []
    assert cpu.missing_features("aarch64", targets.cpu_features("aarch64", "cortex-a76"), pi4) == [
        "fullfp16", "rdm", "lse", "rcpc", "dotprod"]
