"""Speech pairs made offline for Whisper: espeak-ng reading windows of the shipped corpus.

    python scripts/make_speech_pairs.py --output-dir ~/whisper-speech                 # 200 + 40 clips, ~1 min
    python scripts/make_speech_pairs.py --output-dir /tmp/s --train-clips 20 --heldout-clips 5

Writes `train.jsonl` (windows of the corpus' train split) and `heldout.jsonl` (of its test split:
other works, never the same text), one `{"audio": "audio/….wav", "text": …}` line per clip (plus
its `seconds` and the `work` it reads), the 16 kHz 16-bit wav files and `speech.json` (settings,
espeak-ng's version, the corpus' digests, totals): the `speech_pairs` format `uptrain train`,
`convert --calibrate` and `evaluate --task asr` read. espeak-ng (Debian `espeak-ng`) is installed
with apt-get when missing and the script runs as root; otherwise it says the command. A rerun with
the same settings reuses the folder. See `uptrain.data.speech` for how windows are chosen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uptrain import UptrainError
from uptrain.data.speech import SpeechSettings, make_speech_pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = SpeechSettings()
    parser = argparse.ArgumentParser(
        prog="make_speech_pairs.py",
        description="Write speech_pairs data (wav + transcript) for Whisper: espeak-ng reading windows of "
        "the shipped corpus, train split for training, test split held out.",
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="the folder to write (reused when it matches)")
    parser.add_argument("--train-clips", type=int, default=d.train_clips, help=f"default {d.train_clips}")
    parser.add_argument("--heldout-clips", type=int, default=d.heldout_clips, help=f"default {d.heldout_clips}")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"which windows are drawn (default {d.seed})")
    parser.add_argument("--voice", default=d.voice, help=f"espeak-ng voice (default {d.voice})")
    parser.add_argument("--speed", type=int, default=d.speed, help=f"words a minute (default {d.speed})")
    parser.add_argument("--min-words", type=int, default=d.min_words, help=f"per clip (default {d.min_words})")
    parser.add_argument("--max-words", type=int, default=d.max_words, help=f"per clip (default {d.max_words})")
    parser.add_argument("--overwrite", action="store_true", help="replace a folder made with other settings")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = SpeechSettings(
        train_clips=args.train_clips,
        heldout_clips=args.heldout_clips,
        seed=args.seed,
        voice=args.voice,
        speed=args.speed,
        min_words=args.min_words,
        max_words=args.max_words,
    )
    try:
        make_speech_pairs(args.output_dir, settings, overwrite=args.overwrite, log=lambda m: print(m, flush=True))
    except UptrainError as err:
        print(f"make_speech_pairs.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
