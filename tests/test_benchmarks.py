"""Every benchmark of the asv suite (benchmarks/benchmarks) runs: its setup and its body once, at every
parameter, as `asv run --quick` would, so that a benchmark broken by a change in the code it measures fails
the test suite instead of going unnoticed. Benchmarks run in this process, sharing its kernel cache; a
`timeraw_` benchmark's code runs in a fresh interpreter, as asv runs it. A setup that declines with
NotImplementedError, which asv reports as skipped, fails here: every reference model the suite measures is in
tests/data and supported. Nothing is timed.

This is cheaper than `asv run --quick` (one process per benchmark, each importing Numba and binding its model
again) and needs no asv machine file. One case is left out to keep the suite's time down: ColdStart on
mobilenetv2_full compiles every MobileNetV2 kernel twice from an empty cache in child processes (about ten
minutes on two loaded cores); ColdStart on mlp runs the same code, and the model's kernels are exercised by
tests/test_vision.py and the bench_ops cases."""
import importlib.util
import inspect
import itertools
import pathlib
import subprocess
import sys
import textwrap

import pytest

SUITE = pathlib.Path(__file__).parent.parent / "benchmarks" / "benchmarks"
KINDS = ("time_", "timeraw_", "track_", "peakmem_", "mem_")
LEFT_OUT = {("ColdStart", ("mobilenetv2_full",)): "two cold compiles of MobileNetV2; ColdStart['mlp'] runs the same code"}


def _suite():
    """The suite's package, imported under a name of its own (its modules import each other relatively)."""
    spec = importlib.util.spec_from_file_location("odtrain_asv_suite", SUITE / "__init__.py",
                                                  submodule_search_locations=[str(SUITE)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return {path.stem: importlib.import_module(f"{spec.name}.{path.stem}") for path in sorted(SUITE.glob("bench_*.py"))}


def _parameter_sets(cls) -> list[tuple]:
    params = getattr(cls, "params", [])
    if not params:
        return [()]
    if len(getattr(cls, "param_names", [])) <= 1 and not isinstance(params[0], list):
        params = [params]
    return list(itertools.product(*params))


def _cases():
    cases = []
    for module_name, module in _suite().items():
        for class_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or class_name.startswith("_"):
                continue
            methods = sorted(name for name in dir(cls) if name.startswith(KINDS))
            for args in _parameter_sets(cls) if methods else []:
                reason = LEFT_OUT.get((class_name, tuple(args)))
                cases.append(pytest.param(cls, args, methods, id=f"{module_name}.{class_name}{list(args)}",
                                          marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return cases


_setup_caches = {}


def _run_timeraw(code) -> None:
    """asv's timeraw_: the returned code (or (code, setup code)) in a fresh interpreter, setup first."""
    code, setup = (code, "") if isinstance(code, str) else code
    script = textwrap.dedent(setup) + "\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("cls, args, methods", _cases())
def test_the_benchmark_runs(cls, args, methods):
    prefix = ()
    if hasattr(cls, "setup_cache"):
        if cls not in _setup_caches:
            _setup_caches[cls] = cls().setup_cache()
        prefix = (_setup_caches[cls],)
    benchmark = cls()
    if hasattr(benchmark, "setup"):
        benchmark.setup(*prefix, *args)  # NotImplementedError fails the test, as it should here
    try:
        for name in methods:
            result = getattr(benchmark, name)(*prefix, *args)
            if name.startswith("timeraw_"):
                _run_timeraw(result)
            elif name.startswith("track_"):
                assert isinstance(result, (int, float)) and result == result, (name, result)
    finally:
        if hasattr(benchmark, "teardown"):
            benchmark.teardown(*prefix, *args)
