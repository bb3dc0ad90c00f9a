"""The mutation audit: small deliberate bugs, one at a time; each must fail at least one test.

    python tests/mutants.py                               # every mutant against the whole suite
    python tests/mutants.py --list                        # the mutants and what each breaks
    python tests/mutants.py --run-mutants sgd-lr,format-tag -- tests/test_api.py tests/test_checkpoint.py

How it runs:
- Each run (the unmutated baseline first, then one per mutant) gets a scratch copy of the checkout:
  the files git tracks or would track, as they are on disk, and the Numba cache beside the kernels,
  so that kernels the mutant leaves alone load instead of compiling. The checkout itself is never
  written; the copy is deleted afterwards.
- A mutant is one exact text replacement in one file; a text that is not found exactly once is
  reported as stale and nothing runs.
- pytest runs in the copy (`-p no:cacheprovider`, the copy first on PYTHONPATH so that subprocesses
  import it too, the kernel cache in the copy) and writes a JUnit report. A mutant's killing tests
  are those that fail or error with it and pass in the baseline.

Prints one row per mutant (its killing tests, or SURVIVED); exit code 1 if a mutant survives, 2 if
a mutant is stale.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOWN_KILLERS = 6  # a row lists this many killing tests, then a count of the others


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    path: str  # relative to the checkout
    find: str
    replace: str


MUTANTS = [
    Mutant("sgd-lr", "SGD's learning rate 1% too high", "kernels/optim.py",
           "def sgd_update(w, g, lr):\n    rate = np.float32(lr)\n",
           "def sgd_update(w, g, lr):\n    rate = np.float32(lr * 1.01)\n"),
    Mutant("adamw-lr", "AdamW's learning rate 1% too high", "kernels/optim.py",
           "def adamw_update(w, g, m, v, lr, beta1, beta2, eps, weight_decay, step, bias_correction):\n",
           "def adamw_update(w, g, m, v, lr, beta1, beta2, eps, weight_decay, step, bias_correction):\n"
           "    lr = lr * 1.01\n"),
    Mutant("adamw-bias-correction", "AdamW without bias correction", "kernels/optim.py",
           "    return lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)\n",
           "    return lr\n"),
    Mutant("relu-gradient", "Relu's gradient passes every incoming gradient", "graph/ops/elementwise.py",
           '"Relu": Unary(lambda x: np.maximum(x, 0), gradient="Y")',
           '"Relu": Unary(lambda x: np.maximum(x, 0), gradient=lambda g: g.GO(0))'),
    Mutant("in-place-liveness", "the planner writes in place over an input that is still to be read",
           "graph/planner.py", "if g.end == step and g.nbytes", "if g.nbytes"),
    Mutant("checksum", "the checkpoint's checksum is not checked", "odtrain/checkpoint.py",
           '    if metadata.get("sha256") != _digest(tensors, covered):\n', "    if False:\n"),
    Mutant("format-tag", "the checkpoint's format tag is not checked", "odtrain/checkpoint.py",
           'if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:',
           "if not isinstance(metadata, dict):"),
    Mutant("checkpoint-fsync", "a checkpoint's temporary file is renamed before its bytes are on the disk",
           "odtrain/checkpoint.py", "            f.flush()\n            os.fsync(f.fileno())\n",
           "            f.flush()\n"),
    Mutant("format-version", "a newer checkpoint format version is not refused as newer", "odtrain/checkpoint.py",
           "    if version.isdigit() and int(version) > FORMAT_VERSION:\n", "    if False:\n"),
    Mutant("dequantized-row-scale", "a stored int8 weight's per-row scale read from its panel's first row",
           "kernels/stored_weights.py", "s = scale[first + i] if per_index else scale[0]",
           "s = scale[first] if per_index else scale[0]"),
    Mutant("dequantized-panel-sum", "a product over stored rows keeps only its last panel",
           "kernels/stored_weights.py", "0.0 if first == r0 else 1.0", "0.0"),
    # what a user's run would hit: each of these once survived the suite
    Mutant("prepared-call-strides", "a kernel library's prepared call reused for a view of other strides",
           "odtrain/kernel_library/abi.py", 'interface["shape"], interface["strides"]))', 'interface["shape"]))'),
    Mutant("prepared-call-dtype", "a kernel library's prepared call reused for a view of another dtype",
           "odtrain/kernel_library/abi.py", 'key.append((interface["data"], interface["typestr"], interface["shape"]',
           'key.append((interface["data"], interface["shape"]'),
    Mutant("tuple-record-order", "a kernel library packs a tuple argument's items in reverse",
           "odtrain/kernel_library/abi.py", "return [word for item in value for word in _record(item)]",
           "return [word for item in value[::-1] for word in _record(item)]"),
    Mutant("vocabulary-row-max", "the fused vocabulary loss's row maximum misses the last column",
           "kernels/training.py", "    for c in range(1, classes):\n        top = max(top, logits[base + c])\n    picked",
           "    for c in range(1, classes - 1):\n        top = max(top, logits[base + c])\n    picked"),
    Mutant("vocabulary-ignore-index-0", "the fused vocabulary loss ignores no label when ignore_index is 0",
           "kernels/training.py",
           "    ignore = np.int64(ignore_index) if ignore_index is not None else np.int64(-(2 ** 62))\n    return chunk",
           "    ignore = np.int64(ignore_index) if ignore_index else np.int64(-(2 ** 62))\n    return chunk"),
    Mutant("vocabulary-loss-gradient", "the fused vocabulary loss's weight gradient ignores dLoss",
           "kernels/training.py",
           "    rows = labels.shape[0]\n    g = dloss[0] * _unit_weight(labels, ignore_index, classes, mean)\n    for first",
           "    rows = labels.shape[0]\n    g = _unit_weight(labels, ignore_index, classes, mean)\n    for first"),
    Mutant("stored-gather-bounds", "DequantizedGather reads the row past the last", "kernels/dequantized.py",
           "        if k < 0 or k >= rows:\n            raise ValueError(\"an index is outside the gathered axis\")",
           "        if k < 0 or k > rows:\n            raise ValueError(\"an index is outside the gathered axis\")"),
    Mutant("int8-second-moment-map", "8-bit second moments convert to float32 through the signed code map",
           "odtrain/optimizer_update.py", "blocks, CODE_MAPS[min(index, 1)], values[name])", "blocks, CODE_MAPS[0], values[name])"),
    Mutant("int8-block-max-sign", "an 8-bit step's block absmax is the largest first moment, not magnitude",
           "kernels/optim.py", "            m_top, v_top = max(m_top, abs(mi)), max(v_top, vi)",
           "            m_top, v_top = max(m_top, mi), max(v_top, vi)"),
    Mutant("recompute-random", "a clone recomputes a Dropout whose output nothing keeps", "graph/recompute.py",
           "if v in arena_values and v not in kept and recomputable(n)}", "if v in arena_values and v not in kept}"),
    Mutant("recompute-product", "the default recomputation reruns a product as cheap", "graph/recompute.py",
           "    if opdef.random or opdef.flops is not None or opdef.window_reads is not None or opdef.updates:",
           "    if opdef.random or opdef.window_reads is not None or opdef.updates:"),
    Mutant("recompute-state", "a recomputed BatchNormalization moves its running statistics again",
           "graph/recompute.py", "            if not out or index in updates:", "            if not out:"),
    Mutant("idft-one-sided-odd", "the one-sided inverse DFT counts a Nyquist bin at an odd length",
           "kernels/signal.py", "weight = np.where((j == 0) | (2 * j == length), 1.0, 2.0) / length",
           "weight = np.where((j == 0) | (j == length // 2), 1.0, 2.0) / length"),
    Mutant("idft-longer", "an inverse DFT longer than its input wraps its angles at the input's rows",
           "kernels/signal.py", "    theta = (1 if inverse else -1) * 2 * np.pi * ((j * k) % length) / length",
           "    theta = (1 if inverse else -1) * 2 * np.pi * ((j * k) % rows) / length"),
    Mutant("external-alignment", "an external tensor at an offset of 4 mod 8 is mapped unaligned", "graph/onnx_io.py",
           "    if count == 0 or offset % dtype.itemsize:", "    if count == 0 or offset % 4:"),
    Mutant("library-schedule", "the library's parallel schedule skips the last part when parts = threads",
           "odtrain/library_build/launcher.c", "(d < (uintptr_t)length ? 1 : 0)", "(d + 1 < (uintptr_t)length ? 1 : 0)"),
    Mutant("lora-module-path", "a LoRA target named by its exact module path matches nothing", "graph/lora.py",
           '\n                       + [n.scope.rsplit("/", 1)[0] for n in nodes if "/" in n.scope])', ")"),
    Mutant("dropout-one-stream", "two Dropout nodes draw from one stream", "odtrain/executor.py",
           "return f\"{node.outputs[0]}\\0{int(node.attrs.get('seed', 0))}\".encode()",
           "return f\"{int(node.attrs.get('seed', 0))}\".encode()"),
    Mutant("dropout-resume", "a checkpoint does not keep where the random streams stand", "odtrain/api.py",
           "        if state._random.any():", "        if False:"),
    Mutant("resume-fewer-epochs", "a resume with fewer epochs than done rewrites the run as finished",
           "odtrain/training.py", '    if resume and int(settings["epochs"]) < int(properties["epoch"]):', "    if False:"),
    Mutant("checkpoint-mode", "a checkpoint keeps its temporary file's 0600 mode", "odtrain/checkpoint.py",
           "            os.chmod(tmp, 0o666 & ~_umask())", "            pass"),
    Mutant("check-foreign-op", "odtrain check exits 2 (a user error) for a model with a foreign op", "odtrain/cli/prepare.py",
           "    except UnsupportedOpError as error:  # ops of a foreign domain",
           "    except ZeroDivisionError as error:  # ops of a foreign domain"),
    Mutant("broken-pipe", "a closed pipe on stdout ends a command with 'error: Broken pipe'", "odtrain/cli/__init__.py",
           "    except BrokenPipeError:  # stdout's reader left", "    except ZeroDivisionError:  # stdout's reader left"),
    Mutant("library-error-twice", "a library kernel's data error is worded twice (graph name, advice)",
           "odtrain/executor.py", "        except InputError:  # a library call's, already worded (_stopped)\n            raise\n",
           ""),
    Mutant("label-message", "a label outside the classes through the API names no sample, label or count",
           "odtrain/api.py", "                raise self._label_error(arrays, plan.types) or error from None", "                raise"),
    Mutant("one-channel-norm", "a 1-channel BatchNormalization's scale and bias are left out of training",
           "graph/parameters.py", "size == 1 and not _is_weight(name, consumers):", "size == 1:"),
    Mutant("stale-build", "pip install . packs a stale library when the new build fails", "setup.py",
           "        shutil.rmtree(target, ignore_errors=True)\n        if not builds_library():",
           "        if not builds_library():"),
    Mutant("compile-interrupt", "Ctrl-C during odtrain compile reaches the build process too",
           "odtrain/library_build/link.py", "env=environment, start_new_session=True)", "env=environment)"),
    Mutant("first-step-interrupt", "Ctrl-C while the first step compiles waits for the step and a save",
           "odtrain/training.py", "        self.at_once = True\n", "        self.at_once = False\n"),
    # the third round: each of these once survived the suite
    Mutant("library-batch-1", "a kernel library recorded without batch 1 (a batch-1 step's calls go missing)",
           "odtrain/library_build/record.py", "    batches = sorted({1, int(batch_size)})",
           "    batches = sorted({int(batch_size)})"),
    Mutant("library-digest-checkpoint", "a library's artifacts digest covers the checkpoint (refused after a save)",
           "odtrain/kernel_library/digest.py", "    for name in DIGESTED_MODELS:\n",
           "    for name in DIGESTED_MODELS + (\"checkpoint\",):\n"),
    Mutant("library-disabled-features", "a library's disabled CPU features (-avx512f) counted as required",
           "odtrain/kernel_library/cpu.py", 'if f[:1] == "+" and f[1:] in names', 'if f[:1] in "+-" and f[1:] in names'),
    Mutant("compile-advice-target", "odtrain compile's advice drops --target on a device that needs it",
           "odtrain/kernel_library/messages.py", 'target = f" --target {here}" if here in DEFAULT_CPU else ""',
           'target = f" --target {here}" if here not in DEFAULT_CPU else ""'),
    Mutant("update-precheck-serial", "the optimizer's pre-check asks for the serial update at any thread count",
           "odtrain/optimizer_update.py",
           "    _, (kernel, args) = update_calls(config, weights, grads, moments, 0.0, 1, threads, blocks)",
           "    (kernel, args), _ = update_calls(config, weights, grads, moments, 0.0, 1, threads, blocks)"),
    Mutant("int4-odd-last-value", "a 4-bit tensor of an odd size loses its last value", "graph/int4.py",
           "    if nibbles.size % 2:\n        out[pairs] = nibbles[-1]\n", ""),
    Mutant("int4-empty-transposed-product", "a transposed 4-bit product over zero columns leaves the arena's bytes",
           "kernels/stored_weights.py",
           "    if trans_b and c1 == c0:\n        for i in range(m):\n            out[i * rows + r0:i * rows + r1] = 0\n",
           ""),
    Mutant("int4-nominal-odd", "a nominal checkpoint's odd-sized 4-bit weight refused with a ValueError",
           "odtrain/checkpoint.py", "PackedInt4(np.zeros((int(np.prod(shape)) + 1) // 2, np.uint8)",
           "PackedInt4(np.zeros(int(np.prod(shape)) // 2, np.uint8)"),
    Mutant("int4-run-start", "int4_blocks starts a run of rows inside a block (odd block, odd width)",
           "graph/int4.py", "    step = max(unit, step // unit * unit)\n",
           "    step = max(block, step // block * block) if axis == 0 else step\n"
           "    step += step % 2 if columns % 2 else 0\n"),
    Mutant("cgroup-unified", "a cgroup v2 limit under /sys/fs/cgroup/unified (a hybrid host) ignored",
           "odtrain/allocation.py", 'mounts, files = (root, os.path.join(root, "unified")), _CGROUP_V2',
           "mounts, files = (root,), _CGROUP_V2"),
    Mutant("cgroup-limit-as-room", "a cgroup's limit taken for the room instead of its limit less its use",
           "odtrain/allocation.py", "found = (max(0, limit - usage), f\"this container's", "found = (limit, f\"this container's"),
    Mutant("cgroup-shmem", "a cgroup's shared memory (tmpfs) counted as reclaimable page cache",
           "odtrain/allocation.py", '- stat.get("file_mapped", 0) - stat.get("shmem", 0)', '- stat.get("file_mapped", 0)'),
    Mutant("auto-arena-held", "memory_budget=\"auto\" at a second shape counts the arena already held as used",
           "odtrain/api.py", "                                                         self.arena.nbytes if self.arena is not None else 0)",
           "                                                         0)"),
    Mutant("label-at-class-count", "a label equal to the class count is not named with its sample", "odtrain/api.py",
           "outside = (labels < 0) | (labels >= classes)", "outside = (labels < 0) | (labels > classes)"),
    Mutant("fusion-ignore-index-0", "the vocabulary-loss fusion drops ignore_index=0 (read as a truth value)",
           "graph/fusion.py", '    if node.attrs.get("ignore_index") is not None:\n        attrs["ignore_index"]',
           '    if node.attrs.get("ignore_index"):\n        attrs["ignore_index"]'),
    # damaged files and recovery
    Mutant("checkpoint-previous", "a checkpoint save keeps nothing of the checkpoint it replaces", "odtrain/checkpoint.py",
           "            if keep:\n                keep_previous(path)\n", ""),
    Mutant("checkpoint-recovery-advice", "a damaged checkpoint's refusal does not name the kept previous one",
           "odtrain/checkpoint.py", "    if os.path.isfile(previous):\n        return (f\"the save before it",
           "    if False:\n        return (f\"the save before it"),
    Mutant("library-missing-symbol", "a manifest naming a symbol its shared object lacks raises AttributeError",
           "odtrain/kernel_library/loader.py",
           "            except (KeyError, AttributeError, ValueError) as error:  # a damaged manifest",
           "            except ValueError as error:  # a damaged manifest"),
    Mutant("unknown-attribute", "an attribute name its op does not define reaches the rules and kernels",
           "graph/onnx_io.py",
           '        unknown = unknown_attributes(n.op_type, attrs) if n.domain in (DEFAULT_DOMAIN, "ai.onnx") else []',
           "        unknown = []"),
    Mutant("dangling-name", "a value no node computes, read by a node or output, is found only when planned",
           "graph/onnx_io.py", "    _check_names(graph.nodes, graph.inputs, graph.initializers, graph.outputs, source)\n",
           ""),
    Mutant("wav-rate-bounds", "a WAV declaring 1 Hz or 4 GHz is resampled (gigabytes from kilobytes)", "odtrain/audio.py",
           "if channels < 1 or not MIN_RATE <= rate <= MAX_RATE:", "if channels < 1 or rate < 1:"),
    Mutant("npz-declared-size", "an .npz array's inflated shape is allocated before it is read", "odtrain/data_loading.py",
           "            for name in archive.files:\n                _check_member_size(archive, name)\n", ""),
    Mutant("update-serial-fallback", "an update whose parallel twin the library lacks stops after the gradients",
           "odtrain/optimizer_update.py", "        parts = call\n    with thread_policy", "        pass\n    with thread_policy"),
    Mutant("auto-shortfall", "an auto budget no plan meets tells the user to raise a budget they never gave",
           "odtrain/api.py", "                plan = planned(auto_shortfall(error.smallest_bytes, budget))",
           "                raise"),
    Mutant("broken-pipe-flush", "a closed pipe met at the exit's flush of buffered stdout prints a traceback",
           "odtrain/cli/__init__.py",
           "        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush\n", ""),
    Mutant("clip-unapplied", "the optimizer measures the gradients' norm but updates from the unclipped gradients",
           "odtrain/api.py", "self._grad_norm = clip_gradients(store.grad_flat, self._max_grad_norm)",
           "self._grad_norm = clip_gradients(store.grad_flat.copy(), self._max_grad_norm)"),
    Mutant("clip-per-block", "gradient clipping reads the norm of the last block of values only",
           "odtrain/optimizer_update.py", "        total += float(np.square(grads[start:start + CLIP_BLOCK]",
           "        total = float(np.square(grads[start:start + CLIP_BLOCK]"),
    Mutant("ladder-budget", "the last recomputation pass aims below the budget, so the smallest it names is not met",
           "graph/recompute.py", "aim=int(evenly_spaced * share)", "aim=int(budget * share)"),
]


def stale(mutant: Mutant, root: Path = ROOT) -> str | None:
    """Why `mutant` cannot be applied to the checkout at `root`, or None."""
    source = root / mutant.path
    if not source.is_file():
        return f"{mutant.path} does not exist"
    count = source.read_text().count(mutant.find)
    return None if count == 1 else f"its text occurs {count} times in {mutant.path}, not once"


def _checkout_files(root: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    kernel_cache = [str(p.relative_to(root)) for p in (root / "kernels" / "__pycache__").glob("*.nb[ic]")]
    return [name for name in listed if name and (root / name).is_file()] + kernel_cache


def scratch_copy(root: Path = ROOT) -> Path:
    """A copy of the checkout in a new temporary folder (modification times kept: Numba's cache checks them)."""
    target = Path(tempfile.mkdtemp(prefix="odtrain-mutant-"))
    for name in _checkout_files(root):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target / name)
    return target


def run_tests(copy: Path, pytest_args: list[str], timeout: float) -> tuple[set[str], int, float]:
    """(ids of the tests that failed or errored, tests run, seconds) of pytest in `copy`."""
    report = copy / "mutants-junit.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("ODTRAIN_CACHE_DIR", "NUMBA_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    *pytest_args], cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=timeout)
    seconds = time.perf_counter() - start
    if not report.is_file():
        raise RuntimeError(f"pytest wrote no report in {copy} (collection failed?)")
    failed, total = set(), 0
    for case in ElementTree.parse(report).iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(_test_id(copy, case.get("classname", ""), case.get("name", "")))
    return failed, total, seconds


def _test_id(copy: Path, classname: str, name: str) -> str:
    """pytest's id of a JUnit test case: `tests.test_x.TestY` + `name` -> `tests/test_x.py::TestY::name`."""
    parts = classname.split(".")
    for split in range(len(parts), 0, -1):
        module = "/".join(parts[:split]) + ".py"
        if (copy / module).is_file():
            return "::".join([module, *parts[split:], name])
    return "::".join([*parts, name])


def audit(mutants: list[Mutant], pytest_args: list[str], timeout: float, out=print) -> dict[str, list[str]]:
    """Each mutant's killing tests (sorted; empty: it survived), after a baseline run."""
    copy = scratch_copy()
    try:
        baseline, total, seconds = run_tests(copy, pytest_args, timeout)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    out(f"baseline: {total} tests, {len(baseline)} failing without any mutant ({seconds:.0f} s)"
        + "".join(f"\n  {test}" for test in sorted(baseline)))
    killed = {}
    for mutant in mutants:
        copy = scratch_copy()
        try:
            source = copy / mutant.path
            source.write_text(source.read_text().replace(mutant.find, mutant.replace))
            failed, total, seconds = run_tests(copy, pytest_args, timeout)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        killed[mutant.name] = sorted(failed - baseline)
        out(f"{mutant.name}: {len(killed[mutant.name])} killing tests of {total} ({seconds:.0f} s)")
    return killed


def table(mutants: list[Mutant], killed: dict[str, list[str]]) -> str:
    rows = ["| mutant | what it breaks | killed by |", "|---|---|---|"]
    for mutant in mutants:
        tests = killed[mutant.name]
        shown = ", ".join(f"`{t}`" for t in tests[:SHOWN_KILLERS])
        more = f" and {len(tests) - SHOWN_KILLERS} more" if len(tests) > SHOWN_KILLERS else ""
        rows.append(f"| {mutant.name} | {mutant.breaks} | {f'{len(tests)}: {shown}{more}' if tests else 'SURVIVED'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run the suite against each mutant and report which tests kill it.",
                                     epilog="Arguments after `--` go to pytest (default: tests).")
    parser.add_argument("--run-mutants", metavar="NAMES", help="comma-separated mutant names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run (default: 3600)")
    parser.add_argument("--verbose", action="store_true", help="list every killing test, not the first few")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else ["tests"]
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:<24} {m.breaks} ({m.path})")
        return 0
    names = args.run_mutants.split(",") if args.run_mutants else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutants {unknown}; the mutants are {list(by_name)}")
    chosen = [by_name[n] for n in names]
    problems = {m.name: stale(m) for m in chosen if stale(m)}
    if problems:
        for name, problem in problems.items():
            print(f"{name}: stale mutant: {problem}", file=sys.stderr)
        return 2
    killed = audit(chosen, pytest_args, args.timeout)
    if args.verbose:
        for mutant in chosen:
            print(f"\n{mutant.name}:" + "".join(f"\n  {test}" for test in killed[mutant.name]))
    print()
    print(table(chosen, killed))
    return 1 if any(not tests for tests in killed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
