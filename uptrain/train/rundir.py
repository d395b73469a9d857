"""The run folder: refuse to mix runs, decide between a fresh start and a resume.

output_dir/
  run_config.yaml   the config this run was started with (marks the folder as a run; `resume_rule`)
  run.json          facts fixed at the start: processes, global batch, wandb run id
  metrics.jsonl     one record per logged step
  converted/        the `source` checkpoint after conversion (with `source`)
  checkpoints/      step_XXXXXXXX/ from accelerator.save_state, the last K kept
  wandb/            the wandb run (offline without credentials)
  final/            the uptrained model: save_pretrained + tokenizer
  .uptrain-lock     while a run uses the folder (see `hold_run_dir`)

One writer for the folder's shared files: the main process of the whole run (global rank 0), on
one machine or several; each process writes only what is its own (its RNG and data state in a
checkpoint). A run on several machines therefore needs output_dir on a filesystem every machine
mounts (`check_shared_run_dir`): a checkpoint is whole only where every process's state is.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.atomic import OutputLock, remove_stale_locks
from uptrain.checkpoint.resumable import Change, ResumeRule, settings_changed, unreadable_record
from uptrain.options import read_yaml
from uptrain.strict_json import read_json
from uptrain.train.checkpoint import latest_checkpoint, read_trainer_state, remove_partial_checkpoints
from uptrain.train.config import OPERATIONAL_KEYS, TrainConfig, config_to_yaml

RUN_CONFIG = "run_config.yaml"
RUN_INFO = "run.json"
LOCK_FILE = ".uptrain-lock"


@dataclass(frozen=True)
class RunStart:
    """What `inspect_run_dir` decided."""

    fresh: bool  # no earlier run to continue (the folder is new, emptied, or never checkpointed)
    checkpoint: Path | None  # continue from here
    checkpoint_step: int
    info: dict  # run.json of the earlier run ({} when fresh)
    complete: bool  # an earlier run already wrote final/


# batch_size and grad_accum are operational only while the global batch, their product with the
# number of processes, stays: run.json records it and `inspect_run_dir` checks it apart. A
# compare, whose finished runs are kept as they are, treats them as identifying.
GLOBAL_BATCH_KEYS = frozenset({"batch_size", "grad_accum"})
GLOBAL_BATCH = "batch_size × grad_accum × processes"


def resume_rule() -> ResumeRule:
    """What identifies a run: every key but the bookkeeping ones (`OPERATIONAL_KEYS`) and
    output_dir, which names the folder being resumed however it is spelled (run, run/, /abs/run)."""
    return ResumeRule.for_schema(TrainConfig, OPERATIONAL_KEYS | {"output_dir"})


@contextmanager
def hold_run_dir(output_dir: str | Path) -> Iterator[None]:
    """Keep every other run out of `output_dir` while this one uses it; refuse at once (one
    line) when another live run holds it.

    The main process holds an `fcntl.flock` on `output_dir/.uptrain-lock`: the kernel releases
    it when the process dies, however it dies, so a killed run never blocks `--resume`. The
    other processes of a distributed run rely on the main one. Folders created only to hold
    the lock are removed again if the run stops before writing anything into them.
    """
    if _process_rank() != 0:
        yield
        return
    out = Path(output_dir).absolute()
    if out.exists() and not out.is_dir():
        raise UptrainError(f"output_dir {out} is a file")
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UptrainError(f"cannot create output_dir {out}: {err.strerror or err}") from None
    lock = OutputLock(out / LOCK_FILE, out, "output_dir")
    try:
        with lock:
            yield
    finally:
        for folder in created:  # deepest first; stops at the first that holds something
            try:
                folder.rmdir()
            except OSError:
                break


def _process_rank() -> int:
    """This process's rank in a launch, read as accelerate reads it (torchrun, accelerate launch
    and MPI launchers set these), without setting up accelerate's state before the run does."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _contents(out: Path) -> list[Path]:
    """What a folder holds, but for a run's lock and the temporaries of its first writes (a
    run killed before run_config.yaml was in place has not started: its folder counts as empty)."""
    ours = {LOCK_FILE, RUN_CONFIG + ".tmp", RUN_INFO + ".tmp"}
    return [p for p in out.iterdir() if p.name not in ours]


def _read_run_config(marker: Path) -> dict:
    try:
        old = read_yaml(marker)
    except UptrainError as err:  # its one line names the file and what is wrong with it
        raise unreadable_record(f"{marker.name} is damaged ({err})", "output_dir") from None
    if not isinstance(old, dict):
        raise unreadable_record(f"{marker} is damaged (not a mapping of config keys)", "output_dir")
    return old


def inspect_run_dir(config: TrainConfig, global_batch: int) -> RunStart:
    """Decide how to start, reading only (every process calls this). Raises UptrainError when the
    folder holds something this run must not touch, or something damaged it cannot continue."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise UptrainError(f"output_dir {out} is a file")
    if not out.exists() or not _contents(out) or config.overwrite:
        return RunStart(True, None, 0, {}, False)
    marker = out / RUN_CONFIG
    if not config.resume:
        what = "another uptrain run" if marker.is_file() else "files of something else"
        raise UptrainError(
            f"output_dir {out} already holds {what}; pass --resume to continue it or --overwrite "
            "to delete it and start over"
        )
    if not marker.is_file():
        raise UptrainError(f"cannot resume: {out} is not an uptrain run ({RUN_CONFIG} is missing)")
    what = f"the run in {out}"
    resume_rule().check(_read_run_config(marker), config.to_dict(), what=what, place="output_dir")
    info = read_json(out / RUN_INFO) if (out / RUN_INFO).is_file() else {}
    if not isinstance(info, dict):
        raise unreadable_record(f"{out / RUN_INFO} is damaged (not a JSON object)", "output_dir")
    if info.get("global_batch", global_batch) != global_batch:
        raise settings_changed(what, [Change(GLOBAL_BATCH, info["global_batch"], global_batch)], "output_dir")
    complete = (out / "final" / "config.json").is_file()
    latest = latest_checkpoint(out)
    if latest is None:
        return RunStart(True, None, 0, info, complete)
    if not complete:
        read_trainer_state(latest[1])  # a damaged state is refused now, before anything is written
    return RunStart(False, latest[1], latest[0], info, complete)


def initialise_run_dir(config: TrainConfig, start: RunStart, info: dict) -> None:
    """Main process only: empty the folder for --overwrite, clear what a killed run left half
    done, write run_config.yaml and run.json."""
    out = Path(config.output_dir)
    if config.overwrite and out.exists():
        for entry in _contents(out):  # the lock stays: this run holds it
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(out)
    remove_stale_locks(out)  # of final/ or converted/, whose writer was killed
    if start.fresh:
        # Written once per run: a resumed run keeps the record of how it was started.
        _write(out / RUN_CONFIG, config_to_yaml(config))
        _write(out / RUN_INFO, json.dumps(info, indent=2) + "\n")


def check_shared_run_dir(accelerator, config: TrainConfig, start: RunStart) -> None:
    """Every process, once the main process has started the run folder: refuse, in one line on
    every process, a run whose processes do not all see that folder (its run.json) and did not all
    decide the same start. On several machines output_dir must be one folder that each mounts: on a
    disk of its own, each machine but the main one would keep its processes' parts of every
    checkpoint where no resume finds them, and a resume would load the checkpoint on one machine
    and start afresh on another (replicas with different weights, averaging their gradients)."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    try:
        seen = (Path(config.output_dir) / RUN_INFO).read_text()
    except OSError:
        seen = None
    views = gather_object([(seen, start.checkpoint_step, start.complete)])
    if any(view != views[0] for view in views):
        apart = sorted({rank for rank, view in enumerate(views) if view != views[0]})
        raise UptrainError(
            f"output_dir {Path(config.output_dir).absolute()} is not the same folder for every process (process "
            f"{apart[0]} does not see what the main process wrote there): a run on several machines needs output_dir "
            "on a filesystem every machine mounts (NFS, Lustre, …), at the same path"
        )


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
