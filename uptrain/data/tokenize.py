"""The engine of `uptrain tokenize DATA OUT --tokenizer MODEL --seq-len N` (its options:
`uptrain.data.spec`): tokenize and pack text once, into the memory-mapped shards of
`uptrain.data.shards`, so that training reads token ids only.

The blocks are the ones `uptrain train` would build from the same files (`text.load_blocks`):
documents read by the same `datasets` builders in the same order, tokenized and packed by the
same `pack_function`, `MAP_BATCH` documents at a time (each batch's last partial block dropped,
as `Dataset.map` does there).

Resumable: shards are built in a hidden sibling `.OUT.uptrain-partial/`, each written to a
temporary and renamed, and `progress.json` there records, after each shard, where in the text
the next one starts. A run killed at any point continues from its last recorded shard (shards
are a pure function of the settings, so the result is byte for byte the uninterrupted one);
OUT itself appears only complete, by one rename, with `tokens.json` in it.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from uptrain import UptrainError, __version__
from uptrain.data.spec import TokenizeOptions
from uptrain.loading import load_tokenizer

PARTIAL_TAG = ".uptrain-partial"
PROGRESS = "progress.json"

# Called at each step a kill could interrupt: ("shard-written", i) with shard i complete in its
# temporary, ("shard-renamed", i) once it has its name but before progress.json records it,
# ("index-written", -1) before the folder is renamed to OUT. Tests kill the process there.
StepHook = Callable[[str, int], None]


def _data_files(files: tuple[str, ...]) -> list[dict]:
    """Each data file's name (portable: no path of this machine), size and blake3, in reading order."""
    from uptrain.checkpoint.hashing import BackgroundHasher
    from uptrain.checkpoint.source import portable

    records = []
    for f in files:
        # One hasher per file: its result is keyed by file name, and two folders may hold one name.
        with BackgroundHasher([Path(f)], "blake3") as hasher:
            (record,) = hasher.result().values()
        records.append({"file": portable(f), **record})
    return records


def _identity(record: dict) -> dict:
    """What decides the bytes of the shards: two runs with the same identity write the same folder.
    File names are not part of it (DATA may be spelled otherwise on a rerun); the files' sizes and
    digests are, summed up in one line."""
    import blake3

    files = [(f["bytes"], f["blake3"]) for f in record["data"]["files"]]
    digest = blake3.blake3(json.dumps(files).encode()).hexdigest()
    return {
        "seq_len": record["seq_len"],
        "dtype": record["dtype"],
        "blocks_per_shard": record["blocks_per_shard"],
        "tokenizer": record["tokenizer"]["digest"],
        "data": f"{len(files)} file{'s' * (len(files) != 1)}, {sum(b for b, _ in files)} bytes, blake3 {digest}",
        "text_field": record["data"]["text_field"],
        "sample_by": record["data"]["sample_by"],
        "packing": record["packing"],
    }


def _rows(source, text_field: str, sample_by: str) -> Iterator[dict]:
    """The documents of local data files in the order `load_blocks` reads them (streamed: no
    copy of the text is cached). Refuses a missing text column in one line."""
    from uptrain.data.text import load_documents

    ds = load_documents(source, "train", None, sample_by, streaming=True)
    rows = iter(ds)
    first = next(rows, None)
    if first is None:
        raise UptrainError(f"DATA {source.label} holds no documents")
    if text_field not in first:
        raise UptrainError(
            f"DATA {source.label} has no column `{text_field}` (columns: {', '.join(first)}); set --text-field"
        )
    return itertools.chain([first], rows)


def _check_positions(model: str, seq_len: int) -> None:
    """Blocks longer than the model's positions could never be trained on (`uptrain train`
    refuses them): refused before any text is read, where MODEL is a folder with a config."""
    from uptrain.architecture import block_positions
    from uptrain.model_info import read_config

    if not (Path(model).expanduser() / "config.json").is_file():
        return  # a tokenizer alone (or a Hub id): the positions are train's to check
    positions, key = block_positions(read_config(Path(model).expanduser()), f"--tokenizer {model}")
    if positions is not None and seq_len > positions:
        raise UptrainError(
            f"--seq-len {seq_len} is beyond the {positions} positions of --tokenizer {model} ({key}): "
            f"give --seq-len {positions} or less"
        )


def tokenize(options: TokenizeOptions, progress: bool = True, on_step: StepHook | None = None) -> Path:
    """Write OUT (see the module's docstring). Every check runs before anything is written."""
    from uptrain.checkpoint.atomic import (
        check_apart,
        check_output_path,
        output_lock,
        remove_temporaries,
        replace_directory,
        write_file,
    )
    from uptrain.checkpoint.resumable import ResumeRule, settings_changed
    from uptrain.data.shards import INDEX, is_token_folder
    from uptrain.data.text import MAP_BATCH, pack_function, resolve_data

    out = Path(options.out).expanduser().absolute()
    if is_token_folder(options.data):
        raise UptrainError(f"DATA {options.data} is already tokenized (it holds {INDEX}): give it to train_data")
    source = resolve_data(options.data, "DATA")
    if not source.is_local:
        raise UptrainError(
            f"DATA {options.data} is not a file, glob or folder here; `uptrain tokenize` reads local text"
        )
    given = [options.data] if isinstance(options.data, str) else options.data
    inputs = [Path(p).expanduser() for p in [*given, *source.files]]  # a DATA folder holding OUT, too
    check_apart(out, [("DATA", p) for p in inputs] + [("tokenizer", Path(options.tokenizer))], "OUT")
    tokenizer = load_tokenizer(options.tokenizer, "--tokenizer")
    _check_positions(options.tokenizer, options.seq_len)
    check_output_path(out, options.overwrite)  # OUT that exists, cannot be made, or another run writes
    rows = _rows(source, options.text_field, options.sample_by)
    record = _record(options, tokenizer, source)
    partial = out.parent / f".{out.name}{PARTIAL_TAG}"
    with output_lock(out):
        if out.exists() and not options.overwrite:  # made by something else since the check
            raise UptrainError(f"{out} already exists; pass --overwrite to replace it")
        if partial.is_symlink() or partial.exists() and not partial.is_dir():
            raise UptrainError(f"{partial} is in the way of the shards and not a folder uptrain made; remove it")
        # A finished index first: a run killed between writing it and renaming the folder is done.
        state = _read_state(partial / INDEX) or _read_state(partial / PROGRESS)
        if state is not None and (changed := ResumeRule().changes(_identity(state), _identity(record))):
            if not options.overwrite:
                raise settings_changed(f"the interrupted `uptrain tokenize` to {out}", changed, "OUT")
            state = None
        if state is None:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            state = {**record, "shards": [], "next": {"batch": 0, "block": 0}}
            write_file(partial / PROGRESS, json.dumps(state, indent=1))
        remove_temporaries(partial)
        try:
            if "next" in state:  # not complete yet
                pack = pack_function(tokenizer, options.text_field, options.seq_len, f"DATA {source.label}")
                _write_shards(partial, state, rows, pack, MAP_BATCH, progress, on_step)
                if not state["shards"]:
                    raise UptrainError(
                        f"DATA {source.label} gives no block of {options.seq_len} tokens: give more text or a "
                        "smaller --seq-len"
                    )
                index = {k: v for k, v in state.items() if k != "next"}
                index["blocks"] = sum(s["blocks"] for s in index["shards"])
                index["tokens"] = index["blocks"] * options.seq_len
                write_file(partial / INDEX, json.dumps(index, indent=1) + "\n")
                if on_step:
                    on_step("index-written", -1)
            (partial / PROGRESS).unlink(missing_ok=True)
            replace_directory(partial, out)
        except UptrainError:
            shutil.rmtree(partial, ignore_errors=True)  # bad input: nothing of it is kept
            raise
    return out


def _record(options: TokenizeOptions, tokenizer, source) -> dict:
    """What OUT's tokens.json says of how its tokens were made: the identity a resumed run must match."""
    from uptrain.checkpoint.source import portable
    from uptrain.data.shards import FORMAT, FORMAT_VERSION, token_dtype, tokenizer_digest
    from uptrain.data.text import MAP_BATCH

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "seq_len": options.seq_len,
        "dtype": token_dtype(len(tokenizer)),
        "blocks_per_shard": max(1, options.shard_tokens // options.seq_len),
        "tokenizer": {
            "name": portable(options.tokenizer),
            "digest": tokenizer_digest(tokenizer),
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
        },
        "data": {"files": _data_files(source.files), "text_field": options.text_field, "sample_by": options.sample_by},
        # How `uptrain.data.text` packs, recorded so that a change there is seen as a change here.
        "packing": {"documents_per_batch": MAP_BATCH, "separator": "eos", "batch_remainder": "dropped"},
        "uptrain_version": __version__,
    }


def _read_state(path: Path) -> dict | None:
    """An interrupted run's record (progress.json, or tokens.json once it finished), or None when
    it is missing or damaged (that run then starts over)."""
    from uptrain.data.shards import shard_name
    from uptrain.strict_json import read_json

    try:
        state = read_json(path)
        _identity(state)
        shards, resume = state["shards"], state.get("next", {"batch": 0, "block": 0})
        whole = isinstance(shards, list) and all(
            isinstance(s, dict) and s.get("name") == shard_name(i) and type(s.get("blocks")) is int
            for i, s in enumerate(shards)
        )
        if not whole or not all(type(resume.get(k)) is int and resume[k] >= 0 for k in ("batch", "block")):
            return None
    except (UptrainError, KeyError, TypeError, AttributeError):
        return None
    return state


def _write_shards(partial: Path, state: dict, rows, pack, map_batch: int, progress: bool, on_step) -> None:
    """Pack documents into shards from where `state["next"]` says, recording each shard in
    progress.json once it has its name."""
    import blake3
    import numpy as np
    from tqdm.auto import tqdm

    from uptrain.checkpoint.atomic import atomic_file, write_file
    from uptrain.data.shards import DTYPES, shard_name

    hook = on_step or (lambda event, shard: None)
    seq_len, per_shard, dtype = state["seq_len"], state["blocks_per_shard"], DTYPES[state["dtype"]]
    text_field = state["data"]["text_field"]
    written = sum(s["blocks"] for s in state["shards"]) * seq_len
    bar = tqdm(desc="tokenize", unit="tok", unit_scale=True, initial=written, disable=not progress)
    pending: list[list[int]] = []

    def flush(next_batch: int, next_block: int) -> None:
        i = len(state["shards"])
        data = np.asarray(pending, dtype=dtype).tobytes()
        with atomic_file(partial / shard_name(i)) as tmp:
            tmp.write_bytes(data)
            hook("shard-written", i)
        hook("shard-renamed", i)
        state["shards"].append(
            {
                "name": shard_name(i),
                "blocks": len(pending),
                "bytes": len(data),
                "blake3": blake3.blake3(data).hexdigest(),
            }
        )
        state["next"] = {"batch": next_batch, "block": next_block}
        write_file(partial / PROGRESS, json.dumps(state, indent=1))
        bar.update(len(pending) * seq_len)
        pending.clear()

    # Resume: skip the documents of whole packing batches already in shards (read, not tokenized),
    # then the blocks of the batch a shard boundary cut.
    batch_index, skip = state["next"]["batch"], state["next"]["block"]
    documents = itertools.islice(rows, batch_index * map_batch, None)
    with bar:
        while batch := list(itertools.islice(documents, map_batch)):
            blocks = pack({text_field: [row[text_field] for row in batch]})["input_ids"]
            for j in range(skip, len(blocks)):
                pending.append(blocks[j])
                if len(pending) == per_shard:
                    flush(batch_index, j + 1)
            skip = 0
            batch_index += 1
        if pending:
            flush(batch_index, 0)
