"""Generated .wav files, valid and damaged, through the one reader that asr evaluation,
speech-pairs training and Whisper's calibration share (`uptrain.data.pairs.read_wav`).

For every generated file the reader either gives the samples exactly (float32 in [-1, 1],
channels averaged) or refuses in one line naming the file; never another exception. A file whose
data ends inside a frame (cut while it was written or copied) is refused, not read short.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uptrain import UptrainError
from uptrain.data.pairs import PCM_TYPES, read_wav

RATE = 16000
FAST = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@st.composite
def clips(draw) -> tuple[bytes, np.ndarray, int]:
    """A small PCM wav (8-, 16- or 32-bit, 1–3 channels, 1–40 frames): its bytes, the samples the
    reader should give, and the byte where its data begins."""
    width, channels = draw(st.sampled_from(sorted(PCM_TYPES))), draw(st.integers(1, 3))
    frames = draw(st.integers(1, 40))
    kind = PCM_TYPES[width]
    info = np.iinfo(kind)
    values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=frames * channels,
                           max_size=frames * channels))  # fmt: skip
    samples = np.array(values, dtype=kind)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(RATE)
        w.writeframes(samples.astype(np.dtype(kind).newbyteorder("<")).tobytes())
    scaled = samples.astype(np.float32)
    scaled = (scaled - 128.0) / 128.0 if width == 1 else scaled / float(2 ** (8 * width - 1))
    raw = buffer.getvalue()
    return raw, scaled.reshape(-1, channels).mean(axis=1), raw.index(b"data") + 8


@st.composite
def damaged_clips(draw) -> tuple[str, bytes, np.ndarray | None, int]:
    """A clip, maybe cut short or with bytes changed: (what was done, the bytes, the samples when
    untouched, where the data begins)."""
    raw, samples, data_start = draw(clips())
    kind = draw(st.sampled_from(["valid", "cut", "cut in data", "flip", "header field", "appended"]))
    if kind == "cut":
        return kind, raw[: draw(st.integers(0, len(raw) - 1))], None, data_start
    if kind == "cut in data":  # inside the samples: the header promises more than there is
        return kind, raw[: draw(st.integers(data_start, len(raw) - 1))], None, data_start
    if kind == "flip":
        data = bytearray(raw)
        at = draw(st.integers(0, data_start - 1))  # the header: the samples' bits are any value
        data[at] ^= 1 << draw(st.integers(0, 7))
        return kind, bytes(data), None, data_start
    if kind == "header field":  # a 2- or 4-byte field of the header set to an edge value
        data = bytearray(raw)
        at = draw(st.sampled_from([4, 16, 20, 22, 24, 28, 32, 34, 40]))
        size = 2 if at in (20, 22, 32, 34) else 4
        value = draw(st.sampled_from([0, 1, 2, 3, 5, 2 ** (8 * size) - 1, 2 ** (8 * size - 1)]))
        data[at : at + size] = value.to_bytes(size, "little")
        return kind, bytes(data), None, data_start
    if kind == "appended":  # bytes after the data chunk (another chunk, or junk): not samples
        return kind, raw + draw(st.binary(min_size=1, max_size=9)), samples, data_start
    return kind, raw, samples, data_start


@FAST
@given(damaged_clips())
def test_generated_wav_files(tmp_path, case):
    kind, raw, expected, _ = case
    path = tmp_path / "clip.wav"
    path.write_bytes(raw)
    try:
        samples = read_wav(path, RATE, "`data` clip.jsonl line 1")
    except UptrainError as err:
        message = str(err)
        assert "\n" not in message and str(path) in message, message
        assert expected is None, f"refused an untouched clip: {message}"
        return
    assert samples.dtype == np.float32 and samples.ndim == 1 and samples.size > 0
    assert np.isfinite(samples).all() and np.abs(samples).max() <= 1.0
    if expected is not None:
        assert np.array_equal(samples, expected), kind


@pytest.mark.parametrize(("width", "channels"), [(2, 1), (4, 1), (2, 2), (1, 3)])
def test_data_that_ends_inside_a_frame_is_refused(tmp_path, width, channels):
    """A clip cut inside its last frame — mid-sample, or mid-frame between channels — is refused in
    one line naming it (numpy's `buffer size must be a multiple of element size` before)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(RATE)
        w.writeframes(bytes(width * channels * 10))
    path = tmp_path / "cut.wav"
    for cut in range(1, width * channels):
        path.write_bytes(buffer.getvalue()[:-cut])
        with pytest.raises(UptrainError, match=r"cut\.wav ends inside a frame") as err:
            read_wav(path, RATE, "`data` clip.jsonl line 1")
        assert "\n" not in str(err.value)


def test_the_reader_is_the_one_every_speech_path_uses():
    """asr evaluation and Whisper's calibration read examples through `load_pairs`, which reads
    audio with `read_wav`; a reader of their own would escape these tests."""
    root = Path(__file__).resolve().parents[2] / "uptrain"
    opens = {p.relative_to(root).as_posix(): p.read_text().splitlines() for p in root.rglob("*.py")}
    readers = sorted(
        name for name, lines in opens.items() if any("wave.open" in ln and '"wb"' not in ln for ln in lines)
    )
    assert readers == ["data/pairs.py"]  # a writer (`"wb"`: the speech maker's clips) reads nothing
