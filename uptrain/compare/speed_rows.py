"""Speed beside quality in `uptrain compare`: each row's time per sample, decode tokens/s and
measured KV-cache bytes (the paper's Table 1, Fig. 3 and Fig. 6).

Speed depends on a checkpoint's shape, not on its weight values, so the runs at one G (or one
allocation of KV heads per layer, or one latent's rank and rotary columns: `speed_key`) share one
measurement: one checkpoint per shape is measured (the source model at its own G, else the first run's conversion).
Every G still to measure is measured in one `measure_speed` call, which samples the checkpoints
in turn, so that a noisy moment on a shared machine hits them all alike. Each G's measurement
is kept whole in `speed-g{G}.json` (`speed-heads-….json`) (temp file, then rename): a resumed compare reuses it unless
the speed options changed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from dataclasses import replace
from pathlib import Path

from uptrain import UptrainError
from uptrain.compare.spec import SPEED_CONTEXT, SPEED_NEW_TOKENS, CompareSpec
from uptrain.convert.spec import distinct_heads
from uptrain.speed import measure_speed
from uptrain.speed_checks import model_shape, parse_device

# The keys of a measurement that must match the options for a stored one to be reused.
SETTING = ("context", "new_tokens", "batch", "repeats", "device")


def speed_setting(spec: CompareSpec) -> dict | None:
    """The measurement the spec asks for, its defaults fitted to the model's positions; None
    with `speed_repeats: 0`. Refuses (one line) what `measure_speed` would refuse, before any run."""
    if spec.speed_repeats == 0:
        return None
    shape = model_shape(Path(spec.model), spec.model)
    if shape.cross is not None:
        return _encoder_decoder_setting(spec, shape)
    positions = shape.max_positions
    new_tokens = spec.speed_new_tokens
    if new_tokens is None:
        new_tokens = SPEED_NEW_TOKENS if positions is None else max(2, min(SPEED_NEW_TOKENS, positions // 8))
    context = spec.speed_context
    if context is None:
        context = SPEED_CONTEXT if positions is None else min(SPEED_CONTEXT, positions - new_tokens)
    if positions is not None and context + new_tokens > positions:
        raise UptrainError(
            f"--speed-context {context} + --speed-new-tokens {new_tokens} = {context + new_tokens} is "
            f"beyond {spec.model}'s {positions} positions; lower them (or --speed-repeats 0: no speed)"
        )
    if context < 1:  # only a default can get here (the schema refuses a context under 1)
        raise UptrainError(
            f"{spec.model}'s {positions} positions leave no prompt beside --speed-new-tokens "
            f"{new_tokens}; lower it (or --speed-repeats 0: no speed)"
        )
    device = parse_device(spec.speed_device)
    dtype = _dtype(device)
    # The MHA cache is the largest of the comparison: if it fits, every G's does.
    shape.check_cache_fits(spec.speed_batch, context, new_tokens, dtype, device, shape.attn_implementation)
    return _measurement(spec, context, new_tokens, device)


def _encoder_decoder_setting(spec: CompareSpec, shape) -> dict:
    """`speed_setting` for an encoder–decoder: a source of `speed_context` tokens (default
    SPEED_CONTEXT, or the encoder's positions where fewer; Whisper: always its encoder's), then
    `speed_new_tokens` decoded (default SPEED_NEW_TOKENS, or an eighth of the decoder's positions)."""
    decoder = shape.max_positions
    new_tokens = spec.speed_new_tokens
    if new_tokens is None:
        new_tokens = SPEED_NEW_TOKENS if decoder is None else max(2, min(SPEED_NEW_TOKENS, decoder // 8))
    context = spec.speed_context
    if context is None and not shape.fixed_source:
        context = min(SPEED_CONTEXT, shape.source_positions or SPEED_CONTEXT)
    device = parse_device(spec.speed_device)
    dtype = _dtype(device)
    try:
        context = shape.source_length(context)
        shape.check(context, new_tokens, spec.speed_batch, dtype, device)  # MHA's cache is the largest
    except UptrainError as err:
        raise UptrainError(f"speed: {err} (--speed-context, --speed-new-tokens; --speed-repeats 0: no speed)") from None
    return _measurement(spec, context, new_tokens, device)


def _dtype(device) -> str:
    return "float32" if device.type == "cpu" else "bfloat16"


def _measurement(spec: CompareSpec, context: int, new_tokens: int, device) -> dict:
    """The setting of a measurement, as `speed_setting` returns it."""
    return {
        "context": context,
        "new_tokens": new_tokens,
        "batch": spec.speed_batch,
        "repeats": spec.speed_repeats,
        "device": str(device),
        "dtype": _dtype(device),
    }


def speed_key(r) -> str:
    """What one speed measurement stands for, and its file's name (speed-KEY.json): `gG` for a row
    with G KV heads in every converted layer (a -g run, MHA, a uniform budget run), else its heads
    layer by layer (`heads-4-1-1-2-2-2`; an encoder–decoder's attentions split by `_`); an MLA
    row's latent, rank and rotary columns (`mla-r112-d16`)."""
    if r.target == "mla":
        return f"mla-r{r.kv_rank}-d{r.rope_dims}"
    heads = r.kv_heads_per_layer
    if heads is None or len(distinct_heads(heads)) == 1:
        return f"g{r.num_kv_heads}"
    return "heads-" + heads.replace(",", "-").replace("/", "_")


def _shown(*keys: str) -> str:
    """'G = 4, 2, 1; KV heads 4-1-1-2-2-2; MLA r112-d16': the measurements `keys` stand for."""
    uniform = [k[1:] for k in keys if k.startswith("g")]
    shown = [f"G = {', '.join(uniform)}"] if uniform else []
    shown += [f"KV heads {k.removeprefix('heads-')}" for k in keys if k.startswith("heads-")]
    return "; ".join(shown + [f"MLA {k.removeprefix('mla-')}" for k in keys if k.startswith("mla-")])


def with_speed(spec: CompareSpec, results: list, log=print) -> list:
    """`results` (study's RunResults) with each row's `speed`: the measurement of its G (its
    per-layer heads), stored or taken now."""
    setting = speed_setting(spec)
    if setting is None:
        return results
    root = Path(spec.output_dir)
    speeds: dict[str, dict] = {}
    to_measure: dict[str, Path] = {}
    for r in results:
        key = speed_key(r)
        if key in speeds or key in to_measure:
            continue
        stored = _stored(root / f"speed-{key}.json", setting)
        if stored is not None:
            log(f"[compare] speed at {_shown(key)}: measured earlier, reusing {root / f'speed-{key}.json'}")
            speeds[key] = stored
            continue
        checkpoint = _checkpoint(spec, root, key, [s.name for s in results if speed_key(s) == key])
        if checkpoint is None:
            log(
                f"[compare] speed at {_shown(key)}: no checkpoint of it left (converted/ and final/ removed); "
                "not measured"
            )
            continue
        to_measure[key] = checkpoint
    if to_measure:
        log(
            f"[compare] speed: measuring {_shown(*to_measure)} (context {setting['context']} + "
            f"{setting['new_tokens']} new tokens, batch {setting['batch']}, {setting['device']}, "
            f"median of {setting['repeats']})"
        )
        measured = measure_speed(
            list(to_measure.values()),
            context=setting["context"],
            new_tokens=setting["new_tokens"],
            batch=setting["batch"],
            dtype=setting["dtype"],
            device=setting["device"],
            repeats=setting["repeats"],
        )
        for (key, checkpoint), m in zip(to_measure.items(), measured):
            # Named as the compare names it (a folder inside the output is named relative to it).
            name = checkpoint.relative_to(root) if checkpoint.is_relative_to(root) else checkpoint
            speeds[key] = {**m, "model": str(name), "machine": machine(setting["device"])}
            _write_json(root / f"speed-{key}.json", speeds[key])
    return [replace(r, speed=speeds.get(speed_key(r))) for r in results]


def _stored(path: Path, setting: dict) -> dict | None:
    """The stored measurement at `path` if it was taken with `setting`, else None (remeasured)."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
    except ValueError:  # written whole, so only an edit breaks it: measured again, like a missing one
        return None
    return stored if isinstance(stored, dict) and all(stored.get(k) == setting[k] for k in SETTING) else None


def _checkpoint(spec: CompareSpec, root: Path, key: str, names: list[str]) -> Path | None:
    """A checkpoint of the shape `key` stands for: the source model at its own G (the MHA row),
    else a run's conversion or, where that was removed, its uptrained final/."""
    if key == f"g{model_shape(Path(spec.model), spec.model).geometry.num_kv_heads}":
        return Path(spec.model)
    for name in names:
        for folder in (root / "converted" / name, root / "runs" / name / "train" / "final"):
            if (folder / "config.json").is_file():
                return folder
    return None


def machine(device: str) -> str:
    """Where the figures were measured, for the table: the CPU's model and the threads torch uses,
    or the GPU's name."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        name = found.group(1).strip() if found else name
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def _write_json(path: Path, value: dict) -> None:
    """Whole or not at all: a kill mid-write leaves no half file that a resume would read."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
