#!/usr/bin/env bash
# bash scripts/device_check.sh                         # one GPU, within 8 minutes
# DEVICE_CHECK_SIZE=tiny bash scripts/device_check.sh  # the same steps at test size, on a CPU
#
# The checks to run the day a GPU is lent, in one go, each step under its own time limit:
#   train     scripts/bench_train.py, a ~1B-parameter Llama (hidden 2048 × 22 layers, 16 heads,
#             4 KV heads, MLP 5632) in bf16 autocast, seq 2048 × batch 8: tokens/s and MFU
#             (target ≥ 0.45 on an H100/H200-class GPU)
#   decode    scripts/bench_decode.py in bf16, the same ~1B shape at 16 → 4 KV heads, contexts
#             1k, 4k and 16k × batch 1 and 8: decode speed-up against its bounds (h/G and the
#             bytes read per step)
#   calibrate scripts/bench_calibrate.py --shape 7b on the GPU: layer-by-layer calibration time
#             per token and peak GPU memory on a 7B-shaped synthetic checkpoint (13.5 GB bf16)
#   uptrain   `uptrain train --source` on a synthetic ~1B MHA Llama: convert to 4 KV heads, train
#             20 steps in bf16 on the shipped corpus, write final/
# Each step's output goes to $WORK/<step>.out/.err; a step that fails or runs out of time is
# reported as such and the others still run. The last line of stdout is one JSON object:
# {"size", "device", "steps": {<step>: {"ok", "seconds", "result" | "error"}}, "targets_met"}.
#
# Sizes: DEVICE_CHECK_SIZE=gpu (default) or tiny. Any step's arguments can be replaced with
# TRAIN_ARGS, DECODE_ARGS, CALIBRATE_ARGS (script flags), UPTRAIN_MODEL (hidden layers heads
# intermediate, space-separated), UPTRAIN_ARGS (`uptrain train` flags) and UPTRAIN_TRAIN_SPLIT
# (the shipped corpus split it trains on: train, or validation at tiny size); time limits with
# TRAIN_TIMEOUT, DECODE_TIMEOUT, CALIBRATE_TIMEOUT, UPTRAIN_TIMEOUT (seconds); the interpreter
# with PYTHON (default: .venv/bin/python when there is one, else python3); the work folder
# with WORK (default: a temporary folder, removed at the end).
set -uo pipefail
cd "$(dirname "$0")/.."

SIZE=${DEVICE_CHECK_SIZE:-gpu}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 WANDB_MODE=${WANDB_MODE:-disabled}
export TOKENIZERS_PARALLELISM=false
# The scripts import uptrain from this checkout whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "$SIZE" in
  gpu)
    : "${TRAIN_ARGS:=--device cuda --hidden 2048 --layers 22 --heads 16 --kv-heads 4 --seq-len 2048 --batch-size 8 --steps 12 --warmup 4 --repeats 1}"
    : "${DECODE_ARGS:=--device cuda --dtype bfloat16 --contexts 1024,4096,16384 --batches 1,8 --hidden 2048 --heads 16 --num-kv-heads 4 --layers 22 --vocab 32000 --new-tokens 32 --repeats 3}"
    : "${CALIBRATE_ARGS:=--device cuda --shape 7b --dtype bfloat16 --tokens 32768 --seq-len 2048 --batch-size 4 --no-whole --no-double}"
    : "${UPTRAIN_MODEL:=2048 22 16 5632}"
    : "${UPTRAIN_ARGS:=--num_kv_heads 4 --seq_len 2048 --batch_size 8 --max_steps 20 --warmup_steps 2 --lr 3e-4 --eval_every 20 --save_every 1000 --eval_blocks 16 --mixed_precision bf16}"
    # 435 s of steps (+ at most 4 × 5 s of --kill-after and ~15 s of checks and summary): the
    # summary is out within 8 minutes even if every step runs to its limit. The split between
    # steps is an estimate until a GPU run measures it (BENCHMARKS.md).
    : "${TRAIN_TIMEOUT:=130}" "${DECODE_TIMEOUT:=100}" "${CALIBRATE_TIMEOUT:=130}" "${UPTRAIN_TIMEOUT:=75}"
    ;;
  tiny)
    : "${TRAIN_ARGS:=--hidden 64 --layers 2 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 2 --steps 3 --warmup 1 --repeats 1}"
    : "${DECODE_ARGS:=--contexts 8,16 --batches 1 --new-tokens 2 --repeats 1 --hidden 64 --heads 8 --num-kv-heads 2 --layers 2 --vocab 128}"
    : "${CALIBRATE_ARGS:=--size-gb 0.005 --tokens 128 --seq-len 64 --threads 1 --no-whole --no-double}"
    : "${UPTRAIN_MODEL:=64 2 8 128}"
    export UPTRAIN_TRAIN_SPLIT=${UPTRAIN_TRAIN_SPLIT:-validation}
    : "${UPTRAIN_ARGS:=--num_kv_heads 2 --seq_len 32 --batch_size 2 --max_steps 2 --warmup_steps 1 --lr 3e-3 --eval_every 2 --save_every 1000 --eval_blocks 2}"
    : "${TRAIN_TIMEOUT:=120}" "${DECODE_TIMEOUT:=120}" "${CALIBRATE_TIMEOUT:=120}" "${UPTRAIN_TIMEOUT:=120}"
    ;;
  *)
    echo "device_check.sh: DEVICE_CHECK_SIZE must be gpu or tiny, not '$SIZE'" >&2
    exit 2
    ;;
esac

# DEVICE_CHECK_PRINT_ARGS=1: print the resolved arguments as JSON and stop (tests parse the GPU
# preset with each script's own parser, so a typo does not cost a GPU session).
if [[ "${DEVICE_CHECK_PRINT_ARGS:-}" == 1 ]]; then
    exec "$PYTHON" -c 'import json, sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
        train "$TRAIN_ARGS" decode "$DECODE_ARGS" calibrate "$CALIBRATE_ARGS" uptrain_model "$UPTRAIN_MODEL" \
        uptrain "$UPTRAIN_ARGS" timeouts "$TRAIN_TIMEOUT $DECODE_TIMEOUT $CALIBRATE_TIMEOUT $UPTRAIN_TIMEOUT"
fi

# Stop at once, with the reason as the JSON line, rather than spend the GPU's minutes failing.
if ! problem=$("$PYTHON" - "$SIZE" 2>&1 <<'PY'
import sys
import torch, accelerate, datasets, transformers, uptrain  # noqa: F401  (what every step needs)
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} sees no CUDA GPU")
PY
); then
    "$PYTHON" -c 'import json, sys; print(json.dumps({"size": sys.argv[1], "error": sys.argv[2].strip().splitlines()[-1]}))' \
        "$SIZE" "${problem:-cannot run $PYTHON}" 2>/dev/null || echo "{\"size\": \"$SIZE\", \"error\": \"cannot run $PYTHON\"}"
    exit 1
fi

KEEP_WORK=${WORK:+1}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/device-check-XXXXXX")}
mkdir -p "$WORK"
[[ -z "$KEEP_WORK" ]] && trap 'rm -rf "$WORK"' EXIT

# run_step NAME LIMIT COMMAND…: stdout, stderr, exit status and seconds into $WORK/NAME.*
run_step() {
    local name=$1 limit=$2
    shift 2
    echo "device_check: $name (limit ${limit} s)" >&2
    local start=$SECONDS
    # --kill-after: a step that ignores SIGTERM (a stuck CUDA call) is killed 5 s later.
    timeout --kill-after=5 "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
    echo $? >"$WORK/$name.rc"
    echo $((SECONDS - start)) >"$WORK/$name.seconds"
    tail -n 3 "$WORK/$name.err" >&2
}

# shellcheck disable=SC2086  # the *_ARGS are word lists on purpose
run_step train "$TRAIN_TIMEOUT" "$PYTHON" scripts/bench_train.py $TRAIN_ARGS
# shellcheck disable=SC2086
run_step decode "$DECODE_TIMEOUT" "$PYTHON" scripts/bench_decode.py $DECODE_ARGS
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

from uptrain.convert.synthetic import write_synthetic_llama
from uptrain.corpus import load_tokenizer, split_path
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

"$PYTHON" - "$WORK" "$SIZE" <<'PY'
import json, sys
from pathlib import Path

import torch

work, size = Path(sys.argv[1]), sys.argv[2]
steps = {}
for name in ("train", "decode", "calibrate", "uptrain"):
    rc = int((work / f"{name}.rc").read_text())
    step = {"ok": rc == 0, "seconds": int((work / f"{name}.seconds").read_text())}
    lines = (work / f"{name}.out").read_text().strip().splitlines()
    if rc == 0:
        step["result"] = json.loads(lines[-1])
    else:
        err = (work / f"{name}.err").read_text().strip().splitlines()
        step["error"] = (f"timed out (exit {rc})" if rc in (124, 137) else f"exit {rc}") + (
            f": {err[-1]}" if err else "")
    steps[name] = step
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
targets = {}
train = steps["train"].get("result") or {}
if train.get("mfu") is not None:
    targets["train_mfu>=0.45"] = train["mfu"] >= 0.45
if "uptrain" in steps and steps["uptrain"]["ok"]:
    targets["uptrain_wrote_final"] = any(f.endswith(".safetensors") for f in steps["uptrain"]["result"]["final_files"])
print(json.dumps({"size": size, "device": device, "torch": torch.__version__,
                  "seconds": sum(s["seconds"] for s in steps.values()), "steps": steps, "targets_met": targets}))
PY
