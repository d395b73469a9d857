"""`uptrain compare`: convert one MHA model every way asked, uptrain each run identically, collect.

For every (G, pooling) the model is converted, evaluated at α = 0 (the training loop's step-0
evaluation) and uptrained with the same data, seed, schedule and token budget. The MHA model
itself is trained with the same budget as the reference row, so that what uptraining alone buys
an undertrained model is not credited to GQA. Each finished run leaves `result.json`; a killed
compare picks those up and resumes the unfinished run from its last checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.budgets import pretrain_tokens
from uptrain.convert.pipeline import Calibration, calibrate, execute, prepare
from uptrain.convert.layouts import config_geometry
from uptrain.compare.spec import CompareSpec
from uptrain.compare.speed_rows import speed_setting, with_speed
from uptrain.model_info import DTYPE_BYTES, config_dtype, read_config
from uptrain.train.metrics import read_metrics

RESULT = "result.json"
MHA = "mha"


@dataclass
class RunResult:
    name: str
    num_kv_heads: int
    pooling: str
    eval_loss_before: float
    eval_loss_after: float
    uptrain_tokens: int
    kv_cache_bytes_per_token: int
    curve: list[tuple[int, float]]  # (tokens seen, eval loss)
    # `measure_speed`'s result at this G, measured once per G after the runs (speed-g{G}.json);
    # None in result.json, which is written before it, and with speed_repeats 0.
    speed: dict | None = None

    @property
    def perplexity_before(self) -> float:
        return float(torch.tensor(self.eval_loss_before).exp())

    @property
    def perplexity_after(self) -> float:
        return float(torch.tensor(self.eval_loss_after).exp())


def validate(spec: CompareSpec) -> None:
    """Every check of every run — each conversion's full `prepare` included — before any work."""
    if "wandb" in spec.report_to:
        from uptrain.train.tracking import ensure_wandb_never_prompts

        ensure_wandb_never_prompts()  # WANDB_MODE=online without a key: refused before compare.json
    if spec.uptrain_fraction is not None and spec.pretrain_tokens is None:  # the rule itself: CompareSpec
        spec.pretrain_tokens = pretrain_tokens(spec.model)
    _train_config(spec, Path(spec.model), Path(spec.output_dir) / "runs" / MHA / "train", MHA)  # its keys, now
    speed_setting(spec)  # the speed measurement's refusals too
    for _, g, pooling in run_names(spec):
        if g is not None:
            prepare(spec.conversion_spec(g, pooling)).close()


def run_names(spec: CompareSpec) -> list[tuple[str, int | None, str]]:
    """(run folder name, G or None for the MHA reference, pooling) in the order they run."""
    runs = [(MHA, None, MHA)]
    for g in spec.num_kv_heads:
        runs += [(f"g{g}-{p}", g, p) for p in spec.pooling]
    return runs


def _train_config(spec: CompareSpec, model: Path, out: Path, name: str):
    from uptrain.train.config import validated_config

    values = dict(model=str(model), train_data=spec.train_data, eval_data=spec.eval_data, output_dir=str(out),
                  seq_len=spec.seq_len, batch_size=spec.batch_size, lr=spec.lr, warmup_steps=spec.warmup_steps,
                  eval_every=spec.eval_every, save_every=spec.eval_every, eval_blocks=spec.eval_blocks, seed=spec.seed,
                  report_to=spec.report_to, run_name=f"{Path(spec.output_dir).name}/{name}",
                  wandb_group=Path(spec.output_dir).name, resume=out.exists(), **spec.budget())
    return validated_config(values, "compare")


def _calibration(prepared, root: Path) -> Calibration:
    """Attention-input moments of the source model on the train data, computed once per compare:
    every conversion of one compare reads the same model, text, tokens and block length."""
    from safetensors.torch import load_file, save_file

    path = root / "calibration.safetensors"
    if path.exists():
        stored = load_file(path)
        info = json.loads((root / "calibration.json").read_text())
        return Calibration({int(k): v for k, v in stored.items()}, info)
    calibration = calibrate(prepared, progress=False)
    save_file({str(k): calibration.moments[k].contiguous() for k in calibration.moments}, path)
    (root / "calibration.json").write_text(json.dumps(calibration.info))
    return calibration


def _result(name: str, g: int, pooling: str, run_dir: Path, kv_bytes: int) -> RunResult:
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = [(r["train/tokens_seen"], r["eval/loss"]) for r in records if "eval/loss" in r]
    if not curve or curve[0][0] != 0:
        raise UptrainError(f"{run_dir}/metrics.jsonl lacks the step-0 evaluation")
    return RunResult(name, g, pooling, curve[0][1], curve[-1][1], curve[-1][0], kv_bytes, curve)


def run_compare(spec: CompareSpec, log=print) -> list[RunResult]:
    """Run (or pick up) every run of the comparison; returns the MHA row first."""
    from uptrain.train.loop import run_training

    validate(spec)
    # One summary per run from wandb would bury the comparison; wandb still records everything.
    os.environ.setdefault("WANDB_SILENT", "true")
    root = Path(spec.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    config = read_config(spec.model)
    geometry = config_geometry(config)
    dtype_bytes = DTYPE_BYTES.get(config_dtype(config), 4)
    results = []
    for name, g, pooling in run_names(spec):
        run_dir = root / "runs" / name
        g_eff = geometry.num_kv_heads if g is None else g
        kv_bytes = geometry.kv_cache_bytes_per_token(dtype_bytes, g_eff)
        if (run_dir / RESULT).exists():
            log(f"[compare] {name}: finished earlier, reusing {run_dir / RESULT}")
            results.append(RunResult(**json.loads((run_dir / RESULT).read_text())))
            continue
        log(f"[compare] {name}: " + ("MHA reference" if g is None else f"G = {g}, {pooling} pooling"))
        model = Path(spec.model)
        if g is not None:
            model = root / "converted" / name
            if not model.exists():
                model.parent.mkdir(parents=True, exist_ok=True)
                with prepare(spec.conversion_spec(g, pooling), model) as prepared:
                    calibration = _calibration(prepared, root) if prepared.needs_calibration else None
                    execute(prepared, model, calibration=calibration, progress=False)
        run_training(_train_config(spec, model, run_dir / "train", name))
        result = _result(name, g_eff, pooling, run_dir / "train", kv_bytes)
        (run_dir / RESULT).write_text(json.dumps(asdict(result), indent=2) + "\n")
        results.append(result)
    return with_speed(spec, results, log)
