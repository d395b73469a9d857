"""Calibration statistics of an encoder–decoder: each attention's input moments, from its objective.

The merge of each attention reads the moment of what its keys and values read and of what its
queries read (`calibrated.py`). In self-attention both are the layer's input; in
cross-attention the keys and values read the encoder's output and the queries the decoder's
states, so each is calibrated from its own input: the objective the model is trained with
(`uptrain.objectives`; `uptrain train` and `uptrain compare` pass theirs, else the architecture's
`default_objective`) turns calibration text into what the model is trained on — span-corrupted
blocks (T5), infilled blocks (BART, mBART), or jsonl source/target pairs
(Marian, M2M100/NLLB, Pegasus) or speech pairs (Whisper), both read by `uptrain.data.pairs`, the
reader training uses, framed as training frames them (`uptrain.objectives.prompts`: Whisper's
language and task tokens, M2M100's and NLLB's language codes, multilingual Marian's `>>code<<`
ahead of each source), so the states calibrated on are those users translate or decode with —
and the source model reads them whole (encoder inputs, and the targets as the decoder's
inputs), forward pre-hooks folding every attention's inputs, padding left out.

Moments are keyed `"{attention}.{layer}"` (the input of that attention module; for "cross" the
decoder's states) and `"cross.keys_values"` (the encoder's output, which every cross-attention
layer reads); `site_moments` gives one attention's view, layer → moment, as `LayerMerger` reads it.
"""

from __future__ import annotations

import lzma
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from uptrain import UptrainError, exception_line
from uptrain.convert.calibrated import CrossMoments, augmented_inputs
from uptrain.convert.spec import DEFAULT_CALIBRATION, CalibrationSettings
from uptrain.objectives.prompts import APPLIES_TO, KEYS_OF, SPEECH_KEYS, PromptKeys
from uptrain.strict_json import parse_json

CROSS_KEYS_VALUES = "cross.keys_values"
# `calibration_weighting: attention`: per decoder attention, the moments that weigh each error where
# attention goes ("{attention}.{layer}.pooled", "{attention}.{layer}.received"; fold_attention_weighted).
POOLED, RECEIVED = "pooled", "received"
WEIGHTED_SITES = ("decoder-self", "cross")
CHECKPOINT_PROMPT = PromptKeys()  # no keys given: the prompt from the checkpoint's defaults


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


def calibration_objective(arch, name: str | None = None):
    """The objective an encoder–decoder is calibrated with: `name`, the one it is trained with
    (`uptrain train` passes its own), else its family's."""
    from uptrain.objectives import get_objective

    return get_objective(name or arch.default_objective)


def check_prompt_keys(arch, keys: PromptKeys, objective_name: str | None = None) -> None:
    """Refuses, in one line, a key of the targets' prompt that the model's calibration does not
    frame its examples with: `--language` / `--speech-task` (Whisper's prompt) where it reads no
    speech, `--source-lang` / `--target-lang` where its family's pairs carry no language codes."""
    objective = calibration_objective(arch, objective_name) if arch.encoder_decoder else None
    reads = objective.reads if objective is not None else "text"
    takes = KEYS_OF.get(arch.target_prompt, ()) if objective is not None and objective.reads_examples else ()
    if stray := [k for k in keys.given() if k not in takes]:
        flag = "--" + stray[0].replace("_", "-")
        if stray[0] in SPEECH_KEYS:
            raise UptrainError(
                f"{flag} applies to Whisper's calibration (speech pairs); {arch.name} calibrates on text"
            )
        taken = " and ".join("--" + k.replace("_", "-") for k in takes if k not in SPEECH_KEYS) or "none of them"
        raise UptrainError(
            f"{flag} applies to the calibration pairs of {APPLIES_TO[stray[0]].removeprefix('objective pairs of ')}; "
            f"{arch.name}'s calibration ({reads.replace('_', ' ')}) takes {taken}"
        )


def _refuse_speech_pairs(data, arch) -> None:
    """A text family given speech pairs (jsonl lines with `audio`) is refused in one line: its
    text reader would otherwise calibrate on the transcripts alone. So is a file whose first line
    is not JSON (not UTF-8, a number past Python's digits), or that cannot be read."""
    from uptrain.data.pairs import OPENERS
    from uptrain.data.text import resolve_data

    source = resolve_data(data, "calibration_data")
    if source.builder != "json" or not source.is_local:
        return
    for file in source.files:
        try:
            with OPENERS.get(Path(file).suffix, open)(file, "rb") as f:
                number, first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), (0, b""))
        except (OSError, EOFError, lzma.LZMAError) as err:
            raise UptrainError(f"calibration data: cannot read {file}: {exception_line(err)}") from None
        where = f"calibration data {file} line {number}"
        if not _json_lines(file):  # a `.json` document: its first line may be `[` or `{` alone
            try:
                first.decode("utf-8")
            except UnicodeDecodeError:
                raise UptrainError(f"{where} is not UTF-8 text") from None
            continue
        row = parse_json(first, where) if first else None
        if isinstance(row, dict) and "audio" in row:
            raise UptrainError(
                f"calibration data {file} holds speech pairs (`audio`); {arch.name}'s encoder reads text: "
                "give text (or source/target pairs) for its calibration"
            )


def _json_lines(file) -> bool:
    """Whether `file` is JSON lines (`.jsonl`, also compressed), not one JSON document (`.json`)."""
    from uptrain.data.text import COMPRESSIONS

    path = Path(file)
    return (path.stem if path.suffix in COMPRESSIONS else path.name).endswith(".jsonl")


def _fold(moments: dict, counts: dict, key: str, x: torch.Tensor, keep: torch.Tensor | None) -> None:
    """Add Σ x̃ x̃ᵀ over the kept positions of `x` ([b, t, D]) to moments[key], x̃ = [x, 1], in float64."""
    rows = x[keep] if keep is not None else x.reshape(-1, x.shape[-1])
    rows = augmented_inputs(rows)
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


def fold_attention_weighted(moments: dict, counts: dict, key: str, x, probs, queries) -> None:
    """What the next layer reads of one attention: add to moments[KEY.pooled] the moment of each
    head's attention-pooled input y = Σ_t p_t x̃_t (every head, every kept query: the value error
    reaches the output through it), and to moments[KEY.received] the moment of the inputs, each
    position weighted by the attention it receives (summed over heads and kept queries: where a
    key's score error moves the output). `x`: [b, s, D] what keys and values read; `probs`:
    [b, h, t, s] the attention; `queries`: [b, t] the queries that count (not padding)."""
    x = augmented_inputs(x)
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
            for out in _forward_batches(model, batches, masks, "calibrate", progress, output_attentions=weighted):
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


def _pair_batches(
    model_dir: Path, arch, objective, tokenizer, data, wanted: int, seq_len: int, batch_size: int, keys: PromptKeys
) -> tuple[list[dict], dict]:
    """The calibration batches of a family that trains on pairs: the first `wanted` examples of
    `data` as training reads them (`load_pairs`: every line checked; speech through the
    feature extractor), framed with the prompt training frames them with (`target_framing`:
    Whisper's language and task, M2M100's/NLLB's language codes, Marian's `>>code<<`), sources
    cut at `seq_len` tokens and targets at `seq_len` (at most the decoder's positions)."""
    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives.prompts import target_framing

    config = read_config(model_dir)
    framing = target_framing(arch, objective, keys, tokenizer, str(model_dir), config)
    positions = arch.target_positions(config, f"calibration's source {model_dir}")
    target_len = seq_len if positions is None else min(seq_len, positions)
    examples = load_pairs(
        data, "calibration_data", objective, tokenizer, str(model_dir), config, seq_len, target_len, framing
    )
    count = min(wanted, len(examples))
    starts = range(0, count, batch_size)
    batches = [examples.take(list(range(start, min(start + batch_size, count)))) for start in starts]
    info = {"data": str(data), "objective": objective.name, "examples": count}
    info |= {"target_len": target_len} if objective.reads == "speech_pairs" else {"seq_len": seq_len}
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
    """The batches an encoder–decoder is calibrated on (the objective it is trained with over `data`, the
    first `settings.wanted_blocks` examples) and their description for provenance. `keys`: the
    prompt of the targets of a family that trains on pairs (`--language`, `--target-lang`, …; the
    checkpoint's defaults where None), as training frames them."""
    from uptrain.convert.calibration import first_calibration_blocks, load_calibration_tokenizer
    from uptrain.model_info import read_config
    from uptrain.objectives import special_tokens_for
    from uptrain.objectives.corruption import evaluation_generator

    objective = calibration_objective(arch, settings.calibration_objective)
    tokenizer = load_calibration_tokenizer(model_dir)
    wanted, seq_len = settings.wanted_blocks, settings.calibration_seq_len
    check_prompt_keys(arch, keys, settings.calibration_objective)
    if objective.reads == "speech_pairs":
        return _pair_batches(model_dir, arch, objective, tokenizer, data, wanted, seq_len, batch_size, keys)
    _refuse_speech_pairs(data, arch)
    # The block length is calibration's own choice: at most the positions of the encoder and of the
    # decoder (a text block is both the corrupted source and the target; a pair is cut at it on
    # either side).
    config, where = read_config(model_dir), f"calibration's source {model_dir}"
    limits = [n for n in (arch.source_positions(config, where), arch.target_positions(config, where)) if n]
    seq_len = min([seq_len, *limits])
    settings = replace(settings, calibration_seq_len=seq_len)
    wanted = settings.wanted_blocks
    if objective.reads == "text_pairs":
        return _pair_batches(model_dir, arch, objective, tokenizer, data, wanted, seq_len, batch_size, keys)
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


def _calibration_run(src, data, settings: CalibrationSettings, batch_size: int, keys: PromptKeys):
    """(the source model on the calibration device, its architecture, the calibration batches,
    their description): what a calibration pass runs."""
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
    return model, arch, batches, info


def _forward_batches(model, batches, masks: dict, desc: str, progress: bool | None, **kwargs):
    """Each batch through `model` on its device, `masks` set first to the batch's encoder and
    decoder positions that count (None: all; the hooks read them); yields each output."""
    from tqdm.auto import tqdm

    for batch in tqdm(batches, desc=desc, unit="batch", disable=None if progress is None else not progress):
        batch = _on_device(batch, model)
        mask = batch.get("attention_mask")
        masks["encoder"] = None if mask is None or "input_features" in batch else mask.bool()
        masks["decoder"] = batch["labels"] != -100
        yield model(**batch, use_cache=False, **kwargs)


def _on_device(batch: dict, model) -> dict:
    """A batch on the model's device, audio features in its dtype (bfloat16 calibration); ids and labels as they are."""
    return {
        k: v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device) for k, v in batch.items()
    }


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
    read through the objective the run trains with (`settings.calibration_objective`; its family's
    by default); the whole model runs as `settings` say (dtype, device). `keys`: the prompt of the
    targets of a family that trains on pairs (`--language`, `--speech-task`, `--source-lang`,
    `--target-lang`)."""
    model, arch, batches, info = _calibration_run(src, data, settings, batch_size, keys)
    if settings.calibration_weighting == "attention":
        model.set_attn_implementation("eager")  # the attention probabilities, returned
        info["weighting"] = settings.calibration_weighting
    moments = seq2seq_moments(model, arch, batches, progress, settings.calibration_weighting)
    info["tokens"] = sum(int((b["labels"] != -100).sum()) for b in batches)
    info["dtype"] = settings.calibration_dtype
    return {k: m.cpu() for k, m in moments.items()}, info


def uniform_moment(moments: Mapping, attention: str, layer: int) -> torch.Tensor:
    """C = E[x̃ x̃ᵀ] over every position one attention's keys and values read, however the merge
    was weighted: the layer's own input, or (cross-attention) the encoder's output."""
    return moments[CROSS_KEYS_VALUES if attention == "cross" else f"{attention}.{layer}"]


def collect_output_moments(
    src: str | Path,
    data,
    targets: dict,
    settings: CalibrationSettings = DEFAULT_CALIBRATION,
    *,
    batch_size: int = 4,
    progress: bool | None = None,
    keys: PromptKeys = CHECKPOINT_PROMPT,
) -> dict:
    """`--value-fit output`'s second calibration pass: the source model over the same batches as
    `collect_seq2seq_moments`, each target attention's inputs hooked and folded by
    `value_refit.fold_example` (its source attention and its merged queries' and keys', computed
    from the inputs in float64). `targets`: (attention, layer) → `RefitTarget`; returns
    (attention, layer) → `OutputMoments`, on the CPU."""
    from uptrain.convert.value_refit import OutputMoments, fold_example

    model, arch, batches, _ = _calibration_run(src, data, settings, batch_size, keys)
    found = {t: OutputMoments() for t in targets}
    masks: dict[str, torch.Tensor | None] = {}
    handles = []

    def hook(target: tuple[str, int], refit):
        site = target[0]

        def fold(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            encoded = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))
            kv = encoded if site == "cross" else hidden
            queries = masks["encoder" if site == "encoder" else "decoder"]
            source_keys = None if site == "decoder-self" else masks["encoder"]
            for i in range(len(hidden)):  # one example at a time: [h, tq, tk] float64 probabilities
                fold_example(
                    refit,
                    found[target],
                    hidden[i],
                    kv[i],
                    module.scaling,
                    None if queries is None else queries[i],
                    None if source_keys is None else source_keys[i],
                    causal=site == "decoder-self",
                )

        return fold

    on_device = {t: refit.to(model.device) for t, refit in targets.items()}
    for site in arch.sites:
        for attention, layer in targets:
            if attention == site.attention:
                module = model.get_submodule(site.layout.attn_prefix.format(layer=layer))
                hooked = hook((attention, layer), on_device[(attention, layer)])
                handles.append(module.register_forward_pre_hook(hooked, with_kwargs=True))
    try:
        with torch.no_grad():
            for _ in _forward_batches(model, batches, masks, "value fit", progress):
                pass  # the hooks fold what they read
    finally:
        for handle in handles:
            handle.remove()
    for moments in found.values():
        moments.merged, moments.cross = moments.merged.cpu(), moments.cross.cpu()
    return found
