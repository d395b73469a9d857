"""Conversion time and peak memory: `uptrain convert` against the I/O floor and the naive path.

Writes a synthetic sharded MHA Llama checkpoint (random bf16 weights straight to safetensors,
no model object), then runs each path as its own child process, so `os.wait4` reports that
child's peak RSS alone and every path pays the same interpreter start:

  baseline  python -c "import torch, uptrain.convert"        (startup and resident floor)
  floor     read and write the same bytes: every shard file copied (kernel copy), and
            separately every tensor read and written once with safetensors; the faster is
            the floor
  uptrain   python -m uptrain convert SRC OUT -g G          (the real CLI, BLAKE3 provenance
            digests by default; also shown, not used in the targets: --source-hash sha256
            and --source-hash none)
  naive     AutoModelForCausalLM.from_pretrained → mean-pool K/V in Python → save_pretrained

Warm page cache for every path: the source is read once, untimed, before each run; outputs
are deleted and `sync` flushed between runs so one path's write-back does not slow the next;
and twice the checkpoint's size of memory is touched and freed before each run, so that no
path pays alone for a VM host handing idle memory back (see refill_free_memory).
Paths run in rotated order, --repeats times; the best time and the largest peak RSS per path
are kept, and the ratios compare numbers measured side by side in this one run. Then `uptrain
convert` runs once more on a checkpoint with twice the layers: its peak RSS must not grow.

CPU (default):
    python scripts/bench_convert.py                 # about 2 GB; needs ~4x that in --workdir
    python scripts/bench_convert.py --size-gb 14    # a 7B-sized bf16 checkpoint
GPU: `uptrain convert` streams on the CPU whatever the machine (it is I/O bound); with
--device cuda the naive path loads the model onto the GPU (bf16) and pools there:
    python scripts/bench_convert.py --device cuda --size-gb 14

Prints a table, then as its last line one JSON object with time_ratio_vs_floor,
time_ratio_vs_naive, rss_ratio_vs_naive, peak_rss_bytes, baseline_rss_bytes,
largest_tensor_bytes, largest_shard_bytes and the per-path figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Llama-7B proportions scaled down: head_dim 128, MLP 2.6875 × hidden, 32k vocabulary.
HIDDEN, HEADS, VOCAB = 2048, 16, 32000
# uptrain_sha256 and uptrain_nohash are informational: what the provenance digest costs.
PATHS = ("baseline", "floor_copy", "floor_safetensors", "uptrain", "uptrain_sha256", "uptrain_nohash", "naive")
SOURCE_HASH = {"uptrain_sha256": "sha256", "uptrain_nohash": "none"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time and peak RSS of `uptrain convert` vs the I/O floor and from_pretrained → pool → "
        "save_pretrained, on a synthetic sharded MHA Llama checkpoint. On a GPU: --device cuda "
        "(the naive path then loads bf16 onto the GPU; uptrain always streams on the CPU).",
        epilog="GPU example: python scripts/bench_convert.py --device cuda --size-gb 14",
    )
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (default: 2)")
    p.add_argument(
        "--num-kv-heads",
        "-g",
        type=int,
        default=4,
        metavar="G",
        help=f"KV heads after conversion; the model has {HEADS} heads (default: 4)",
    )
    p.add_argument("--shard-size-mb", type=int, default=500, help="source shard size in MB (default: 500)")
    p.add_argument("--repeats", type=int, default=3, help="runs per path, best time kept (default: 3)")
    p.add_argument("--device", default="cpu", help="device for the naive path: cpu or cuda (default: cpu)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive path (it needs RAM for the whole model)")
    p.add_argument("--no-double", action="store_true", help="skip the twice-the-layers memory check")
    p.add_argument("--workdir", help="where checkpoints are written (default: a temporary folder, removed)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # internal: run one path in this process
    return p


def model_shape(size_bytes: float) -> dict:
    """Llama dimensions whose bf16 checkpoint is about `size_bytes`.

    Layers are added to a fixed width; below about 0.5 GB the width and vocabulary halve until
    at least two layers fit, so a test-sized checkpoint still has the same structure.
    """
    hidden, vocab = HIDDEN, VOCAB
    while True:
        intermediate = int(2.6875 * hidden) // 64 * 64
        per_layer = (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) * 2
        fixed = (2 * vocab * hidden + hidden) * 2  # embed_tokens, lm_head, final norm
        if fixed + 2 * per_layer <= size_bytes or hidden <= 256:
            break
        hidden, vocab = hidden // 2, vocab // 2
    layers = max(2, round((size_bytes - fixed) / per_layer))
    return dict(hidden=hidden, heads=HEADS, intermediate=intermediate, vocab=vocab, layers=layers)


# Linux carries the spawning process's resident high-water mark into a child's ru_maxrss
# (exec records the old, forked address space's peak). Spawned from this script, which has
# imported torch, every child would report at least this script's RSS; so a lean launcher
# interpreter (about 10 MB) spawns each measured command and reports its wait4 figures.
LAUNCHER = """
import json, os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps([time.perf_counter() - start, os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024,
                  usage.ru_utime + usage.ru_stime]))
"""


def run_child(argv: list[str]) -> tuple[float, int, float]:
    """Run a command; return its wall seconds, its own peak RSS in bytes and its CPU seconds."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"launcher failed:\n{proc.stderr[-3000:]}")
    seconds, code, peak, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {code}):\n{proc.stderr[-3000:]}")
    return seconds, peak, cpu  # ru_maxrss is in KiB on Linux, converted by the launcher


def warm_read(folder: Path) -> None:
    """Read every source file once so each timed path starts with the source in page cache."""
    buffer = bytearray(16 * 2**20)
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def refill_free_memory(nbytes: int) -> None:
    """Touch, then free, up to `nbytes` of memory right before a timed run.

    On a VM with free page reporting (virtio-balloon on the machine in BENCHMARKS.md),
    memory left free for a few seconds goes back to the host and faults in slowly when next
    used: whichever path first writes gigabytes after a pause (or after another path) pays
    up to a second of system time the others do not. Touching it first treats every path alike.
    """
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    block = bytearray(min(nbytes, available // 2))  # zero-filled: every page is touched
    del block


def commands(path: str, src: Path, out: Path, args) -> list[str]:
    py, me = sys.executable, str(Path(__file__).resolve())
    if path == "baseline":
        return [py, "-c", "import torch, uptrain.convert"]
    if path.startswith("uptrain"):
        digest = ["--source-hash", SOURCE_HASH[path]] if path in SOURCE_HASH else []
        return [py, "-m", "uptrain", "convert", str(src), str(out), "-g", str(args.num_kv_heads), *digest]
    if path == "naive":
        return [py, me, "--child", "naive", str(src), str(out), str(args.num_kv_heads), args.device]
    return [py, me, "--child", path, str(src), str(out)]


# ---- the paths that run as children of this script --------------------------------------


def child_floor_copy(src: Path, out: Path) -> None:
    import torch  # noqa: F401  same interpreter start as every other path

    out.mkdir()
    for path in sorted(src.iterdir()):
        shutil.copyfile(path, out / path.name)  # copy_file_range: the kernel moves the bytes


def child_floor_safetensors(src: Path, out: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir()
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        save_file(tensors, out / path.name, metadata={"format": "pt"})
        del tensors
    for path in src.glob("*.json"):
        shutil.copyfile(path, out / path.name)


def child_naive(src: Path, out: Path, num_kv_heads: int, device: str) -> None:
    """What a user writes without a streaming converter: load everything, pool, save."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": device} if device != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, **kwargs)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group = kv_heads // num_kv_heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for name in ("k_proj", "v_proj"):
                old = getattr(attn, name)
                # Contiguous groups: KV head k's rows are [k·d, (k+1)·d); average each group of `group`.
                pooled = old.weight.view(num_kv_heads, group, head_dim, -1).float().mean(1)
                new = torch.nn.Linear(
                    old.in_features,
                    num_kv_heads * head_dim,
                    bias=False,
                    dtype=old.weight.dtype,
                    device=old.weight.device,
                )
                new.weight.copy_(pooled.reshape(num_kv_heads * head_dim, -1))
                setattr(attn, name, new)
            attn.num_key_value_groups = heads // num_kv_heads
    config.num_key_value_heads = num_kv_heads
    model.save_pretrained(out)


def run_as_child(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kind, src, out = argv[0], Path(argv[1]), Path(argv[2])
    if kind == "floor_copy":
        child_floor_copy(src, out)
    elif kind == "floor_safetensors":
        child_floor_safetensors(src, out)
    elif kind == "naive":
        child_naive(src, out, int(argv[3]), argv[4])
    else:
        raise SystemExit(f"unknown child {kind}")
    return 0


# ---- the benchmark -----------------------------------------------------------------------


def checkpoint_facts(folder: Path) -> dict:
    from uptrain.checkpoint.reader import SourceCheckpoint

    source = SourceCheckpoint(folder)
    try:
        return {
            "total_bytes": sum(t.nbytes for t in source.tensors.values()),
            "largest_tensor_bytes": max(t.nbytes for t in source.tensors.values()),
            "largest_shard_bytes": max(p.stat().st_size for p in source.files),
            "shards": len(source.files),
        }
    finally:
        source.close()


def measure_paths(src: Path, work: Path, facts: dict, args) -> dict[str, dict]:
    paths = [p for p in PATHS if not (p == "naive" and args.no_naive)]
    times: dict[str, list[float]] = {p: [] for p in paths}
    rss: dict[str, list[int]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    for rep in range(args.repeats):
        order = paths[rep % len(paths) :] + paths[: rep % len(paths)]  # rotate: no path always goes first
        for path in order:
            out = work / f"out-{path}"
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # flush the previous path's dirty pages before the clock starts
            warm_read(src)
            refill_free_memory(2 * facts["total_bytes"])
            seconds, peak, cpu_seconds = run_child(commands(path, src, out, args))
            times[path].append(seconds)
            rss[path].append(peak)
            cpu[path].append(cpu_seconds)
            print(
                f"  rep {rep + 1}/{args.repeats} {path:<18} {seconds:7.2f} s  CPU {cpu_seconds:6.2f} s  "
                f"peak RSS {peak / 2**20:8.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
    return {
        p: {
            "seconds": min(times[p]),
            "seconds_all": [round(t, 3) for t in times[p]],
            "cpu_seconds": min(cpu[p]),
            "peak_rss_bytes": max(rss[p]),
        }
        for p in paths
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return run_as_child(args.child)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from synthetic_checkpoint import write_synthetic_llama

    shape = model_shape(args.size_gb * 1e9)
    if HEADS % args.num_kv_heads:
        raise SystemExit(f"--num-kv-heads must divide {HEADS}")
    with tempfile.TemporaryDirectory(prefix="bench-convert-", dir=args.workdir) as tmp:
        work = Path(tmp)
        print(f"writing a {args.size_gb:g} GB synthetic checkpoint: {shape}", file=sys.stderr, flush=True)
        src = write_synthetic_llama(
            work / "src", **shape, dtype=torch.bfloat16, max_shard_bytes=args.shard_size_mb * 10**6
        )
        facts = checkpoint_facts(src)
        results = measure_paths(src, work, facts, args)
        shutil.rmtree(src)
        double = None
        if not args.no_double:
            print("writing the twice-the-layers checkpoint", file=sys.stderr, flush=True)
            src2 = write_synthetic_llama(
                work / "src2x",
                **{**shape, "layers": 2 * shape["layers"]},
                dtype=torch.bfloat16,
                max_shard_bytes=args.shard_size_mb * 10**6,
            )
            os.sync()
            warm_read(src2)
            total2 = checkpoint_facts(src2)["total_bytes"]
            refill_free_memory(2 * total2)
            seconds, peak, cpu_seconds = run_child(commands("uptrain", src2, work / "out-2x", args))
            double = {
                "layers": 2 * shape["layers"],
                "total_bytes": total2,
                "seconds": round(seconds, 3),
                "cpu_seconds": round(cpu_seconds, 3),
                "peak_rss_bytes": peak,
            }

    report = summarize(shape, facts, results, double, args)
    print_table(report, results, double)
    print(json.dumps(report))
    return 0


def summarize(shape: dict, facts: dict, results: dict, double: dict | None, args) -> dict:
    a, base = results["uptrain"], results["baseline"]
    floor_path = min(("floor_copy", "floor_safetensors"), key=lambda p: results[p]["seconds"])
    floor = results[floor_path]
    naive = results.get("naive")
    largest = facts["largest_tensor_bytes"]
    over_baseline = a["peak_rss_bytes"] - base["peak_rss_bytes"]
    report = {
        "size_gb": args.size_gb,
        "checkpoint_bytes": facts["total_bytes"],
        **shape,
        "source_shards": facts["shards"],
        "num_kv_heads": args.num_kv_heads,
        "repeats": args.repeats,
        "device": args.device,
        "threads_available": os.cpu_count(),
        "time_ratio_vs_floor": round(a["seconds"] / floor["seconds"], 3),
        "time_ratio_vs_floor_by_source_hash": {
            digest: round(results[p]["seconds"] / floor["seconds"], 3)
            for p, digest in [("uptrain", "blake3"), *((p, SOURCE_HASH[p]) for p in SOURCE_HASH)]
        },
        "time_ratio_vs_naive": round(a["seconds"] / naive["seconds"], 3) if naive else None,
        "rss_ratio_vs_naive": round(a["peak_rss_bytes"] / naive["peak_rss_bytes"], 3) if naive else None,
        "peak_rss_bytes": a["peak_rss_bytes"],
        "baseline_rss_bytes": base["peak_rss_bytes"],
        "largest_tensor_bytes": largest,
        "largest_shard_bytes": facts["largest_shard_bytes"],
        "rss_over_baseline_in_largest_tensors": round(over_baseline / largest, 3),
        "floor_path": floor_path,
        # Interpreter start (import torch) is paid by every path alike; without it the ratio
        # shows the I/O work alone.
        # (Undefined when the checkpoint is so small that startup is all there is.)
        "time_ratio_vs_floor_excluding_startup": (
            round((a["seconds"] - base["seconds"]) / (floor["seconds"] - base["seconds"]), 3)
            if floor["seconds"] - base["seconds"] > 0.1 * floor["seconds"]
            else None
        ),
        "seconds": {p: round(r["seconds"], 3) for p, r in results.items()},
        "seconds_all": {p: r["seconds_all"] for p, r in results.items()},
        "cpu_seconds": {p: round(r["cpu_seconds"], 3) for p, r in results.items()},
        "peak_rss": {p: r["peak_rss_bytes"] for p, r in results.items()},
        "double_layers": double,
    }
    targets = {
        "time_ratio_vs_floor<=1.2": report["time_ratio_vs_floor"] <= 1.2,
        "rss_over_baseline<=3x_largest_tensor": over_baseline <= 3 * largest,
    }
    if naive:
        targets["rss_ratio_vs_naive<=0.2"] = report["rss_ratio_vs_naive"] <= 0.2
    if double:
        double["rss_growth_bytes"] = double["peak_rss_bytes"] - a["peak_rss_bytes"]
        # "Must not raise": allow page-granularity noise of 1% of the peak.
        targets["double_layers_rss_not_higher"] = double["rss_growth_bytes"] <= 0.01 * a["peak_rss_bytes"]
    report["targets_met"] = targets
    return report


def print_table(report: dict, results: dict, double: dict | None) -> None:
    gb = report["checkpoint_bytes"] / 1e9
    print(
        f"convert: synthetic MHA Llama, {gb:.2f} GB bf16 in {report['source_shards']} shards, "
        f"{report['layers']} layers, hidden {report['hidden']}, {report['heads']} heads → "
        f"G={report['num_kv_heads']}; largest tensor {report['largest_tensor_bytes'] / 2**20:.0f} MiB; "
        f"best of {report['repeats']}, warm page cache"
    )
    labels = {
        "baseline": "baseline (import torch)",
        "floor_copy": "(b) floor: file copy",
        "floor_safetensors": "(b) floor: safetensors r/w",
        "uptrain": "(a) uptrain convert",
        "uptrain_sha256": "(a) --source-hash sha256",
        "uptrain_nohash": "(a) --source-hash none",
        "naive": "(c) naive from_pretrained",
    }
    header = f"{'path':<28} {'seconds':>8} {'GB/s':>6} {'CPU s':>6} {'peak RSS MiB':>12} {'over baseline MiB':>17}"
    print(header)
    print("-" * len(header))
    base_rss = results["baseline"]["peak_rss_bytes"]
    for path, r in results.items():
        rate = "" if path == "baseline" else f"{gb / r['seconds']:6.2f}"
        print(
            f"{labels[path]:<28} {r['seconds']:8.2f} {rate:>6} {r['cpu_seconds']:6.2f} "
            f"{r['peak_rss_bytes'] / 2**20:12.0f} "
            f"{(r['peak_rss_bytes'] - base_rss) / 2**20:17.0f}"
        )
    if double:
        print(
            f"{'(a) with 2x layers':<28} {double['seconds']:8.2f} "
            f"{double['total_bytes'] / 1e9 / double['seconds']:6.2f} "
            f"{double['cpu_seconds']:6.2f} "
            f"{double['peak_rss_bytes'] / 2**20:12.0f} {(double['peak_rss_bytes'] - base_rss) / 2**20:17.0f}"
        )
    print(
        f"time a/floor {report['time_ratio_vs_floor']} (target ≤ 1.2; {report['floor_path']}), "
        f"excluding startup {report['time_ratio_vs_floor_excluding_startup']}; by --source-hash "
        f"{report['time_ratio_vs_floor_by_source_hash']}; "
        f"time a/naive {report['time_ratio_vs_naive']}; RSS a/naive {report['rss_ratio_vs_naive']} (target ≤ 0.2); "
        f"RSS over baseline = {report['rss_over_baseline_in_largest_tensors']} × largest tensor (target ≤ 3)"
    )
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["targets_met"].items()))


if __name__ == "__main__":
    raise SystemExit(main())
