"""Peak memory and time of calibration: layer by layer (uptrain) vs the whole model at once.

Writes a synthetic sharded MHA Llama checkpoint (random bf16 weights straight to safetensors,
no model object; the same shapes as scripts/bench_convert.py) with the repo's tokenizer, and
calibration text from the repo's corpus. Then runs each path as its own child process, so
`os.wait4` reports that child's peak RSS alone:

  baseline   the imports every path pays (torch, transformers, datasets, uptrain), no model
  layerwise  uptrain.convert.calibration.collect_attention_moments: the model built on the
             meta device, one decoder layer at a time read from the shards, moments spilled
             (what `uptrain compare` keeps; every conversion did this before issue #20)
  solved     (--solved) uptrain.convert.pipeline.calibrate as `uptrain convert --pooling calibrated` and
             `uptrain train --source` run it since issue #20: the layerwise pass, each layer's
             merge solved as soon as its moment is complete and the moment dropped
  whole      the path uptrain had before (issue #11): AutoModelForCausalLM.from_pretrained in
             the forward dtype, forward pre-hooks on every attention module, every layer's
             moment held in memory
  merge      (--merge-hidden N) one layer's calibrated merge at hidden N (4096: Llama-2-7B's
             attention: 32 heads of 128, to 8 KV heads) on a random layer and moment: CPU
             seconds to solve it (needs C) and to apply it (weights only), --threads threads
             (default 1, as under `accelerate launch`, which sets OMP_NUM_THREADS=1)

Both paths read the same blocks in the same batches and save their first and last layer's
moments; the report gives the largest relative difference between them. Then the layerwise
path runs once more on a checkpoint with twice the layers: its peak RSS must not grow.

CPU (default; the forward pass costs ~2 FLOPs per parameter per token, so --tokens is small):
    python scripts/bench_calibrate.py                         # ~2 GB checkpoint, 4096 tokens
GPU (7B-shaped checkpoint, ~13.5 GB bf16; peak GPU memory reported too):
    python scripts/bench_calibrate.py --device cuda --shape 7b --tokens 32768 --no-double

With the conversions' path:  python scripts/bench_calibrate.py --solved [--no-whole --no-double]
One layer's merge timed:    python scripts/bench_calibrate.py --merge-only [--merge-hidden 4096] [--threads N]

Prints a table, then as its last line one JSON object with rss_ratio_vs_whole,
rss_over_baseline_bytes (per path), seconds_per_token (per path), double_layers and
targets_met (rss_ratio_vs_whole<=0.25, double_layers_rss_not_higher).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import model_shape, warm_read  # noqa: E402  (same synthetic shapes, same cache warming)

# Llama-2-7B's attention and MLP shapes (the vocabulary is the same 32000).
SHAPE_7B = dict(hidden=4096, heads=32, intermediate=11008, vocab=32000, layers=32)
PATHS = ("baseline", "layerwise", "solved", "whole")

# Linux carries the spawning process's resident high-water mark into a child's ru_maxrss, so a
# lean launcher interpreter spawns each measured child (see scripts/bench_convert.py); this one
# also relays the child's last stdout line (its own timings).
LAUNCHER = """
import json, os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)
out = proc.stdout.read()
_, status, usage = os.wait4(proc.pid, 0)
lines = out.strip().splitlines()
print(json.dumps([time.perf_counter() - start, os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024,
                  usage.ru_utime + usage.ru_stime, lines[-1] if lines else "{}"]))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Peak RSS (and GPU memory) and time per token of layer-by-layer calibration vs the whole-model "
        "path, on a synthetic sharded MHA Llama checkpoint.",
        epilog="GPU example: python scripts/bench_calibrate.py --device cuda --shape 7b --tokens 32768 --no-double",
    )
    p.add_argument(
        "--size-gb",
        type=float,
        default=2.0,
        help="checkpoint size in GB, bench_convert's shapes (default: 2; ignored with --shape 7b)",
    )
    p.add_argument(
        "--shape",
        choices=("sized", "7b"),
        default="sized",
        help="'7b': Llama-2-7B's shapes (hidden 4096, 32 layers, MLP 11008), ~13.5 GB bf16",
    )
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default: 4096)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block (default: 256)")
    p.add_argument("--batch-size", type=int, default=4, help="blocks per forward pass (default: 4)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="forward-pass dtype (default: float32; moments are float64 either way)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    p.add_argument("--no-whole", action="store_true", help="skip the whole-model path (it needs the model in RAM)")
    p.add_argument(
        "--solved", action="store_true", help="also run the conversions' path, which solves each layer's merge"
    )
    p.add_argument(
        "--merge-hidden",
        type=int,
        default=None,
        help="also time one layer's calibrated merge at this hidden size (4096: Llama-2-7B's; default: not timed)",
    )
    p.add_argument("--merge-only", action="store_true", help="only time one layer's merge (--merge-hidden, or 4096)")
    p.add_argument("--no-double", action="store_true", help="skip the twice-the-layers memory check")
    p.add_argument("--workdir", help="where checkpoints are written (default: a temporary folder, removed)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # internal: run one path in this process
    return p


# ---- the paths that run as children of this script --------------------------------------


def _imports():
    """What every path imports, the baseline included: the same interpreter floor for all."""
    import datasets  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import uptrain.convert.calibration  # noqa: F401
    import uptrain.data.text  # noqa: F401

    return torch


def child_layerwise(src: Path, data: str, opts: dict):
    """uptrain's path; the moments stay spilled (read back one layer at a time, as the merge does)."""
    from uptrain.convert.calibration import collect_attention_moments
    from uptrain.convert.spec import CalibrationSettings

    moments, info = collect_attention_moments(
        src,
        data,
        CalibrationSettings(
            calibration_tokens=opts["tokens"],
            calibration_seq_len=opts["seq_len"],
            calibration_device=opts["device"],
            calibration_dtype=opts["dtype"],
        ),
        batch_size=opts["batch_size"],
        progress=False,
    )
    return moments, info["tokens"]


def child_solved(src: Path, data: str, opts: dict):
    """The conversions' path: each layer's calibrated merge solved as its moment completes."""
    from uptrain.convert.pipeline import calibrate, prepare
    from uptrain.convert.spec import conversion_spec

    spec = conversion_spec(
        source=str(src),
        num_kv_heads=opts["groups"],
        pooling="calibrated",
        calibration_data=data,
        calibration_tokens=opts["tokens"],
        calibration_seq_len=opts["seq_len"],
        calibration_device=opts["device"],
        calibration_dtype=opts["dtype"],
    )
    with prepare(spec) as prepared:
        calibration = calibrate(prepared, progress=False)
    held = sum(
        t.numel() * t.element_size()
        for solution in calibration.solved.values()
        for t in _solution_tensors(solution.merge)
    )
    return calibration, calibration.info["tokens"], held


def _solution_tensors(solution):
    yield from (*solution.value_mix, *solution.value_maps)
    for part in (*solution.key_rotary, *solution.key_plain):
        if part is not None:
            yield from (part.alpha, part.e, part.lam, part.sigma)


def child_merge(opts: dict) -> dict:
    """One layer's calibrated merge at hidden `merge_hidden`: solve (with C) and apply (without)."""
    import torch

    from uptrain.convert.calibrated import LayerAttention, apply_calibrated, solve_calibrated

    hidden = opts["merge_hidden"]
    heads, device = max(1, hidden // 128), torch.device(opts["device"])
    groups = max(1, heads // 4)  # 32 → 8 KV heads at hidden 4096, as configs/llama2-7b_gqa8.yaml
    gen = torch.Generator().manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / hidden**0.5).to(device)

    x = torch.randn(4 * hidden, hidden + 1, generator=gen, dtype=torch.float64).to(device)
    x[:, -1] = 1  # the augmented constant input
    c = x.mT @ x / x.shape[0]
    del x
    layer = LayerAttention(
        weight(hidden, hidden), weight(hidden, hidden), weight(hidden, hidden), weight(hidden, hidden),
        None, None, None, heads, heads, hidden // heads, hidden // heads,
    )  # fmt: skip
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    for step in ("solve", "apply"):
        cpu, wall = time.process_time(), time.perf_counter()
        if step == "solve":
            solution = solve_calibrated(layer, groups, c)
        else:
            apply_calibrated(layer, groups, solution)
        sync()
        times[f"{step}_cpu_seconds"] = round(time.process_time() - cpu, 2)
        times[f"{step}_wall_seconds"] = round(time.perf_counter() - wall, 2)
    return {"hidden": hidden, "heads": heads, "groups": groups, "threads": torch.get_num_threads(), **times}


def child_whole(src: Path, data: str, opts: dict):
    """The whole-model path, as uptrain ran it before calibrating layer by layer."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from uptrain.convert.calibration import (
        attention_input,
        calibration_device,
        fold_attention_input,
        load_calibration_tokenizer,
    )
    from uptrain.data.text import load_blocks

    device, dtype = calibration_device(opts["device"], opts["dtype"])
    blocks, _ = load_blocks(
        data,
        "calibration_data",
        load_calibration_tokenizer(src),
        opts["seq_len"],
        text_field="text",
        split="train",
        dataset_config=None,
        sample_by="paragraph",
        streaming=False,
        workers=None,
    )
    count = min(math.ceil(opts["tokens"] / opts["seq_len"]), len(blocks))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=str(device)).eval()
    hidden = model.config.hidden_size
    moments = {
        i: torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64, device=device)
        for i in range(len(model.model.layers))
    }
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: fold_attention_input(moments[i], attention_input(args, kwargs)),
            with_kwargs=True,
        )
    with torch.no_grad():
        for start in range(0, count, opts["batch_size"]):
            ids = blocks.take(list(range(start, min(start + opts["batch_size"], count)))).to(device)
            model(ids, use_cache=False)
    tokens = count * opts["seq_len"]
    return {i: (m / tokens).cpu() for i, m in moments.items()}, tokens


def run_as_child(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    kind = argv[0]
    torch = _imports()
    if kind == "baseline":
        print(json.dumps({}))
        return 0
    if kind == "merge":
        opts = json.loads(argv[1])
        torch.set_num_threads(opts["threads"] or 1)
        print(json.dumps(child_merge(opts)))
        return 0
    src, data, opts, saved = Path(argv[1]), argv[2], json.loads(argv[3]), Path(argv[4])
    if kind == "tokenize":  # fills the datasets cache, so that no measured path pays for tokenizing
        from uptrain.convert.calibration import load_calibration_tokenizer
        from uptrain.data.text import load_blocks

        load_blocks(
            data,
            "calibration_data",
            load_calibration_tokenizer(src),
            opts["seq_len"],
            text_field="text",
            split="train",
            dataset_config=None,
            sample_by="paragraph",
            streaming=False,
            workers=None,
        )
        print(json.dumps({}))
        return 0
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    cuda = opts["device"].startswith("cuda")
    start = time.perf_counter()
    held = None
    if kind == "solved":
        _, tokens, held = child_solved(src, data, opts)
    else:
        moments, tokens = (child_layerwise if kind == "layerwise" else child_whole)(src, data, opts)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if kind != "solved":
        from safetensors.torch import save_file

        last = max(moments)
        save_file({"first": moments[0].contiguous(), "last": moments[last].contiguous()}, saved)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "tokens": tokens,
                "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "solutions_bytes": held,
            }
        )
    )
    return 0


# ---- the benchmark -----------------------------------------------------------------------


def run_child(argv: list[str]) -> dict:
    """Run a command through the launcher: its wall seconds, own peak RSS, CPU seconds and report."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"launcher failed:\n{proc.stderr[-3000:]}")
    wall, code, peak, cpu, report = json.loads(proc.stdout.strip().splitlines()[-1])
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed (exit {code}):\n{proc.stderr[-3000:]}")
    return {"wall_seconds": wall, "peak_rss_bytes": peak, "cpu_seconds": cpu, **json.loads(report)}


def write_checkpoint(folder: Path, shape: dict) -> Path:
    import torch
    from synthetic_checkpoint import write_synthetic_llama

    from uptrain.data.corpus import load_tokenizer

    write_synthetic_llama(folder, **shape, dtype=torch.bfloat16)
    load_tokenizer().save_pretrained(folder)  # calibration reads text through the source's tokenizer
    return folder


def write_text(path: Path, tokens: int) -> Path:
    """Enough of the repo's corpus (public-domain English) for `tokens` tokens, as JSON lines."""
    from uptrain.data.corpus import read_documents

    chars, lines = 0, []
    for document in read_documents("train"):
        lines.append(json.dumps({"text": document["text"]}) + "\n")
        chars += len(document["text"])
        if chars > 8 * tokens:  # ~4 characters a token, twice over
            break
    path.write_text("".join(lines))
    return path


def max_relative_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return max(((x[k] - y[k]).norm() / y[k].norm()).item() for k in x)


def measure(src: Path, data: Path, work: Path, opts: dict, paths) -> dict[str, dict]:
    me = str(Path(__file__).resolve())
    results = {}
    run_child([sys.executable, me, "--child", "tokenize", str(src), str(data), json.dumps(opts), "-"])
    for path in paths:
        os.sync()
        if path != "baseline":
            warm_read(src)
        argv = [sys.executable, me, "--child", path]
        if path != "baseline":
            argv += [str(src), str(data), json.dumps(opts), str(work / f"moments-{path}.safetensors")]
        results[path] = run_child(argv)
        r = results[path]
        print(
            f"  {path:<10} {r['wall_seconds']:8.2f} s  peak RSS {r['peak_rss_bytes'] / 2**20:8.1f} MiB",
            file=sys.stderr,
            flush=True,
        )
    return results


def time_merge(opts: dict) -> dict:
    """One layer's calibrated merge in its own child process: CPU seconds to solve and to apply."""
    me = str(Path(__file__).resolve())
    print(f"timing one layer's merge at hidden {opts['merge_hidden']}", file=sys.stderr, flush=True)
    merge = run_child([sys.executable, me, "--child", "merge", json.dumps(opts)])
    print(
        f"merge of one layer at hidden {merge['hidden']} ({merge['heads']} heads → {merge['groups']} KV heads, "
        f"{merge['threads']} thread(s), {opts['device']}): solve {merge['solve_cpu_seconds']} CPU-s "
        f"({merge['solve_wall_seconds']} s), apply {merge['apply_cpu_seconds']} CPU-s "
        f"({merge['apply_wall_seconds']} s), "
        f"peak RSS {merge['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    return merge


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return run_as_child(args.child)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    shape = dict(SHAPE_7B) if args.shape == "7b" else model_shape(args.size_gb * 1e9)
    from uptrain.data.corpus import load_tokenizer

    shape["vocab"] = max(shape["vocab"], len(load_tokenizer()))  # every token id must have an embedding
    opts = {
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "groups": max(1, shape["heads"] // 4),  # the merge's KV heads in the solved path
    }
    merge = None
    if args.merge_only or args.merge_hidden:
        merge = time_merge({**opts, "merge_hidden": args.merge_hidden or 4096, "threads": args.threads or 1})
    if args.merge_only:
        print(json.dumps({"merge": merge}))
        return 0
    paths = [p for p in PATHS if not (p == "whole" and args.no_whole) and not (p == "solved" and not args.solved)]
    with tempfile.TemporaryDirectory(prefix="bench-calibrate-", dir=args.workdir) as tmp:
        work = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(work / "datasets-cache")  # the tokenized text goes with the rest
        print(f"writing a synthetic checkpoint: {shape}", file=sys.stderr, flush=True)
        src = write_checkpoint(work / "src", shape)
        data = write_text(work / "calibration.jsonl", args.tokens)
        checkpoint_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        results = measure(src, data, work, opts, paths)
        difference = (
            max_relative_difference(work / "moments-layerwise.safetensors", work / "moments-whole.safetensors")
            if "whole" in results
            else None
        )
        shutil.rmtree(src)
        double = None
        if not args.no_double:
            print("writing the twice-the-layers checkpoint", file=sys.stderr, flush=True)
            src2 = write_checkpoint(work / "src2x", {**shape, "layers": 2 * shape["layers"]})
            double = {"layers": 2 * shape["layers"], **measure(src2, data, work, opts, ["layerwise"])["layerwise"]}
    report = summarize(shape, checkpoint_bytes, results, double, difference, args)
    if merge is not None:
        report["merge_one_layer"] = merge
    if "solved" in results:
        # What each path keeps of the layers it has calibrated: every moment (spilled to TMPDIR) or
        # each layer's merge solution (in memory).
        report["moments_bytes"] = shape["layers"] * (shape["hidden"] + 1) ** 2 * 8
        report["solutions_bytes"] = results["solved"]["solutions_bytes"]
    print_table(report)
    print(json.dumps(report))
    return 0


def summarize(
    shape: dict, checkpoint_bytes: int, results: dict, double: dict | None, difference: float | None, args
) -> dict:
    base = results["baseline"]["peak_rss_bytes"]
    over = {p: r["peak_rss_bytes"] - base for p, r in results.items() if p != "baseline"}
    measured = [p for p in results if p != "baseline"]
    report = {
        **shape,
        "checkpoint_bytes": checkpoint_bytes,
        "tokens": results["layerwise"]["tokens"],
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
        "threads_available": os.cpu_count(),
        "rss_ratio_vs_whole": round(over["layerwise"] / over["whole"], 4) if "whole" in over else None,
        "baseline_rss_bytes": base,
        "peak_rss_bytes": {p: r["peak_rss_bytes"] for p, r in results.items()},
        "rss_over_baseline_bytes": over,
        "gpu_peak_bytes": {p: results[p]["gpu_peak_bytes"] for p in measured},
        "calibration_seconds": {p: round(results[p]["seconds"], 3) for p in measured},
        "seconds_per_token": {p: results[p]["seconds"] / results[p]["tokens"] for p in measured},
        "wall_seconds": {p: round(r["wall_seconds"], 3) for p, r in results.items()},
        # CPU seconds of the whole child: on a shared machine, wall time also counts other jobs.
        "cpu_seconds": {p: round(r["cpu_seconds"], 3) for p, r in results.items()},
        "moments_max_relative_difference": difference,
        "double_layers": double,
    }
    targets = {}
    if "whole" in over:
        targets["rss_ratio_vs_whole<=0.25"] = report["rss_ratio_vs_whole"] <= 0.25
    if double:
        double["rss_over_baseline_bytes"] = double["peak_rss_bytes"] - base
        double["rss_growth_bytes"] = double["peak_rss_bytes"] - results["layerwise"]["peak_rss_bytes"]
        double["seconds_per_token"] = double["seconds"] / double["tokens"]
        # "Must not raise": allow page-granularity noise of 1% of the peak (as bench_convert.py).
        targets["double_layers_rss_not_higher"] = (
            double["rss_growth_bytes"] <= 0.01 * results["layerwise"]["peak_rss_bytes"]
        )
    report["targets_met"] = targets
    return report


def print_table(report: dict) -> None:
    print(
        f"calibrate: synthetic MHA Llama, {report['checkpoint_bytes'] / 1e9:.2f} GB bf16, "
        f"{report['layers']} layers, hidden {report['hidden']}; {report['tokens']} tokens "
        f"(seq {report['seq_len']}, batch {report['batch_size']}) on {report['device']} in {report['dtype']}"
    )
    header = (
        f"{'path':<22} {'calib s':>8} {'ms/token':>9} {'CPU s':>7} {'peak RSS MiB':>12} "
        f"{'over baseline MiB':>17} {'GPU MiB':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = [(p, report["peak_rss_bytes"][p]) for p in report["peak_rss_bytes"]]
    double = report["double_layers"]
    for path, peak in rows + ([("layerwise, 2x layers", double["peak_rss_bytes"])] if double else []):
        source = double if path.endswith("2x layers") else None
        seconds = (source or {}).get("seconds", report["calibration_seconds"].get(path))
        per_token = (source or {}).get("seconds_per_token", report["seconds_per_token"].get(path))
        gpu = (source or {}).get("gpu_peak_bytes", report["gpu_peak_bytes"].get(path))
        cpu = (source or {}).get("cpu_seconds", report["cpu_seconds"].get(path))
        print(
            f"{path:<22} {'' if seconds is None else f'{seconds:8.2f}':>8} "
            f"{'' if per_token is None else f'{per_token * 1e3:9.3f}':>9} {cpu:7.1f} {peak / 2**20:12.0f} "
            f"{(peak - report['baseline_rss_bytes']) / 2**20:17.0f} "
            f"{'' if gpu is None else f'{gpu / 2**20:8.0f}':>8}"
        )
    print(
        f"RSS over baseline, layerwise / whole: {report['rss_ratio_vs_whole']} (target ≤ 0.25); moments' largest "
        f"relative difference {report['moments_max_relative_difference']}"
    )
    if "solutions_bytes" in report:
        print(
            f"kept across layers: every moment {report['moments_bytes'] / 2**20:.0f} MiB (layerwise, spilled) vs "
            f"merge solutions {report['solutions_bytes'] / 2**20:.1f} MiB (solved, {report['layers']} layers)"
        )
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["targets_met"].items()))


if __name__ == "__main__":
    raise SystemExit(main())
