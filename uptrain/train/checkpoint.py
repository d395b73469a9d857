"""Checkpoints: `accelerator.save_state` into a temporary sibling, renamed when every process is done.

A checkpoint folder without `trainer_state.json` never exists under its final name, so the
latest folder named `step_*` is always complete, even after a kill in the middle of a save.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"step_(\d+)")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, as (step, folder)."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _NAME.fullmatch(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Save model, optimizer, RNG states and `state` (JSON) for `step` on every process; keep the
    last `keep` checkpoints. Every process must call this."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / checkpoint_name(step)
    # The same temporary name on every process: each writes its own RNG state into it.
    tmp = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a resumed run passing the step again: replace it
            shutil.rmtree(final)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        tmp.rename(final)
        for _, old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, folder: Path) -> dict:
    """Restore model, optimizer and RNG states from `folder`; return its trainer state."""
    accelerator.load_state(str(folder))
    return json.loads((Path(folder) / STATE_FILE).read_text())
