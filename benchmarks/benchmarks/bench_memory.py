"""What a training process holds: the runtime floor, and what training adds on the reference models.

RuntimeFloor: RSS of a fresh process after `import odtrain.api` and `odtrain.jit.load()`
(Numba's CPU target and BLAS), total and anonymous (the private part; the rest is library code
mapped from disk).
TrainingMemory: per reference model (tests/data), from one fresh process each run by
`benchmarks/memory.py` (kernels loaded first by a warm-up session, so the runtime is not counted):
the RSS training adds, the memory report's prediction over it, and the arena over its lower bound.
"""
import json
import os
import pathlib
import subprocess
import sys

MEMORY_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "memory.py"
WORKLOADS = ["mlp", "cnn", "transformer", "mobilenetv2_personalize", "mobilenetv2_full"]
MIB = 1024 * 1024

FLOOR_PROBE = """
import json, odtrain.api, odtrain.jit
odtrain.jit.load()
with open("/proc/self/status") as status:
    print(json.dumps({line.split(":")[0]: int(line.split()[1]) for line in status
                      if line.startswith(("VmRSS", "RssAnon"))}))
"""


def _fresh_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package runs
    return env


class RuntimeFloor:
    timeout = 300

    def setup_cache(self):
        subprocess.run([sys.executable, "-c", FLOOR_PROBE], check=True, capture_output=True, env=_fresh_env())
        done = subprocess.run([sys.executable, "-c", FLOOR_PROBE], check=True, capture_output=True, text=True,
                              env=_fresh_env())
        return json.loads(done.stdout.strip().splitlines()[-1])

    def track_floor_rss(self, status):
        return status["VmRSS"] / 1024

    track_floor_rss.unit = "MiB"

    def track_floor_anonymous_rss(self, status):
        return status["RssAnon"] / 1024

    track_floor_anonymous_rss.unit = "MiB"


class TrainingMemory:
    params = WORKLOADS
    param_names = ["workload"]
    timeout = 1200

    def setup_cache(self):
        results = {}
        for name in WORKLOADS:
            env = dict(_fresh_env(), MALLOC_MMAP_THRESHOLD_="131072")  # as benchmarks/memory.py runs its workers
            done = subprocess.run([sys.executable, str(MEMORY_SCRIPT), "--worker", "--workload", name, "--steps", "4"],
                                  capture_output=True, text=True, env=env)
            if done.returncode == 0:
                results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        return results

    def setup(self, results, workload):
        if workload not in results:
            raise NotImplementedError(f"{workload}: the memory worker failed or the model is missing")

    def track_rss_added_by_training(self, results, workload):
        return results[workload]["measured_added"] / MIB

    track_rss_added_by_training.unit = "MiB"

    def track_report_over_measured(self, results, workload):
        """The memory report's prediction over the RSS training really added (1.0: exact)."""
        r = results[workload]
        return r["predicted_added"] / max(r["measured_added"], 1)

    track_report_over_measured.unit = "ratio"

    def track_arena_over_lower_bound(self, results, workload):
        r = results[workload]
        return r["arena"] / max(r["lower_bound"], 1)

    track_arena_over_lower_bound.unit = "ratio"
