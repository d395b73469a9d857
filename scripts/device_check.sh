#!/usr/bin/env bash
# bash scripts/device_check.sh                         # one GPU, within 8 minutes
# DEVICE_CHECK_SIZE=tiny bash scripts/device_check.sh  # the same steps at test size, on a CPU
#
# The checks to run the day a GPU is lent, in one go, each step under its own time limit:
#   train     scripts/bench_train.py, a ~1B-parameter Llama (hidden 2048 × 22 layers, 16 heads,
#             4 KV heads, MLP 5632) in bf16 autocast, seq 2048 × batch 8: tokens/s and MFU
#             (target ≥ 0.45 on an H100/H200-class GPU), fused AdamW (auto); then AdamW's step alone,
#             for-loop, foreach and fused: fused/foreach step time
#   decode    scripts/bench_decode.py in bf16, the same ~1B shape at 16 → 4 KV heads, contexts
#             1k, 4k and 16k × batch 1 and 8: decode speed-up against its bounds (h/G and the
#             bytes read per step)
#   decode_compile  the same models at 16k × batch 8, eager and compiled (static cache +
#             torch.compile with CUDA graphs, uptrain.speed's --compile path) in one process:
#             tokens/s of each, the speed-ups, and the compile time apart
#   calibrate scripts/bench_calibrate.py --shape 7b on the GPU: one 7B layer's calibrated merge
#             (hidden 4096, 32 → 8 KV heads, fp64) timed on the GPU, then layer-by-layer
#             calibration time per token and peak GPU memory on a 7B-shaped synthetic checkpoint
#             (13.5 GB bf16)
#   uptrain   `uptrain train --source` on a synthetic ~1B MHA Llama: convert to 4 KV heads, train
#             20 steps in bf16 on the shipped corpus, write final/
#
# On the lent GPU machine (Python 3.12, the device tool's), which has no datasets or blake3 and
# reaches no registry: first `bash scripts/device_wheels.sh` here (it fills the git-ignored
# .whl/), then carry .whl; this script installs those wheels into its work folder
# (pip --no-index --no-deps --target) and puts them on PYTHONPATH before anything runs.
#
# Logs: every step's stderr, then its stdout, into $LOGS/<step>.log, with setup.log (wheel
# install, package versions) and summary.json beside them; LOGS is $OUT when set (the folder the
# device tool brings back: 8 files at most, hence one log per step), else a new temporary folder
# that is kept and named in the summary. A step that fails, runs out of time or finds no time
# left is recorded with the tail of its log, and the next step still runs. The last line of
# stdout is one JSON object: {"size", "device", "torch", "versions", "logs", "seconds",
# "steps": {<step>: {"ok", "seconds", "limit", "result" | "error" + "log_tail"}}, "targets_met"}.
#
# Time: each step runs under `timeout` at its own limit, cut to what is left of the whole
# check's budget (CHECK_BUDGET, default 480 s from the start, less the summary's 10 s and the
# 5 s of --kill-after), so the summary is out within the budget even if every step overruns.
#
# Sizes: DEVICE_CHECK_SIZE=gpu (default) or tiny. Any step's arguments can be replaced with
# TRAIN_ARGS, DECODE_ARGS, DECODE_COMPILE_ARGS (bench_decode.py's flags), CALIBRATE_ARGS (script
# flags), UPTRAIN_MODEL (hidden layers heads intermediate, space-separated), UPTRAIN_ARGS
# (`uptrain train` flags) and UPTRAIN_TRAIN_SPLIT (the shipped corpus split it trains on: train,
# or validation at tiny size); time limits with TRAIN_TIMEOUT, DECODE_TIMEOUT,
# DECODE_COMPILE_TIMEOUT, CALIBRATE_TIMEOUT, UPTRAIN_TIMEOUT (seconds); the interpreter with
# PYTHON (default: .venv/bin/python when there is one, else python3); the wheels with WHEELS
# (default: .whl; none installed when the folder is missing); the work folder with WORK
# (default: a temporary folder, removed at the end).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
START=$SECONDS

SIZE=${DEVICE_CHECK_SIZE:-gpu}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 WANDB_MODE=${WANDB_MODE:-disabled}
export TOKENIZERS_PARALLELISM=false
# A step killed at its limit still leaves in its log what it had printed.
export PYTHONUNBUFFERED=1
# The scripts import uptrain from this checkout whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "$SIZE" in
  gpu)
    : "${TRAIN_ARGS:=--device cuda --hidden 2048 --layers 22 --heads 16 --kv-heads 4 --seq-len 2048 --batch-size 8 --steps 12 --warmup 4 --repeats 1}"
    : "${DECODE_ARGS:=--device cuda --dtype bfloat16 --contexts 1024,4096,16384 --batches 1,8 --hidden 2048 --heads 16 --num-kv-heads 4 --layers 22 --vocab 32000 --new-tokens 32 --repeats 3}"
    : "${DECODE_COMPILE_ARGS:=--device cuda --dtype bfloat16 --contexts 16384 --batches 8 --hidden 2048 --heads 16 --num-kv-heads 4 --layers 22 --vocab 32000 --new-tokens 32 --repeats 3}"
    : "${CALIBRATE_ARGS:=--device cuda --shape 7b --dtype bfloat16 --tokens 32768 --seq-len 2048 --batch-size 4 --no-whole --no-double --merge-hidden 4096}"
    : "${UPTRAIN_MODEL:=2048 22 16 5632}"
    : "${UPTRAIN_ARGS:=--num_kv_heads 4 --seq_len 2048 --batch_size 8 --max_steps 20 --warmup_steps 2 --lr 3e-4 --eval_every 20 --save_every 1000 --eval_blocks 16 --mixed_precision bf16}"
    # 430 s of steps + 5 × 5 s of --kill-after + ~15 s of wheels and checks + ~10 s of summary:
    # 480 s. The split between steps is an estimate until a GPU run measures it (each step's
    # seconds are in the summary); decode_compile gets the most, for two compilations of a
    # 22-layer model; calibrate 10 s more than before for one 7B layer's fp64 merge on the GPU
    # (--merge-hidden 4096: a child process, ~5 s of imports, 0.5 GB of random inputs, the solve),
    # timed first so that it is measured even if the calibration runs out of time. The train step
    # runs no compiled loop (bench_train.py --compile): inductor compiling a layer's forward and
    # backward is ~30–60 s on top of its ~60 s; add it with TRAIN_ARGS and a larger TRAIN_TIMEOUT
    # when the budget allows. CHECK_BUDGET holds the total whatever the split.
    : "${TRAIN_TIMEOUT:=85}" "${DECODE_TIMEOUT:=70}" "${DECODE_COMPILE_TIMEOUT:=140}" "${CALIBRATE_TIMEOUT:=80}"
    : "${UPTRAIN_TIMEOUT:=55}"
    ;;
  tiny)
    # --compile: the compiled training loop (inductor's C++ path here) runs through the same code as on a GPU.
    : "${TRAIN_ARGS:=--hidden 64 --layers 2 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 2 --steps 3 --warmup 1 --repeats 1 --compile --optimizer-steps 3}"
    : "${DECODE_ARGS:=--contexts 8,16 --batches 1 --new-tokens 2 --repeats 1 --hidden 64 --heads 8 --num-kv-heads 2 --layers 2 --vocab 128}"
    # torch.compile on a CPU (Inductor's C++ path, no CUDA graphs): the same code as on the GPU.
    : "${DECODE_COMPILE_ARGS:=--contexts 16 --batches 1 --new-tokens 3 --repeats 1 --hidden 64 --heads 8 --num-kv-heads 2 --layers 2 --vocab 128}"
    : "${CALIBRATE_ARGS:=--size-gb 0.005 --tokens 128 --seq-len 64 --threads 1 --no-whole --no-double --merge-hidden 256}"
    : "${UPTRAIN_MODEL:=64 2 8 128}"
    export UPTRAIN_TRAIN_SPLIT=${UPTRAIN_TRAIN_SPLIT:-validation}
    : "${UPTRAIN_ARGS:=--num_kv_heads 2 --seq_len 32 --batch_size 2 --max_steps 2 --warmup_steps 1 --lr 3e-3 --eval_every 2 --save_every 1000 --eval_blocks 2}"
    : "${TRAIN_TIMEOUT:=120}" "${DECODE_TIMEOUT:=120}" "${DECODE_COMPILE_TIMEOUT:=180}" "${CALIBRATE_TIMEOUT:=120}"
    : "${UPTRAIN_TIMEOUT:=120}"
    ;;
  *)
    echo "device_check.sh: DEVICE_CHECK_SIZE must be gpu or tiny, not '$SIZE'" >&2
    exit 2
    ;;
esac
CHECK_BUDGET=${CHECK_BUDGET:-$([[ $SIZE == gpu ]] && echo 480 || echo 900)}
STEPS=(train decode decode_compile calibrate uptrain)

# DEVICE_CHECK_PRINT_ARGS=1: print the resolved arguments as JSON and stop (tests parse the GPU
# preset with each script's own parser, so a typo does not cost a GPU session).
if [[ "${DEVICE_CHECK_PRINT_ARGS:-}" == 1 ]]; then
    exec "$PYTHON" -c 'import json, sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
        train "$TRAIN_ARGS" decode "$DECODE_ARGS" decode_compile "$DECODE_COMPILE_ARGS" calibrate "$CALIBRATE_ARGS" \
        uptrain_model "$UPTRAIN_MODEL" uptrain "$UPTRAIN_ARGS" budget "$CHECK_BUDGET" \
        timeouts "$TRAIN_TIMEOUT $DECODE_TIMEOUT $DECODE_COMPILE_TIMEOUT $CALIBRATE_TIMEOUT $UPTRAIN_TIMEOUT"
fi

KEEP_WORK=${WORK:+1}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/device-check-XXXXXX")}
mkdir -p "$WORK"
[[ -z "$KEEP_WORK" ]] && trap 'rm -rf "$WORK"' EXIT
# torch.compile's kernels (train --compile, decode_compile) are built into the work folder: a step
# killed at its limit while the C++ compiler writes a kernel leaves a truncated .so, which a
# shared cache would hand to every later compile ("file too short"); and compile times are then
# those of a fresh machine, as on the lent GPU.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}
LOGS=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/device-check-logs-XXXXXX")}
mkdir -p "$LOGS"

# fail REASON: the JSON line (and summary.json) for a check that cannot start, then exit 1; the
# reason is the log's last line, the log's tail goes with it.
fail() {
    "$PYTHON" - "$SIZE" "$LOGS" "$1" <<'PY' 2>/dev/null || echo "{\"size\": \"$SIZE\", \"error\": \"cannot run $PYTHON\"}"
import json, sys
from pathlib import Path

size, logs, reason = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
tail = (logs / "setup.log").read_text(errors="replace").strip().splitlines()[-20:]
line = json.dumps({"size": size, "error": f"{reason}: {tail[-1] if tail else 'no output'}", "log_tail": tail,
                   "logs": str(logs)})
(logs / "summary.json").write_text(line + "\n")
print(line)
PY
    exit 1
}

# The wheels the GPU image lacks (scripts/device_wheels.sh), installed where only this run sees
# them: nothing is resolved or fetched, so a missing one shows as an import error just below.
WHEELS=${WHEELS:-.whl}
: >"$LOGS/setup.log"
if [[ -d "$WHEELS" ]]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    echo "device_check: installing ${#wheels[@]} wheels from $WHEELS" >>"$LOGS/setup.log"
    if ((${#wheels[@]})); then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "${wheels[@]}" >>"$LOGS/setup.log" 2>&1 || fail "installing the wheels from $WHEELS failed"
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
    fi
else
    echo "device_check: no $WHEELS folder, no wheels installed (scripts/device_wheels.sh makes it)" >>"$LOGS/setup.log"
fi

# Stop at once, with the reason as the JSON line, rather than spend the GPU's minutes failing.
# The versions go into setup.log and the summary: the image's packages are not pinned.
if ! "$PYTHON" - "$SIZE" "$WORK/versions.json" "$WORK/site" >>"$LOGS/setup.log" 2>&1 <<'PY'
import importlib.metadata, json, platform, sys

size, versions_file, site = sys.argv[1:4]
names = ("torch", "transformers", "accelerate", "datasets", "blake3", "safetensors", "tokenizers", "huggingface_hub",
         "numpy", "pyarrow", "pandas", "fsspec", "typing_extensions")
versions = {"python": platform.python_version()}
for name in names:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
# What came from the wheels, each checked to be the copy that imports (not one of the image's).
versions["wheels"] = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[site])}
print(json.dumps(versions))
open(versions_file, "w").write(json.dumps(versions))
for name, version in versions["wheels"].items():
    if importlib.metadata.version(name) != version:
        raise SystemExit(f"{name} {version} from the wheels is hidden by {importlib.metadata.version(name)}")
import torch, accelerate, datasets, transformers, blake3, uptrain  # noqa: F401,E401  (what the steps need)
if size == "gpu" and not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} sees no CUDA GPU")
PY
then
    fail "the check cannot start$([[ -d $WHEELS ]] || echo " (no $WHEELS: run scripts/device_wheels.sh, carry $WHEELS)")"
fi

# run_step NAME LIMIT COMMAND…: stderr then stdout into $LOGS/NAME.log; stdout, exit status,
# seconds and the limit given into $WORK/NAME.*. The limit is cut to the budget's remainder.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((CHECK_BUDGET - 10 - 5 - (SECONDS - START)))
    ((left < limit)) && limit=$((left > 0 ? left : 0))
    echo "$limit" >"$WORK/$name.limit"
    if ((limit == 0)); then
        echo "device_check: $name skipped: no time left in the ${CHECK_BUDGET} s budget" | tee "$LOGS/$name.log" >&2
        echo skipped >"$WORK/$name.rc"
        echo 0 >"$WORK/$name.seconds"
        : >"$WORK/$name.out"
        return
    fi
    echo "device_check: $name (limit ${limit} s)" >&2
    local start=$SECONDS
    # --kill-after: a step that ignores SIGTERM (a stuck CUDA call) is killed 5 s later.
    timeout --kill-after=5 "$limit" "$@" >"$WORK/$name.out" 2>"$LOGS/$name.log"
    echo $? >"$WORK/$name.rc"
    echo $((SECONDS - start)) >"$WORK/$name.seconds"
    { echo "--- stdout ---"; cat "$WORK/$name.out"; } >>"$LOGS/$name.log"
    tail -n 3 "$LOGS/$name.log" >&2
}

# shellcheck disable=SC2086  # the *_ARGS are word lists on purpose
run_step train "$TRAIN_TIMEOUT" "$PYTHON" scripts/bench_train.py $TRAIN_ARGS
# shellcheck disable=SC2086
run_step decode "$DECODE_TIMEOUT" "$PYTHON" scripts/bench_decode.py $DECODE_ARGS

# The served fast path beside eager decoding, in one process on the same models: bench_decode's
# parser and models, measured by uptrain.speed with compile=True (eager first, then compiled).
# shellcheck disable=SC2086
run_step decode_compile "$DECODE_COMPILE_TIMEOUT" "$PYTHON" - "$WORK/decode_compile" $DECODE_COMPILE_ARGS <<'PY'
import json, sys
from pathlib import Path

sys.path.insert(0, "scripts")
import bench_decode  # noqa: E402

import torch  # noqa: E402

from uptrain.speed import measure_models  # noqa: E402
from uptrain.speed_checks import model_shape, parse_device  # noqa: E402

work, args = Path(sys.argv[1]), bench_decode.build_parser().parse_args(sys.argv[2:])
torch.set_num_threads(args.threads)
device = parse_device(args.device)
dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
contexts, batches = bench_decode.parse_ints(args.contexts), bench_decode.parse_ints(args.batches)
models = bench_decode.build_models(args, work, max(contexts) + args.new_tokens, dtype, device)
timing = ("prefill_s", "decode_s_per_token", "time_per_sample_s", "decode_tokens_per_s", "kv_cache_bytes")
settings = {}
for batch in batches:
    for context in contexts:
        for name in models:
            model_shape(work / name, name).check(context, args.new_tokens, batch, dtype, device)
        measured = measure_models(models, context=context, new_tokens=args.new_tokens, batch=batch,
                                  repeats=args.repeats, device=device, compile=True)
        row = {name: {"eager": {k: m[k] for k in timing},
                      "compiled": {k: m["compiled"][k] for k in (*timing, "compile_s")}} for name, m in measured.items()}
        tps = {(name, path): row[name][path]["decode_tokens_per_s"] for name in row for path in ("eager", "compiled")}
        row["gqa_speedup"] = {path: round(tps["gqa", path] / tps["mha", path], 3) for path in ("eager", "compiled")}
        row["compiled_speedup"] = {name: round(tps[name, "compiled"] / tps[name, "eager"], 3) for name in models}
        settings[f"ctx{context}_batch{batch}"] = row
        print(f"ctx {context} batch {batch}: decode tokens/s MHA {tps['mha', 'eager']:.1f} eager, "
              f"{tps['mha', 'compiled']:.1f} compiled; GQA {tps['gqa', 'eager']:.1f} eager, "
              f"{tps['gqa', 'compiled']:.1f} compiled; GQA/MHA {row['gqa_speedup']['eager']:.2f}x eager, "
              f"{row['gqa_speedup']['compiled']:.2f}x compiled; compile "
              + ", ".join(f"{name} {row[name]['compiled']['compile_s']:.1f} s" for name in models))
print(json.dumps({"device": str(device), "dtype": dtype, "num_heads": args.heads, "num_kv_heads": args.num_kv_heads,
                  "layers": args.layers, "new_tokens": args.new_tokens, "repeats": args.repeats,
                  "settings": settings}))
PY

# shellcheck disable=SC2086
run_step calibrate "$CALIBRATE_TIMEOUT" "$PYTHON" scripts/bench_calibrate.py $CALIBRATE_ARGS --workdir "$WORK"

# The uptrain step: a synthetic MHA checkpoint with the shipped tokenizer, then the real CLI with
# --source (conversion, then training), as a user would run it; its summary is read back from
# metrics.jsonl and final/.
# shellcheck disable=SC2086
run_step uptrain "$UPTRAIN_TIMEOUT" "$PYTHON" - "$WORK/uptrain" "$UPTRAIN_MODEL" $UPTRAIN_ARGS <<'PY'
import json, os, subprocess, sys, time
from pathlib import Path

import torch
from safetensors import safe_open

from scripts.synthetic_checkpoint import write_synthetic_llama
from uptrain.data.corpus import load_tokenizer, split_path
from uptrain.train.metrics import read_metrics

work, (hidden, layers, heads, intermediate), flags = Path(sys.argv[1]), map(int, sys.argv[2].split()), sys.argv[3:]
start = time.perf_counter()
tokenizer = load_tokenizer()
source = write_synthetic_llama(work / "mha", hidden=hidden, heads=heads, layers=layers, intermediate=intermediate,
                               vocab=len(tokenizer), dtype=torch.bfloat16)
tokenizer.save_pretrained(source)
written = time.perf_counter() - start
out = work / "run"
train_split = os.environ.get("UPTRAIN_TRAIN_SPLIT", "train")  # tiny: the 10× smaller validation split
cmd = [sys.executable, "-m", "uptrain", "train", "--source", str(source), "--train_data", str(split_path(train_split)),
       "--eval_data", str(split_path("validation")), "--output_dir", str(out), "--report_to", "jsonl", *flags]
proc = subprocess.run(cmd, stdout=sys.stderr)  # its plan and progress bar go with the step's log
if proc.returncode:
    raise SystemExit(proc.returncode)
records = read_metrics(out / "metrics.jsonl")
steps = [r for r in records if "perf/tokens_per_second" in r]
timed = steps[1:] or steps  # the first step pays for warm-up
final = out / "final"
params = 0
for file in final.glob("*.safetensors"):
    with safe_open(file, "pt") as f:
        params += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())  # headers only
result = {
    "params": params, "checkpoint_seconds": round(written, 2),
    "seconds": round(time.perf_counter() - start, 2), "steps": len(steps),
    "tokens_per_second": sum(r["perf/tokens_per_second"] for r in timed) / len(timed),
    "mfu": (sum(r["perf/mfu"] for r in timed) / len(timed)) if all("perf/mfu" in r for r in timed) else None,
    "peak_memory_bytes": max(r["perf/peak_memory_bytes"] for r in steps),
    "eval_loss_start": records[0].get("eval/loss"), "eval_loss_end": records[-1].get("eval/loss"),
    "final_files": sorted(p.name for p in final.iterdir()),
    "final_num_kv_heads": json.loads((final / "config.json").read_text())["num_key_value_heads"],
}
print(f"uptrain train --source: {len(steps)} steps, {result['tokens_per_second']:,.0f} tokens/s, final/ in {final}")
print(f"eval/loss {result['eval_loss_start']} → {result['eval_loss_end']}")
print(json.dumps(result))
PY


# The summary: one JSON line on stdout and in $LOGS/summary.json. A step's result is its
# stdout's last line; a step whose result cannot be read counts as failed, with its log's tail.
if ! "$PYTHON" - "$WORK" "$LOGS" "$SIZE" "$((SECONDS - START))" "${STEPS[@]}" <<'PY'
import json, sys
from pathlib import Path

import torch

work, logs, size, elapsed, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:]
steps = {}
for name in names:
    rc = (work / f"{name}.rc").read_text().strip()
    step = {"ok": rc == "0", "seconds": int((work / f"{name}.seconds").read_text()),
            "limit": int((work / f"{name}.limit").read_text())}
    lines = (work / f"{name}.out").read_text(errors="replace").strip().splitlines()
    try:  # kept even from a step stopped at its limit after it printed its result (a slow exit)
        step["result"] = json.loads(lines[-1])
    except (IndexError, ValueError):
        step["ok"], rc = False, rc if rc != "0" else "no JSON result on stdout"
    if not step["ok"]:
        log = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
        stderr = log[:log.index("--- stdout ---")] if "--- stdout ---" in log else log
        reason = {"skipped": "skipped: no time left", "124": "timed out (exit 124)",
                  "137": "killed after its time limit (exit 137)"}.get(rc, f"exit {rc}" if rc.isdigit() else rc)
        step["error"] = reason + (f": {stderr[-1]}" if stderr and rc != "skipped" else "")
        step["log_tail"] = stderr[-20:]
    steps[name] = step
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
targets = {}
train = steps["train"].get("result") or {}
if train.get("mfu") is not None:
    targets["train_mfu>=0.45"] = train["mfu"] >= 0.45
if steps["uptrain"]["ok"]:
    targets["uptrain_wrote_final"] = any(f.endswith(".safetensors") for f in steps["uptrain"]["result"]["final_files"])
versions_file = work / "versions.json"
line = json.dumps({"size": size, "device": device, "torch": torch.__version__,
                   "versions": json.loads(versions_file.read_text()) if versions_file.exists() else None,
                   "logs": str(logs), "seconds": elapsed, "steps": steps, "targets_met": targets})
(logs / "summary.json").write_text(line + "\n")
print(line)
PY
then
    echo "{\"size\": \"$SIZE\", \"error\": \"the summary failed (its traceback is above, on stderr)\", \"logs\": \"$LOGS\"}"
    exit 1
fi
