"""Run the odtrain Flower App with `flwr run`: on a loopback SuperLink in simulation mode, on a loopback
SuperLink with one SuperNode per client (deployment), or on a SuperLink that is already running.

- ``write_app(folder, run_config)`` writes the Flower App (a ``pyproject.toml`` naming
  ``odtrain.federated.flower.server_app:app`` and ``odtrain.federated.flower.client_app:app``) that ``flwr run`` bundles.
- ``LocalFederation`` starts ``flower-superlink`` (and ``flower-supernode``s) as subprocesses on
  ``127.0.0.1``, on free ports, insecure (plain HTTP on loopback), with Flower's runtime dependency
  installation, telemetry and update checks off. Every process it starts, and every process those start,
  carries a marker in its environment; leaving the ``with`` block stops them all (POSIX; found through
  ``/proc`` on Linux), even after an error.
- ``run_flower`` drives one run and prints the global model's rounds as the ServerApp records them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

from ..rounds import ROUNDS_FILE, format_round
from ...graph.errors import OdtrainError

CONNECTION = "odtrain"
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
             "PYTHONUNBUFFERED": "1"}
MARKER = "ODTRAIN_FEDERATION"


class FlowerRunError(OdtrainError):
    """A Flower process failed to start, or a run failed or timed out."""


def write_app(folder: str, run_config: dict) -> str:
    """Write the Flower App's ``pyproject.toml`` into ``folder`` with ``run_config`` as its defaults.

    The app declares no dependencies: it runs in the environment of the SuperLink and SuperNodes, which must
    have ``odtrain[flower]`` installed."""
    os.makedirs(folder, exist_ok=True)
    lines = ["[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
             "[project]", 'name = "odtrain-fedavg"', 'version = "1.0.0"',
             'description = "odtrain artifacts trained on every node, averaged with FedAvg"', 'license = "MIT"',
             "", "[tool.flwr.app]", 'publisher = "odtrain"', "",
             "[tool.flwr.app.components]", 'serverapp = "odtrain.federated.flower.server_app:app"',
             'clientapp = "odtrain.federated.flower.client_app:app"', "", "[tool.flwr.app.config]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in run_config.items()]
    with open(os.path.join(folder, "pyproject.toml"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tool(name: str) -> str:
    """The Flower command `name` from this interpreter's environment."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else (shutil.which(name) or name)


def write_connection(flwr_home: str, address: str) -> None:
    """A Flower configuration whose SuperLink connection `odtrain` is `address`, insecure."""
    os.makedirs(flwr_home, exist_ok=True)
    with open(os.path.join(flwr_home, "config.toml"), "w") as handle:
        handle.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                     f'address = "{address}"\ninsecure = true\n')


class LocalFederation:
    """A SuperLink (and `supernodes` SuperNodes with partition-id k of num-partitions) on 127.0.0.1."""

    def __init__(self, workdir: str, supernodes: int = 0, simulation: bool = False, node_configs=None,
                 startup_timeout: float = 60.0):
        self.workdir, self.supernodes, self.simulation = os.path.abspath(workdir), supernodes, simulation
        self.node_configs = node_configs or [f"partition-id={k} num-partitions={supernodes}" for k in range(supernodes)]
        self.startup_timeout = startup_timeout
        self.marker = uuid.uuid4().hex
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.port = 0
        self.flwr_home = os.path.join(self.workdir, "flwr-home")
        self.logs = os.path.join(self.workdir, "logs")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict:
        return {**os.environ, **QUIET_ENV, "FLWR_HOME": self.flwr_home, MARKER: self.marker}

    def _start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=self.env(), cwd=self.workdir, start_new_session=True)
        log.close()
        self.processes.append((name, process))
        return process

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def __enter__(self) -> "LocalFederation":
        os.makedirs(self.logs, exist_ok=True)
        try:
            self.port = free_port()
            command = [_tool("flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                       "--disable-runtime-dependency-installation"]
            superlink = self._start("superlink", command + (["--simulation"] if self.simulation else []))
            deadline = time.monotonic() + self.startup_timeout
            while not self._healthy():
                if superlink.poll() is not None or time.monotonic() > deadline:
                    raise FlowerRunError(f"the SuperLink did not start: {self.tail('superlink')}")
                time.sleep(0.2)
            for k, node_config in enumerate(self.node_configs):
                self._start(f"supernode-{k}", [_tool("flower-supernode"), "--insecure", "--superlink", self.address,
                                               "--host", "127.0.0.1", "--port", str(free_port()),
                                               "--node-config", node_config, "--max-wait-time", "60"])
            write_connection(self.flwr_home, self.address)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.logs, f"{name}.log")) as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def marked_pids(self) -> list[int]:
        """Processes whose environment carries this federation's marker (those started here and their children)."""
        needle = f"{MARKER}={self.marker}".encode()
        pids = []
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:  # elsewhere: process groups only
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as handle:
                        if needle in handle.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:
                    continue
        return pids

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process of the federation, SIGKILL what is left after `grace` seconds; reap children."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for name, process in self.processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, sig)
                    except ProcessLookupError:
                        pass
            for pid in self.marked_pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (any(p.poll() is None for _, p in self.processes)
                                                   or self.marked_pids()):
                time.sleep(0.1)
            if not any(p.poll() is None for _, p in self.processes) and not self.marked_pids():
                break
        for _, process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def run_app(self, app_dir: str, timeout: float, federation_config: str | None = None,
                on_poll=None) -> subprocess.CompletedProcess:
        """`flwr run APP odtrain --stream`; `on_poll()` is called about once a second while it runs."""
        command = [_tool("flwr"), "run", os.path.abspath(app_dir), CONNECTION, "--stream"]
        if federation_config:
            command += ["--federation-config", federation_config]
        process = self._start("flwr-run", command)
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                raise FlowerRunError(f"the run did not finish within {timeout:.0f} s; see {self.logs}/")
            time.sleep(1.0)
        if on_poll is not None:
            on_poll()
        return subprocess.CompletedProcess(command, process.returncode)


def run_flower(engine: str, artifact_dir: str, output_dir: str, clients: int, rounds: int, local_epochs: int,
               batch_size: int, learning_rate: float, alpha: float, seed: int, clip_norm, noise_multiplier: float,
               superlink: str | None = None, timeout: float = 600.0, out=print) -> dict:
    """One FedAvg run of the odtrain Flower App with the `simulation` or `deployment` engine; returns rounds.json."""
    workdir = os.path.join(os.path.dirname(os.path.abspath(output_dir)), "flower")
    run_config = {"artifact-dir": os.path.abspath(artifact_dir), "output-dir": os.path.abspath(output_dir),
                  "num-server-rounds": rounds, "local-epochs": local_epochs, "batch-size": batch_size,
                  "learning-rate": float(learning_rate), "seed": seed, "dirichlet-alpha": float(alpha),
                  "clip-norm": float(clip_norm or 0.0), "noise-multiplier": float(noise_multiplier),
                  "fraction-train": 1.0, "fraction-evaluate": 0.0, "min-nodes": clients}
    app_dir = write_app(os.path.join(workdir, "app"), run_config)
    progress = os.path.join(output_dir, ROUNDS_FILE)
    if os.path.exists(progress):
        os.remove(progress)
    shown = [0]

    def show_rounds():
        try:
            with open(progress) as handle:
                recorded = json.load(handle)["rounds"]
        except (OSError, ValueError, KeyError):
            return
        for entry in recorded[shown[0]:]:
            out(format_round(entry))
        shown[0] = max(shown[0], len(recorded))

    simulation = engine == "simulation"
    federation = LocalFederation(workdir, supernodes=0 if simulation or superlink else clients, simulation=simulation)
    if superlink:
        write_connection(federation.flwr_home, superlink)
        os.makedirs(federation.logs, exist_ok=True)
        try:
            completed = federation.run_app(app_dir, timeout, on_poll=show_rounds)
        finally:
            federation.stop()  # only `flwr run` carries this federation's marker here
    else:
        with federation:
            completed = federation.run_app(app_dir, timeout, f"num-supernodes={clients}" if simulation else None,
                                           show_rounds)
    try:
        with open(progress) as handle:
            result = json.load(handle)
    except (OSError, ValueError):
        result = {}
    if completed.returncode != 0 or not result.get("finished"):
        raise FlowerRunError(f"the Flower run did not complete (flwr run exit code {completed.returncode}); "
                             f"logs in {federation.logs}/:\n{federation.tail('flwr-run', 25)}")
    empty = [entry["round"] for entry in result["rounds"][1:] if entry.get("train_loss") is None]
    if empty:
        raise FlowerRunError(f"rounds {empty} received no client update; the clients' errors are in "
                             f"{federation.logs}/flwr-run.log")
    return result
