"""A small spoken-keyword set made with espeak-ng (Debian's `espeak-ng` package), no download.

    python benchmarks/audio/make_keywords.py OUT [--only new_train,new_test,known_test]

Eight words, each spoken by espeak-ng voices (an accent and a voice variant) at several speeds and
pitches, moved up to ±0.1 s off centre, scaled, and mixed with background noise (brown noise and mains
hum at 5 to 25 dB SNR), as 1 s, 16 kHz, 16-bit mono WAV in OUT/<split>/<word>/<voice>_<n>.wav:
- base_train, known_test: the BASE_VOICES the keyword model was pre-trained on (known_test holds other
  speeds, pitches and noise than base_train);
- new_train (10 clips a word), new_test (20 a word): NEW_VOICE, which the model never heard;
- personal: what the device trains on, new_train and, so that the known voices are not forgotten, the
  first base_train clip of REPLAY_VOICES of the base voices (10 a word): 160 clips.
Everything is seeded: the same command makes the same files. ~2,000 clips take about a minute.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import wave

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from odtrain.audio import fit_length, resample  # noqa: E402

WORDS = ("down", "go", "left", "no", "right", "stop", "up", "yes")  # sorted: odtrain numbers a folder's classes so
RATE, LENGTH = 16000, 16000
BASE_VOICES = [f"{accent}+{variant}" for accent in ("en-us", "en-gb", "en-gb-scotland", "en-029")
               for variant in ("m1", "m3", "f2", "f4")]
NEW_VOICE = "en-gb-x-gbcwmd+whisper"
REPLAY_VOICES = 10
SPLITS = {  # voices, clips per word and voice, seed
    "base_train": (BASE_VOICES, 12, 1),
    "known_test": (BASE_VOICES, 2, 2),
    "new_train": ([NEW_VOICE], 10, 3),
    "new_test": ([NEW_VOICE], 20, 4),
}


def speak(word: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    """espeak-ng's rendering of `word`, as float32 samples at RATE."""
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", word],
                         check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(wav)) as reader:  # espeak-ng's stdout header leaves the sizes unset
        rate = reader.getframerate()
        samples = np.frombuffer(reader.readframes(reader.getnframes() or 10**7), "<i2") / np.float32(32768)
    return resample(samples.astype(np.float32), rate, RATE)


def noise(rng, count: int) -> np.ndarray:
    brown = np.cumsum(rng.standard_normal(count))
    brown -= np.convolve(brown, np.ones(401) / 401, mode="same")  # no drift
    t = np.arange(count) / RATE
    hum = rng.uniform(0, 0.5) * np.sin(2 * np.pi * rng.choice([50, 60]) * t + rng.uniform(0, 6.3))
    mixed = brown / (np.abs(brown).max() + 1e-9) + hum
    return mixed / np.sqrt(np.mean(mixed ** 2))


def clip(rng, word: str, voice: str) -> np.ndarray:
    speech = speak(word, voice, int(rng.integers(120, 220)), int(rng.integers(20, 80)))
    shift = int(rng.integers(-1600, 1601))
    speech = np.roll(fit_length(speech, LENGTH), shift) * rng.uniform(0.3, 0.9)
    power = np.mean(speech[np.abs(speech) > 1e-3] ** 2) if (np.abs(speech) > 1e-3).any() else 1e-4
    snr = rng.uniform(5, 25)
    mixed = speech + noise(rng, LENGTH) * np.sqrt(power / 10 ** (snr / 10))
    return np.clip(mixed, -1, 32767 / 32768)


def write(path: str, samples: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with wave.open(path, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(np.round(samples * 32768).clip(-32768, 32767).astype("<i2").tobytes())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--only", help="comma-separated splits to make (default: all)")
    args = parser.parse_args(argv)
    for split, (voices, count, seed) in SPLITS.items():
        if args.only and split not in args.only.split(","):
            continue
        rng = np.random.default_rng(seed)
        for word in WORDS:
            for voice in voices:
                for n in range(count):
                    write(os.path.join(args.out, split, word, f"{voice.replace('+', '_')}_{n:02d}.wav"),
                          clip(rng, word, voice))
        print(f"{split}: {len(voices) * count * len(WORDS)} clips")
    if not args.only or "personal" in args.only.split(","):
        for word in WORDS:
            names = [f"new_train/{word}/{NEW_VOICE.replace('+', '_')}_{n:02d}.wav" for n in range(10)]
            names += [f"base_train/{word}/{voice.replace('+', '_')}_00.wav" for voice in BASE_VOICES[:REPLAY_VOICES]]
            os.makedirs(os.path.join(args.out, "personal", word), exist_ok=True)
            for name in names:
                shutil.copyfile(os.path.join(args.out, name),
                                os.path.join(args.out, "personal", word, name.replace("/", "_")))
        print(f"personal: {(10 + REPLAY_VOICES) * len(WORDS)} clips")


if __name__ == "__main__":
    main()
