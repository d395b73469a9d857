"""Copy speed of the tensors `uptrain convert` copies unchanged, by chunk size.

Why COPY_CHUNK_BYTES (uptrain/convert/io.py) is what it is, and a way to check it on another
CPU: writes a synthetic checkpoint (as bench_convert.py does), then copies the byte ranges of
every tensor except K and V into one output file, through uptrain's own reader with a
reusable buffer of each --chunks size, and with the kernel's copy_file_range. Methods
alternate, --repeats times, each on the footing bench_convert.py gives its paths (source in
the page cache, previous output deleted and synced, free memory refilled).

    python scripts/bench_copy_chunks.py                        # 2 GB; chunks 128K,256K,1M,4M

Prints a table and, as its last line, one JSON object: seconds per method (best and all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_convert import model_shape, refill_free_memory, warm_read


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Copy speed of unchanged tensors by chunk size, vs copy_file_range.")
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (default: 2)")
    p.add_argument("--chunks", default="128K,256K,1M,4M", help="chunk sizes, K or M (default: 128K,256K,1M,4M)")
    p.add_argument("--repeats", type=int, default=4, help="runs per method (default: 4)")
    p.add_argument("--workdir", help="where the checkpoint is written (default: a temporary folder, removed)")
    return p


def parse_chunk(text: str) -> int:
    return int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1].upper()]


def copy_with_chunks(ranges, out: Path, chunk_bytes: int) -> None:
    from uptrain.checkpoint.reader import PositionedReader

    readers: dict[Path, PositionedReader] = {}
    chunk = bytearray(chunk_bytes)
    with open(out, "wb", buffering=0) as dst:
        for path, start, length in ranges:
            reader = readers.get(path) or readers.setdefault(path, PositionedReader(path))
            reader.copy_to(start, length, dst.write, chunk)
    for reader in readers.values():
        reader.file.close()


def copy_in_kernel(ranges, out: Path) -> None:
    files: dict[Path, int] = {}
    with open(out, "wb", buffering=0) as dst:
        for path, start, length in ranges:
            fd = files.get(path) or files.setdefault(path, os.open(path, os.O_RDONLY))
            while length:
                n = os.copy_file_range(fd, dst.fileno(), length, start)
                start, length = start + n, length - n
    for fd in files.values():
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from synthetic_checkpoint import write_synthetic_llama

    from uptrain.checkpoint.reader import SourceCheckpoint

    chunks = {f"chunks {c}": parse_chunk(c) for c in args.chunks.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-copy-", dir=args.workdir) as tmp:
        work = Path(tmp)
        src = write_synthetic_llama(work / "src", **model_shape(args.size_gb * 1e9), dtype=torch.bfloat16)
        source = SourceCheckpoint(src)
        ranges = [
            (t.file, t.start, t.nbytes)
            for t in source.order()
            if not t.name.endswith(("k_proj.weight", "v_proj.weight"))
        ]
        source.close()
        total = sum(n for _, _, n in ranges)
        methods = {
            **{name: (lambda out, n=n: copy_with_chunks(ranges, out, n)) for name, n in chunks.items()},
            "copy_file_range": lambda out: copy_in_kernel(ranges, out),
        }
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(args.repeats):
            names = list(methods)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                out = work / "out"
                out.unlink(missing_ok=True)
                os.sync()
                warm_read(src)
                refill_free_memory(2 * total)
                start = time.perf_counter()
                methods[name](out)
                seconds[name].append(round(time.perf_counter() - start, 3))
                print(f"  rep {rep + 1}/{args.repeats} {name:<18} {seconds[name][-1]:6.3f} s", file=sys.stderr)
        shutil.rmtree(src)
    print(
        f"copy: the {total / 1e9:.2f} GB of unchanged tensors of a {args.size_gb:g} GB checkpoint, "
        f"warm page cache, best of {args.repeats}"
    )
    print(f"{'method':<18} {'best s':>7} {'GB/s':>6}  all runs (s)")
    for name, runs in seconds.items():
        print(f"{name:<18} {min(runs):7.3f} {total / 1e9 / min(runs):6.2f}  {' '.join(f'{r:.2f}' for r in runs)}")
    print(
        json.dumps(
            {
                "bytes": total,
                "repeats": args.repeats,
                "seconds": {name: min(runs) for name, runs in seconds.items()},
                "seconds_all": seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
