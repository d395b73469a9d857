"""Wall time and peak memory of `uptrain convert --value-fit output` beside the plain calibrated merge.

    python scripts/bench_value_fit.py --model whisper-base --calibration-data whisper-speech/train.jsonl \\
        --kv-heads 4 --clips 16 --repeats 2

Each conversion runs as its own child process (`python -m uptrain convert`, so `os.wait4` gives
its peak RSS alone), `--value-fit inputs` (the plain merge) and `--value-fit output` alternating,
the same source, calibration clips, G and the decoder's self- and cross-attention; the best wall
time of each is kept. `--value-fit output` adds a second calibration pass over the same clips
(the source model loaded and run again, the merged queries and keys in its hooks). Prints a
table, then as its last line one JSON object: wall_s and peak_rss_bytes per fit, and
output_over_inputs (the ratio of the best wall times).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FITS = ("inputs", "output")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an encoder–decoder checkpoint folder (Whisper, BART, …)")
    p.add_argument("--calibration-data", required=True, help="its calibration data (Whisper: speech pairs)")
    p.add_argument("--language", default=None, help="Whisper's calibration prompt language (e.g. en)")
    p.add_argument("--kv-heads", type=int, default=4, help="G (default 4)")
    p.add_argument("--clips", type=int, default=16, help="calibration examples (default 16)")
    p.add_argument("--repeats", type=int, default=1, help="conversions per fit, best kept (default 1)")
    p.add_argument("--workdir", help="where the outputs are written (default: a temporary folder, removed)")
    return p.parse_args(argv)


def convert(args: argparse.Namespace, fit: str, out: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one conversion in a child process."""
    argv = [sys.executable, "-m", "uptrain", "convert", args.model, str(out), "-g", str(args.kv_heads)]
    argv += ["--pooling", "calibrated", "--calibration-data", args.calibration_data, "--overwrite"]
    argv += ["--calibration-tokens", str(args.clips * 256), "--calibration-device", "cpu", "--value-fit", fit]
    argv += ["--language", args.language] if args.language else []
    began = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(argv[2:])} failed: {child.stderr.read().decode()[-2000:]}")
    child.stderr.close()
    return wall, usage.ru_maxrss * 1024  # KiB on Linux


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-value-fit-"))
    root.mkdir(parents=True, exist_ok=True)
    walls: dict[str, list[float]] = {f: [] for f in FITS}
    rss: dict[str, int] = dict.fromkeys(FITS, 0)
    try:
        for _ in range(args.repeats):
            for fit in FITS:  # alternating: a load that drifts weighs on both alike
                wall, peak = convert(args, fit, root / fit)
                walls[fit].append(wall)
                rss[fit] = max(rss[fit], peak)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    best = {f: min(w) for f, w in walls.items()}
    print(f"{args.model}: G = {args.kv_heads}, {args.clips} calibration examples, best of {args.repeats}")
    print("| --value-fit | wall s | peak RSS MB |\n|---|---|---|")
    for fit in FITS:
        print(f"| {fit} | {best[fit]:.1f} | {rss[fit] / 1e6:.0f} |")
    result = {"wall_s": best, "peak_rss_bytes": rss, "output_over_inputs": best["output"] / best["inputs"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
