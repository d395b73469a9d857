"""Speech made offline: espeak-ng reading windows of the shipped corpus, as `speech_pairs` data.

A Whisper checkpoint needs audio with its transcript (`uptrain.data.pairs`: jsonl lines with an
`audio` wav path and its `text`). None ships, and no speech corpus is reachable offline; the
Debian package `espeak-ng` is. `make_speech_pairs` has it read windows of the shipped corpus
(`uptrain.data.corpus`): training clips from the train split, held-out clips from the test split
(split by whole works, so the two never share a work; a held-out window whose text is also a
training window is dropped too). Each window is whole sentences of one paragraph (one speech of a
play, one paragraph of a novel, one verse of the Bible), `min_words` to `max_words` words, so every
clip is well inside Whisper's 30 s window. The transcript is exactly the text espeak-ng read.

espeak-ng writes 22,050 Hz; the clips are resampled to 16 kHz (Whisper's feature extractor's rate)
by band-limited (FFT) interpolation and written as 16-bit PCM wav with the standard library.
Everything is deterministic: the windows are drawn with `seed`, and espeak-ng's voice, speed and
version are recorded in the folder's `speech.json`; a rerun with the same settings reuses the
folder, other settings are refused unless `overwrite`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
import wave
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from uptrain import UptrainError
from uptrain.checkpoint.atomic import atomic_directory, check_output_path
from uptrain.data.corpus import read_documents, split_path

SAMPLING_RATE = 16_000  # Whisper's feature extractor's rate
MAX_CLIP_S = 28.0  # a clip longer than this is refused: every clip stays inside 30 s
INSTALL_COMMAND = "apt-get install -y espeak-ng"
SPLITS = {"train": "train", "heldout": "test"}  # data file → corpus split
MANIFEST = "speech.json"
FORMAT = 2  # of the folder: a change of the windowing, the cleaning or the layout bumps it


@dataclass(frozen=True)
class SpeechSettings:
    """What decides a speech folder's content (recorded in its speech.json)."""

    train_clips: int = 200
    heldout_clips: int = 40
    seed: int = 0
    voice: str = "en-us"
    speed: int = 160  # words a minute (espeak-ng's -s)
    min_words: int = 10
    max_words: int = 40

    def check(self) -> None:
        """Refuse, in one line, settings that cannot make a folder."""
        if self.train_clips < 1 or self.heldout_clips < 1:
            raise UptrainError("the train and held-out clip counts must be at least 1")
        if not 80 <= self.speed <= 450:
            raise UptrainError(f"speed {self.speed} is outside espeak-ng's 80–450 words a minute")
        if not 1 <= self.min_words <= self.max_words <= 60:
            raise UptrainError(
                f"words per clip {self.min_words}–{self.max_words}: need 1 ≤ min ≤ max ≤ 60 (inside Whisper's 30 s)"
            )
        if self.max_words * 60 / self.speed > 0.85 * MAX_CLIP_S:  # espeak-ng reads ~10 % slower than asked
            raise UptrainError(
                f"{self.max_words} words at {self.speed} words a minute may run past {MAX_CLIP_S:g} s; "
                "choose fewer words or a higher speed"
            )
        if not re.fullmatch(r"[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)?", self.voice):
            raise UptrainError(f"voice {self.voice!r} is not an espeak-ng voice name (e.g. en-us, en-gb)")


def espeak_binary(install: bool = True) -> str:
    """The espeak-ng program; installed with apt-get when missing and `install` (as root), else
    refused in one line that gives the command."""
    found = shutil.which("espeak-ng")
    if found:
        return found
    if install and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"espeak-ng is missing: {INSTALL_COMMAND}", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        ok = subprocess.run(["apt-get", "install", "-y", "-qq", "espeak-ng"], env=env).returncode == 0
        if not ok:  # a fresh machine has no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], env=env)
            ok = subprocess.run(["apt-get", "install", "-y", "-qq", "espeak-ng"], env=env).returncode == 0
        found = shutil.which("espeak-ng")
        if ok and found:
            return found
        raise UptrainError(f"could not install espeak-ng with `{INSTALL_COMMAND}`; install it and run again")
    raise UptrainError(f"espeak-ng is not installed; install it (as root: `{INSTALL_COMMAND}`) and run again")


def espeak_version(binary: str) -> str:
    """espeak-ng's version line (e.g. `eSpeak NG text-to-speech: 1.51`), for the record."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return out.split("  Data at")[0].strip() or "unknown"


def resample(samples: np.ndarray, rate: int, new_rate: int) -> np.ndarray:
    """`samples` at `rate` Hz resampled to `new_rate` by band-limited interpolation: the spectrum is
    cut (or zero-padded) at the new Nyquist frequency. Speech clips begin and end in silence, so the
    transform's wrap-around does not show."""
    if rate == new_rate:
        return samples.astype(np.float32)
    n = len(samples)
    m = max(1, round(n * new_rate / rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    keep = min(len(spectrum), m // 2 + 1)
    out = np.zeros(m // 2 + 1, dtype=np.complex128)
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, n=m) * (m / n)).astype(np.float32)


def read_pcm_wav(path: Path) -> tuple[np.ndarray, int]:
    """A wav file espeak-ng wrote, as float32 samples and its rate (through the one wav reader)."""
    from uptrain.data.pairs import read_wav_at_its_rate

    return read_wav_at_its_rate(path, "espeak-ng's output")


def write_pcm_wav(path: Path, samples: np.ndarray, rate: int = SAMPLING_RATE) -> None:
    """`samples` (float, [-1, 1]) as a 16-bit mono PCM wav file."""
    pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def speak(text: str, voice: str = "en-us", speed: int = 160, binary: str | None = None) -> np.ndarray:
    """`text` read by espeak-ng, as float32 samples at 16 kHz."""
    binary = binary or espeak_binary()
    with tempfile.TemporaryDirectory(prefix="uptrain-espeak-") as tmp:
        wav = Path(tmp) / "speech.wav"
        # The text goes in on stdin (--stdin reads it whole): a text starting with `-` is no option.
        done = subprocess.run(
            [binary, "-v", voice, "-s", str(speed), "-b", "1", "-w", str(wav), "--stdin"],
            input=text.encode(),
            capture_output=True,
        )
        if done.returncode != 0 or not wav.is_file():
            message = done.stderr.decode(errors="replace").strip().splitlines()
            raise UptrainError(f"espeak-ng failed (voice {voice}): {message[-1] if message else done.returncode}")
        samples, rate = read_pcm_wav(wav)
    if samples.size == 0:
        raise UptrainError(f"espeak-ng wrote no audio for {text[:40]!r}")
    return resample(samples, rate, SAMPLING_RATE)


# --- windows of the corpus -----------------------------------------------------------------------

_BRACKETS = re.compile(r"\[[^\]]*\]", re.S)  # stage directions: [Exit], [Enter MARINERS, Wet]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _clean_paragraph(paragraph: str) -> str:
    """One paragraph as espeak-ng reads it: stage directions and heading lines (no lower-case letter:
    speakers' names, CHAPTER and SCENE headings) gone, italics underscores gone, dashes as commas,
    lines joined."""
    lines = [line for line in paragraph.split("\n") if re.search(r"[a-z]", line)]
    text = " ".join(line.strip() for line in lines).replace("_", "")
    text = re.sub(r"([.!?])\s*--+\s*", r"\1 ", text)  # a dash after a sentence's end is a pause
    text = re.sub(r"[,;:]?\s*--+\s*", ", ", text)
    return re.sub(r"\s+", " ", text).strip(" ,")


def document_windows(text: str, min_words: int, max_words: int) -> list[str]:
    """Consecutive whole sentences of one paragraph, `min_words` to `max_words` words each, in
    order; a sentence longer than `max_words` is skipped, and so is a window with a digit (read
    aloud it has no one spelling)."""
    windows = []
    for paragraph in re.split(r"\n\s*\n", _BRACKETS.sub(" ", text)):
        sentences = [s for s in _SENTENCE_END.split(_clean_paragraph(paragraph)) if s]
        current: list[str] = []
        count = 0
        for sentence in sentences + [None]:
            words = len(sentence.split()) if sentence is not None else 0
            if sentence is None or count + words > max_words:
                if count >= min_words:
                    window = " ".join(current)
                    if not re.search(r"\d", window):
                        windows.append(window)
                current, count = [], 0
            if sentence is not None and words <= max_words:
                current.append(sentence)
                count += words
    return windows


@functools.lru_cache(maxsize=4)  # the shipped corpus does not change while a process runs
def split_windows(split: str, min_words: int, max_words: int) -> tuple[tuple[str, str], ...]:
    """(work id, window) for every window of the corpus split `split`, in file order."""
    return tuple(
        (doc["id"], window)
        for doc in read_documents(split)
        for window in document_windows(doc["text"], min_words, max_words)
    )


def choose_windows(settings: SpeechSettings) -> dict[str, list[tuple[str, str]]]:
    """The windows each data file reads, drawn with the settings' seed: `train` from the corpus'
    train split, `heldout` from its test split, without a held-out text that is also a train window."""
    train = split_windows("train", settings.min_words, settings.max_words)
    test = split_windows("test", settings.min_words, settings.max_words)
    train_texts = {w for _, w in train}
    test = tuple((work, w) for work, w in test if w not in train_texts)
    chosen = {}
    for name, pool, count in (("train", train, settings.train_clips), ("heldout", test, settings.heldout_clips)):
        if count > len(pool):
            raise UptrainError(f"{count} {name} clips asked for; the corpus has {len(pool)} windows of that size")
    rng = random.Random(settings.seed)
    chosen["train"] = rng.sample(train, settings.train_clips)
    chosen["heldout"] = rng.sample(test, settings.heldout_clips)
    return chosen


# --- the folder ----------------------------------------------------------------------------------


def _corpus_digests() -> dict[str, str]:
    return {split: hashlib.sha256(split_path(split).read_bytes()).hexdigest() for split in SPLITS.values()}


def _wanted(settings: SpeechSettings, version: str) -> dict:
    """What a folder made with `settings` records about how it was made (compared on reuse)."""
    return {
        "format": FORMAT,
        "settings": asdict(settings),
        "espeak": version,
        "sampling_rate": SAMPLING_RATE,
        "corpus_sha256": _corpus_digests(),
    }


def read_manifest(out: Path) -> dict | None:
    """The speech.json of a finished folder, or None where there is none (or it is not an object)."""
    try:
        found = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def make_speech_pairs(
    out: str | Path,
    settings: SpeechSettings = SpeechSettings(),
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write (or reuse) the speech folder `out`: `train.jsonl` and `heldout.jsonl` (`audio`, `text`,
    the clip's `seconds` and the `work` it reads), the wav files under `audio/`, and `speech.json`.
    A folder made with the same settings (and espeak-ng version and corpus) is reused as it is, unless
    `overwrite`, which also replaces a folder made with other settings."""
    settings.check()
    out = Path(out).absolute()
    binary = espeak_binary()
    wanted = _wanted(settings, espeak_version(binary))
    found = read_manifest(out)
    if not overwrite and found is not None and {k: found.get(k) for k in wanted} == wanted:
        log(f"reusing {out} (made with the same settings)")
        return out
    if out.exists() and not overwrite:
        what = "other settings" if found is not None else "no speech.json"
        raise UptrainError(f"{out} exists with {what}; choose another output folder or pass --overwrite")
    check_output_path(out, overwrite)  # refused before the corpus is read
    start = time.perf_counter()
    chosen = choose_windows(settings)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        (tmp / "audio").mkdir()
        totals = {}
        for name, windows in chosen.items():
            lines, seconds = [], 0.0
            for i, (work, text) in enumerate(windows):
                samples = speak(text, settings.voice, settings.speed, binary)
                length = samples.size / SAMPLING_RATE
                if length > MAX_CLIP_S:
                    raise UptrainError(
                        f"espeak-ng read a {len(text.split())}-word window in {length:.1f} s, past {MAX_CLIP_S:g} s; "
                        "lower max_words or raise the speed"
                    )
                audio = f"audio/{name}-{i:04d}.wav"
                write_pcm_wav(tmp / audio, samples)
                lines.append(json.dumps({"audio": audio, "text": text, "seconds": round(length, 3), "work": work}))
                seconds += length
                if (i + 1) % 20 == 0 or i + 1 == len(windows):
                    log(f"  {name}: {i + 1}/{len(windows)} clips, {seconds:,.0f} s of audio")
            (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
            totals[name] = {"clips": len(windows), "seconds": round(seconds, 1)}
        manifest = {**wanted, "totals": totals, "made_in_s": round(time.perf_counter() - start, 1)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return out
