"""Checkpoints: `accelerator.save_state` into a temporary sibling, renamed when every process is done.

A checkpoint folder without `trainer_state.json` never exists under its final name, so the
latest folder named `step_*` is always complete, even after a kill in the middle of a save. A
checkpoint is deleted by renaming it to a hidden name first, so a kill during the deletion
never leaves a half-deleted folder under a `step_*` name either; hidden leftovers are cleared
by the next save.

Each process also writes its position in the streamed training data (`data_state_<rank>.json`,
`StreamedTrainBlocks.state_dict`) into the temporary folder before the rename, so a complete
checkpoint always holds the positions that go with its weights.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from uptrain import UptrainError, exception_line
from uptrain.strict_json import read_json

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
DATA_STATE_FILE = "data_state_{rank}.json"
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


def save_checkpoint(
    accelerator, output_dir: Path, step: int, state: dict, keep: int, data_state: dict | None = None
) -> Path:
    """Save model, optimizer, RNG states and `state` (JSON) for `step` on every process; keep the
    last `keep` checkpoints. Every process must call this; each passes its own `data_state`
    (its position in the training data; None or {} when the order is a function of the step)."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / checkpoint_name(step)
    # The same temporary name on every process: each writes its own RNG state into it.
    tmp = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(output_dir)
        if final.exists():  # a resumed run passing the step again: replace it
            _discard(final)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if data_state:
        (tmp / DATA_STATE_FILE.format(rank=accelerator.process_index)).write_text(json.dumps(data_state) + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        tmp.rename(final)
        for _, old in list_checkpoints(output_dir)[:-keep]:
            _discard(old)
    accelerator.wait_for_everyone()
    return final


def remove_partial_checkpoints(output_dir: Path) -> None:
    """Delete what a run killed while saving or deleting a checkpoint left (hidden folders).
    Main process only, while no checkpoint is being saved."""
    for stale in (Path(output_dir) / CHECKPOINTS).glob(".step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def _discard(folder: Path) -> None:
    hidden = folder.with_name(f".{folder.name}.deleting")
    folder.rename(hidden)
    shutil.rmtree(hidden)


def read_trainer_state(folder: Path) -> dict:
    """The trainer state of a complete checkpoint; one UptrainError if it is damaged."""
    folder = Path(folder)
    try:
        state = read_json(folder / STATE_FILE)
        step = state.get("step") if isinstance(state, dict) else None
        named = _NAME.fullmatch(folder.name)
        if not isinstance(step, int) or isinstance(step, bool) or (named and step != int(named.group(1))):
            raise UptrainError(f"{folder / STATE_FILE} does not hold the step of {folder.name}")
    except UptrainError as err:
        raise UptrainError(f"cannot resume: {err}; delete {folder} to resume from the checkpoint before it") from None
    return state


def load_checkpoint(accelerator, folder: Path) -> dict:
    """Restore model, optimizer and RNG states from `folder`; return its trainer state."""
    state = read_trainer_state(folder)
    try:
        accelerator.load_state(str(folder))
    except Exception as err:  # a damaged weight or optimizer file: torch and safetensors raise many types
        raise UptrainError(
            f"cannot resume from {folder}: {exception_line(err)}; delete that folder to "
            "resume from the checkpoint before it"
        ) from None
    return state


def load_data_state(folder: Path, rank: int) -> dict | None:
    """Process `rank`'s position in the training data saved in a checkpoint, or None if it has none."""
    path = Path(folder) / DATA_STATE_FILE.format(rank=rank)
    if not path.is_file():
        return None
    try:
        state = read_json(path)
        if not isinstance(state, dict):
            raise UptrainError(f"{path} is not a JSON object")
    except UptrainError as err:
        raise UptrainError(f"cannot resume: {err}; delete {folder} to resume from the checkpoint before it") from None
    return state
