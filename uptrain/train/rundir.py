"""The run folder: refuse to mix runs, decide between a fresh start and a resume.

    output_dir/
      run_config.yaml   the config this run was started with (marks the folder as a run)
      run.json          facts fixed at the start: processes, global batch, wandb run id
      metrics.jsonl     one record per logged step
      converted/        the `source` checkpoint after conversion (with `source`)
      checkpoints/      step_XXXXXXXX/ from accelerator.save_state, the last K kept
      wandb/            the wandb run (offline without credentials)
      final/            the uptrained model: save_pretrained + tokenizer
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from uptrain import UptrainError
from uptrain.train.checkpoint import latest_checkpoint
from uptrain.train.config import OPERATIONAL_KEYS, TrainConfig, config_to_yaml

RUN_CONFIG = "run_config.yaml"
RUN_INFO = "run.json"


@dataclass(frozen=True)
class RunStart:
    """What `prepare_run_dir` decided."""
    fresh: bool  # no earlier run to continue (the folder is new, emptied, or never checkpointed)
    checkpoint: Path | None  # continue from here
    checkpoint_step: int
    info: dict  # run.json of the earlier run ({} when fresh)
    complete: bool  # an earlier run already wrote final/


def _differences(old: dict, new: TrainConfig) -> list[str]:
    current = new.model_dump(mode="json")
    # A key the earlier run's uptrain did not have yet held its default there.
    defaults = {k: f.default for k, f in TrainConfig.model_fields.items() if not f.is_required()}
    old = {**{k: v for k, v in defaults.items() if k not in old}, **old}
    keys = [k for k in current if k not in OPERATIONAL_KEYS]
    return [f"{k}: {old.get(k)!r} → {current[k]!r}" for k in keys if old.get(k) != current[k]]


def inspect_run_dir(config: TrainConfig, global_batch: int) -> RunStart:
    """Decide how to start, reading only (every process calls this). Raises UptrainError when the
    folder holds something this run must not touch."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise UptrainError(f"output_dir {out} is a file")
    if not out.exists() or not any(out.iterdir()) or config.overwrite:
        return RunStart(True, None, 0, {}, False)
    marker = out / RUN_CONFIG
    if not config.resume:
        what = "another uptrain run" if marker.is_file() else "files of something else"
        raise UptrainError(f"output_dir {out} already holds {what}; pass --resume to continue it or --overwrite "
                           "to delete it and start over")
    if not marker.is_file():
        raise UptrainError(f"cannot resume: {out} is not an uptrain run ({RUN_CONFIG} is missing)")
    old = yaml.safe_load(marker.read_text()) or {}
    changed = _differences(old, config)
    if changed:
        raise UptrainError(f"cannot resume {out}: the config changed ({'; '.join(changed)}); "
                           "use another output_dir or --overwrite")
    info = json.loads((out / RUN_INFO).read_text()) if (out / RUN_INFO).is_file() else {}
    if info.get("global_batch", global_batch) != global_batch:
        raise UptrainError(f"cannot resume {out}: its global batch was {info['global_batch']} blocks, now "
                           f"{global_batch} (batch_size × grad_accum × processes must stay the same)")
    complete = (out / "final" / "config.json").is_file()
    latest = latest_checkpoint(out)
    if latest is None:
        return RunStart(True, None, 0, info, complete)
    return RunStart(False, latest[1], latest[0], info, complete)


def initialise_run_dir(config: TrainConfig, start: RunStart, info: dict) -> None:
    """Main process only: empty the folder for --overwrite, write run_config.yaml and run.json."""
    out = Path(config.output_dir)
    if config.overwrite and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if start.fresh:
        # Written once per run: a resumed run keeps the record of how it was started.
        _write(out / RUN_CONFIG, config_to_yaml(config))
        _write(out / RUN_INFO, json.dumps(info, indent=2) + "\n")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
