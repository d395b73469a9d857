"""Calibration statistics of an encoder–decoder: each attention's input moments, from its objective.

The merge of each attention reads the moment of what its keys and values read and of what its
queries read (`calibrated.py`). In self-attention both are the layer's input; in
cross-attention the keys and values read the encoder's output and the queries the decoder's
states, so each is calibrated from its own input: the family's objective (`uptrain.objectives`,
the architecture's `default_objective`) turns calibration text into what the model is trained
on — span-corrupted blocks (T5), infilled blocks (BART, mBART), or jsonl source/target pairs
(Marian, M2M100, Pegasus), or jsonl speech pairs (Whisper: read by `uptrain.data.pairs`, the
reader training uses, audio through the checkpoint's feature extractor and targets opening with
the prompt training frames them with, so the decoder states calibrated on are those users decode
with) — and the source model reads them whole (encoder inputs, and the targets as the decoder's
inputs), forward pre-hooks folding every attention's inputs, padding left out.

Moments are keyed `"{attention}.{layer}"` (the input of that attention module; for "cross" the
decoder's states) and `"cross.keys_values"` (the encoder's output, which every cross-attention
layer reads); `site_moments` gives one attention's view, layer → moment, as `LayerMerger` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.convert.calibrated import CrossMoments
from uptrain.convert.spec import DEFAULT_CALIBRATION, CalibrationSettings
from uptrain.objectives.prompts import SPEECH_KEYS, PromptKeys

CROSS_KEYS_VALUES = "cross.keys_values"
# `calibration_weighting: attention`: per decoder attention, the moments that weigh each error where
# attention goes ("{attention}.{layer}.pooled", "{attention}.{layer}.received"; fold_attention_weighted).
POOLED, RECEIVED = "pooled", "received"
WEIGHTED_SITES = ("decoder-self", "cross")
CHECKPOINT_PROMPT = PromptKeys()  # no keys given: Whisper's prompt from the checkpoint's defaults


class SiteMoments(Mapping):
    """One attention's moments, layer → C (cross-attention: `CrossMoments`), read lazily."""

    def __init__(self, moments: Mapping, attention: str):
        self.moments, self.attention = moments, attention

    def __getitem__(self, layer: int):
        key = f"{self.attention}.{layer}"
        own = self.moments[key]
        if f"{key}.{POOLED}" in self.moments:  # calibration_weighting attention: where attention goes
            return CrossMoments(self.moments[f"{key}.{RECEIVED}"], own, self.moments[f"{key}.{POOLED}"])
        if self.attention == "cross":
            return CrossMoments(self.moments[CROSS_KEYS_VALUES], own)
        return own

    def _layers(self) -> list[int]:
        prefix = f"{self.attention}."
        return sorted(
            int(k[len(prefix) :]) for k in self.moments if k.startswith(prefix) and k[len(prefix) :].isdigit()
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers())

    def __len__(self) -> int:
        return len(self._layers())


def site_moments(moments: Mapping, attention: str) -> SiteMoments:
    """The moments of one attention of an encoder–decoder (`attention`: "encoder", "decoder-self", "cross")."""
    return SiteMoments(moments, attention)


def calibration_objective(arch):
    """The objective an encoder–decoder is calibrated with (its family's)."""
    from uptrain.objectives import get_objective

    return get_objective(arch.default_objective)


def check_prompt_keys(arch, keys: PromptKeys) -> None:
    """Refuses, in one line, `--language` / `--speech-task` for a model whose calibration reads no
    speech (they choose Whisper's target prompt)."""
    speech = arch.encoder_decoder and calibration_objective(arch).reads == "speech_pairs"
    if not speech and (given := keys.given(SPEECH_KEYS)):
        flag = "--" + given[0].replace("_", "-")
        raise UptrainError(f"{flag} applies to Whisper's calibration (speech pairs); {arch.name} calibrates on text")


def _refuse_speech_pairs(data, arch) -> None:
    """A text family given speech pairs (jsonl lines with `audio`) is refused in one line: its
    text reader would otherwise calibrate on the transcripts alone."""
    from uptrain.data.pairs import OPENERS
    from uptrain.data.text import resolve_data

    source = resolve_data(data, "calibration_data")
    if source.builder != "json" or not source.is_local:
        return
    for file in source.files:
        with OPENERS.get(Path(file).suffix, open)(file, "rt") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            row = json.loads(first) if first else None
        except json.JSONDecodeError:
            continue  # the text reader says what is wrong with it
        if isinstance(row, dict) and "audio" in row:
            raise UptrainError(
                f"calibration data {file} holds speech pairs (`audio`); {arch.name}'s encoder reads text: "
                "give text (or source/target pairs) for its calibration"
            )


def _fold(moments: dict, counts: dict, key: str, x: torch.Tensor, keep: torch.Tensor | None) -> None:
    """Add Σ x̃ x̃ᵀ over the kept positions of `x` ([b, t, D]) to moments[key], x̃ = [x, 1], in float64."""
    rows = x[keep] if keep is not None else x.reshape(-1, x.shape[-1])
    rows = rows.to(torch.float64)
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)], dim=1)
    if key not in moments:
        moments[key] = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float64, device=rows.device)
        counts[key] = 0
    moments[key].addmm_(rows.mT, rows)
    counts[key] += rows.shape[0]


def _fold_weighted(moments: dict, counts: dict, key: str, rows: torch.Tensor, weights: torch.Tensor) -> None:
    """Add Σ w x̃ x̃ᵀ over `rows` ([n, D+1], augmented already) to moments[key]; counts[key] sums w."""
    rows = rows.to(torch.float64)
    if key not in moments:
        moments[key] = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float64, device=rows.device)
        counts[key] = 0.0
    moments[key].addmm_((rows * weights.to(rows)[:, None]).mT, rows)
    counts[key] += float(weights.sum())


def _augmented(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)], dim=-1)


def fold_attention_weighted(moments: dict, counts: dict, key: str, x, probs, queries) -> None:
    """What the next layer reads of one attention: add to moments[KEY.pooled] the moment of each
    head's attention-pooled input y = Σ_t p_t x̃_t (every head, every kept query: the value error
    reaches the output through it), and to moments[KEY.received] the moment of the inputs, each
    position weighted by the attention it receives (summed over heads and kept queries: where a
    key's score error moves the output). `x`: [b, s, D] what keys and values read; `probs`:
    [b, h, t, s] the attention; `queries`: [b, t] the queries that count (not padding)."""
    x = _augmented(x)
    p = probs.to(torch.float64) * queries[:, None, :, None].to(torch.float64)
    pooled = p @ x[:, None]  # [b, h, t, D+1]
    rows = pooled[queries[:, None, :].expand(-1, p.shape[1], -1)]
    _fold_weighted(moments, counts, f"{key}.{POOLED}", rows, torch.ones(len(rows), dtype=rows.dtype))
    received = p.sum((1, 2))  # [b, s]
    _fold_weighted(moments, counts, f"{key}.{RECEIVED}", x.flatten(0, 1), received.flatten())


def seq2seq_moments(
    model, arch, batches, progress: bool | None = None, weighting: str = "uniform"
) -> dict[str, torch.Tensor]:
    """Every attention's input moments (keys as the module docstring says) of `model`, a
    transformers encoder–decoder with `arch`'s layout, over `batches` (dicts of model inputs:
    `input_ids` or `input_features`, optional `attention_mask`, `labels` with -100 for padding).
    `weighting` "attention": the decoder's attentions' attention-weighted moments too
    (`fold_attention_weighted`, from the attention probabilities the model returns: `model` must
    compute them, e.g. with eager attention)."""
    from tqdm.auto import tqdm

    moments: dict[str, torch.Tensor] = {}
    counts: dict[str, float] = {}
    masks: dict[str, torch.Tensor | None] = {}
    read: dict[str, torch.Tensor] = {}  # weighting "attention": what each decoder attention's K/V read
    handles = []
    weighted = weighting == "attention"

    def hook(key: str, site: str, layer: int):
        def fold(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            _fold(moments, counts, key, hidden, masks["encoder" if site == "encoder" else "decoder"])
            # transformers spells the encoder's output key_value_states (T5, BART) or
            # encoder_hidden_states (UMT5).
            encoded = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))
            if site == "cross" and layer == 0:
                _fold(moments, counts, CROSS_KEYS_VALUES, encoded, masks["encoder"])
            if weighted and site in WEIGHTED_SITES:
                read[key] = encoded if site == "cross" else hidden

        return fold

    for site in arch.sites:
        layers = site.geometry.read(model.config.to_dict()).num_layers
        for layer in range(layers):
            module = model.get_submodule(site.layout.attn_prefix.format(layer=layer))
            key = f"{site.attention}.{layer}"
            handles.append(module.register_forward_pre_hook(hook(key, site.attention, layer), with_kwargs=True))
    try:
        with torch.no_grad():
            for batch in tqdm(
                batches, desc="calibrate", unit="batch", disable=None if progress is None else not progress
            ):
                # Audio features in the model's dtype (bfloat16 calibration); ids and labels as they are.
                batch = {
                    k: v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device)
                    for k, v in batch.items()
                }
                mask = batch.get("attention_mask")
                masks["encoder"] = None if mask is None or "input_features" in batch else mask.bool()
                masks["decoder"] = batch["labels"] != -100
                out = model(**batch, use_cache=False, output_attentions=weighted)
                if weighted:
                    _fold_weighted_sites(moments, counts, arch, out, read, masks)
    finally:
        for handle in handles:
            handle.remove()
    return {key: m / (counts[key] or 1) for key, m in moments.items()}


def _fold_weighted_sites(moments: dict, counts: dict, arch, out, read: dict, masks: dict) -> None:
    """One batch's attention-weighted moments of every decoder attention (`fold_attention_weighted`)."""
    probs = {"decoder-self": out.decoder_attentions, "cross": out.cross_attentions}
    for site in arch.sites:
        if site.attention not in WEIGHTED_SITES:
            continue
        for layer, p in enumerate(probs[site.attention]):
            key = f"{site.attention}.{layer}"
            x = read.pop(key)
            if site.attention == "cross" and masks["encoder"] is not None:
                p = p * masks["encoder"][:, None, None, :]  # padded source positions read nothing
            fold_attention_weighted(moments, counts, key, x, p, masks["decoder"])


def _text_pairs(path: str, fields: tuple[str, str], limit: int) -> list[tuple[str, str]]:
    """The first `limit` (source, target) pairs of a local jsonl file; one line for anything else."""
    need = f"calibration data {path}: a jsonl file whose lines hold text fields {' and '.join(fields)}"
    if not Path(path).is_file():
        raise UptrainError(f"{need} (calibration reads pairs from local files)")
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UptrainError(f"{need}; line {number} is not JSON") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(f), str) for f in fields):
                raise UptrainError(f"{need}; line {number} lacks them")
            pairs.append((row[fields[0]], row[fields[1]]))
        if len(pairs) >= limit:
            break
    return pairs


def _speech_batches(
    model_dir: Path, arch, objective, tokenizer, data, wanted: int, seq_len: int, batch_size: int, keys: PromptKeys
) -> tuple[list[dict], dict]:
    """Whisper's calibration batches: the first `wanted` speech pairs of `data` as training reads
    them (`load_pairs`: every line checked, audio through the feature extractor), the targets
    framed with the prompt `generate(language=…, task=…)` forces, cut at `seq_len` tokens (at
    most the decoder's positions)."""
    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives.prompts import target_framing

    config = read_config(model_dir)
    framing = target_framing(arch, objective, keys, tokenizer, str(model_dir), config)
    positions = config.get("max_target_positions")
    target_len = min(seq_len, positions) if isinstance(positions, int) else seq_len
    examples = load_pairs(
        data, "calibration_data", objective, tokenizer, str(model_dir), config, seq_len, target_len, framing
    )
    count = min(wanted, len(examples))
    starts = range(0, count, batch_size)
    batches = [examples.take(list(range(start, min(start + batch_size, count)))) for start in starts]
    info = {"data": str(data), "objective": objective.name, "examples": count, "target_len": target_len}
    if framing is not None:
        info["prompt"] = framing.shown
    return batches, info


def calibration_batches(
    model_dir: Path,
    arch,
    data,
    settings: CalibrationSettings,
    batch_size: int,
    keys: PromptKeys = CHECKPOINT_PROMPT,
) -> tuple[list[dict], dict]:
    """The batches an encoder–decoder is calibrated on (its family's objective over `data`, the
    first `settings.wanted_blocks` examples) and their description for provenance. `keys`: the
    prompt of Whisper's targets (the checkpoint's defaults where None)."""
    from uptrain.convert.calibration import first_calibration_blocks, load_calibration_tokenizer
    from uptrain.objectives import IGNORE_INDEX, special_tokens_for
    from uptrain.objectives.corruption import evaluation_generator

    objective = calibration_objective(arch)
    tokenizer = load_calibration_tokenizer(model_dir)
    wanted, seq_len = settings.wanted_blocks, settings.calibration_seq_len
    label = str(data)
    check_prompt_keys(arch, keys)
    if objective.reads == "speech_pairs":
        return _speech_batches(model_dir, arch, objective, tokenizer, data, wanted, seq_len, batch_size, keys)
    _refuse_speech_pairs(data, arch)
    if objective.reads == "text_pairs":
        files = [data] if isinstance(data, str) else list(data)
        pairs = [p for f in files for p in _text_pairs(f, objective.fields, wanted)][:wanted]
        if not pairs:
            raise UptrainError(f"calibration data {label} holds no {'/'.join(objective.fields)} pairs")
        examples = []
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            enc = tokenizer(
                [s for s, _ in chunk],
                text_target=[t for _, t in chunk],
                max_length=seq_len,
                truncation=True,
                padding=True,
                return_tensors="pt",
            )
            labels = enc["labels"].masked_fill(enc["labels"] == tokenizer.pad_token_id, IGNORE_INDEX)
            examples.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels})
        count = len(pairs)
    else:
        rows, source = first_calibration_blocks(tokenizer, data, settings, objective.block_length(seq_len))
        label, count = source.label, len(rows)
        tokens = special_tokens_for(objective, tokenizer, "calibration's source")
        corrupted = [objective.corrupt(row, tokens, evaluation_generator(0, row)) for row in rows]
        examples = [
            {k: torch.cat([c[k] for c in corrupted[start : start + batch_size]]) for k in corrupted[0]}
            for start in range(0, count, batch_size)
        ]
    info = {"data": label, "objective": objective.name, "examples": count, "seq_len": seq_len}
    return examples, info


def collect_seq2seq_moments(
    src: str | Path,
    data,
    settings: CalibrationSettings = DEFAULT_CALIBRATION,
    *,
    batch_size: int = 4,
    progress: bool | None = None,
    keys: PromptKeys = CHECKPOINT_PROMPT,
) -> tuple[dict[str, torch.Tensor], dict]:
    """({key: C}, a description for provenance) of the encoder–decoder at `src` over `data`,
    read through its family's objective; the whole model runs as `settings` say (dtype, device).
    `keys`: the prompt of Whisper's targets (`--language`, `--speech-task`)."""
    from uptrain.architecture import architecture
    from uptrain.checkpoint.source import resolve_source
    from uptrain.convert.calibration import calibration_device
    from uptrain.loading import load_model
    from uptrain.model_info import read_config

    model_dir = resolve_source(src).folder
    arch = architecture(read_config(model_dir).get("model_type"))
    run_device, run_dtype = calibration_device(settings.calibration_device, settings.calibration_dtype)
    batches, info = calibration_batches(model_dir, arch, data, settings, batch_size, keys)
    import uptrain.modeling  # noqa: F401  registers t5_gqa, …: a converted checkpoint loads here too

    model = load_model(model_dir, "calibration's source", arch.auto_class, dtype=run_dtype).to(run_device).eval()
    if settings.calibration_weighting == "attention":
        model.set_attn_implementation("eager")  # the attention probabilities, returned
        info["weighting"] = settings.calibration_weighting
    moments = seq2seq_moments(model, arch, batches, progress, settings.calibration_weighting)
    info["tokens"] = sum(int((b["labels"] != -100).sum()) for b in batches)
    info["dtype"] = settings.calibration_dtype
    return {k: m.cpu() for k, m in moments.items()}, info
