"""What the artifacts' checksums cost on a large model: the checkpoint's sha256 at load and at save, and the
digest a kernel library records of the models (odtrain.kernel_library.artifacts_digest).

    python benchmarks/checkpoint_digest.py ARTIFACT_DIR [--repeat 3]

ARTIFACT_DIR: e.g. the Llama-3.2-1B-shaped int4 artifacts of benchmarks/decoders/memory_stages.py. Each
figure is CPU seconds of this process (the machine may be shared) and wall seconds, medians of --repeat.
`load` is CheckpointState.load_checkpoint whole (header, checksum streamed from the file, tensors mapped),
`save` save_checkpoint whole (checksum over the tensors, then the file written, flushed and renamed);
`in sha256` is the part of each spent in hashlib's update (cProfile), `sha256 of the file` hashing the
file's bytes alone, the floor any checksum of them pays.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import tempfile
import time


def _timed(function) -> tuple[float, float, float]:
    """(CPU s, wall s, CPU s inside hashlib's update) of one call."""
    profile = cProfile.Profile(time.process_time)  # CPU time: a shared machine's waits are not the checksum's
    cpu, wall = time.process_time(), time.perf_counter()
    profile.runcall(function)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    stats = pstats.Stats(profile).stats
    hashing = sum(row[3] for key, row in stats.items() if key[2] == "<method 'update' of '_hashlib.HASH' objects>")
    return cpu, wall, hashing


def _hash_file(path: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from odtrain.api import CheckpointState
    from odtrain.kernel_library import artifacts_digest

    checkpoint = os.path.join(args.artifacts, "checkpoint")
    runs = {"sha256 of the file": [], "load": [], "save": [], "artifacts_digest": []}
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.artifacts))) as scratch:
        for _ in range(args.repeat):
            runs["sha256 of the file"].append(_timed(lambda: _hash_file(checkpoint))[:2] + (None,))
            loaded = {}
            runs["load"].append(_timed(lambda: loaded.setdefault("state", CheckpointState.load_checkpoint(checkpoint))))
            saved = os.path.join(scratch, "checkpoint")
            runs["save"].append(_timed(lambda: CheckpointState.save_checkpoint(loaded["state"], saved)))
            runs["artifacts_digest"].append(_timed(lambda: artifacts_digest(args.artifacts))[:2] + (None,))
            del loaded
    size = os.path.getsize(checkpoint)
    print(json.dumps({"checkpoint_mib": round(size / 2 ** 20, 1), "repeat": args.repeat}))
    for name, rows in runs.items():
        cpu, wall, hashing = zip(*rows)
        print(json.dumps({"what": name, "cpu_s": round(statistics.median(cpu), 3), "wall_s": round(statistics.median(wall), 3),
                          "in_sha256_s": None if hashing[0] is None else round(statistics.median(hashing), 3)}))


if __name__ == "__main__":
    main()
