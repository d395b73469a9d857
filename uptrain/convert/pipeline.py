"""The one conversion pipeline every entry point runs: prepare → calibrate → execute.

`prepare` resolves the source, reads its geometry once and runs every check — the spec, the
number of KV heads, the layout, the plan of every output tensor, the calibration inputs and
the output path — before any expensive work and before anything is written. `calibrate` runs
the source model over calibration text when the conversion needs it (minutes on a large
model); `execute` streams the planned tensors into the output folder.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF
from uptrain.checkpoint.atomic import atomic_directory, check_apart, check_output_path
from uptrain.checkpoint.card import card_metadata
from uptrain.checkpoint.hashing import BackgroundHasher
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.checkpoint.source import ResolvedSource, resolve_source
from uptrain.convert.conversion import Calibration, Conversion, conversion_for
from uptrain.convert.kv_heads import resolved_allocation_cost
from uptrain.convert.outputs import copy_side_files, model_card, provenance, write_config
from uptrain.convert.plan import DTYPES, ConversionPlan
from uptrain.convert.pooling import Strategy, get_strategy
from uptrain.convert.spec import CalibrationSettings, ConversionSpec, conversion_spec, parse_size
from uptrain.convert.stream import write_weights
from uptrain.model_info import AttentionGeometry, read_config

__all__ = ["Calibration", "PreparedConversion", "prepare", "calibrate", "execute", "convert_checkpoint"]


@dataclass
class PreparedConversion:
    """A conversion that has passed every check; holds the source checkpoint open."""

    spec: ConversionSpec
    source: ResolvedSource
    conversion: Conversion  # planned: the same orchestration `convert_model` runs
    checkpoint: SourceCheckpoint
    max_shard_bytes: int

    @property
    def config(self) -> dict:
        return self.conversion.config

    @property
    def geometry(self) -> AttentionGeometry:
        """The decoder self-attention's (a decoder-only model's one)."""
        return self.conversion.geometry

    @property
    def strategy(self) -> Strategy:
        return self.conversion.strategy

    @property
    def plan(self) -> ConversionPlan:
        return self.conversion.plan

    @property
    def needs_calibration(self) -> bool:
        """What the strategy needs (calibrated pooling: always), and similarity grouping when
        calibration text is given (without it, heads are compared in weight space)."""
        return self.conversion.uses_calibration(self.spec.calibration_data is not None)

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> PreparedConversion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_not_overlapping(out: Path, source: Path) -> None:
    """OUT equal to the source, inside it, or holding it would replace or pollute the source."""
    check_apart(out, [("source checkpoint", source)])


def prepare(
    spec: ConversionSpec, out: str | Path | None = None, overwrite: bool = False, calibration_given: bool = False
) -> PreparedConversion:
    """Every check of a conversion, cheap ones first; reads only headers and config files.

    `calibration_given`: the caller brings statistics computed earlier (compare computes them
    once for all its conversions), so calibration data is not needed.
    """
    max_shard_bytes = parse_size(spec.max_shard_size)
    strategy = get_strategy(spec.pooling)
    if strategy.needs_calibration and spec.calibration_data is None and not calibration_given:
        raise UptrainError(f"--pooling {spec.pooling} needs calibration data (--calibration-data FILE)")
    if out is not None:
        check_output_path(Path(out).absolute(), overwrite)
    source = resolve_source(spec.source)
    if out is not None:
        check_not_overlapping(Path(out).absolute(), source.folder)
    config = read_config(source.folder)
    conversion = conversion_for(config, spec.kv_heads, strategy, spec.grouping, spec.attention, spec.seed)
    if conversion.pending_budget is not None and spec.calibration_data is None and not calibration_given:
        raise UptrainError(
            "--allocation calibrated measures what each layer's merge loses on calibration data "
            "(--calibration-data FILE)"
        )
    if spec.kv_heads.needs_calibration:  # refuses --allocation-cost loss for an encoder–decoder (even if forced)
        resolved_allocation_cost(spec.allocation_cost, conversion.arch.encoder_decoder)
    checkpoint = SourceCheckpoint(source.folder, allow_pickle=spec.allow_pickle)
    try:
        cast = DTYPES[spec.dtype] if spec.dtype is not None else None
        conversion = conversion.planned(checkpoint, cast)
        prepared = PreparedConversion(spec, source, conversion, checkpoint, max_shard_bytes)
        if prepared.needs_calibration and not calibration_given:
            _check_calibration_inputs(prepared)
    except BaseException:
        checkpoint.close()
        raise
    return prepared


def _check_calibration_inputs(prepared: PreparedConversion) -> None:
    """What calibration will read, checked before any of it runs."""
    from uptrain.convert.calibration import calibration_device, load_calibration_tokenizer
    from uptrain.convert.calibration_seq2seq import check_prompt_keys
    from uptrain.data.text import resolve_data

    check_prompt_keys(prepared.conversion.arch, _prompt_keys(prepared.spec), prepared.spec.calibration_objective)
    if prepared.spec.calibration_weighting != "uniform" and not prepared.conversion.arch.encoder_decoder:
        raise UptrainError(
            f"--calibration-weighting {prepared.spec.calibration_weighting} applies to encoder–decoders' "
            "calibration; this model is decoder-only (drop it)"
        )
    if prepared.spec.value_fit != "inputs":
        check_value_fit(prepared)
    resolve_data(prepared.spec.calibration_data, "calibration_data")
    load_calibration_tokenizer(prepared.source.folder)
    calibration_device(prepared.spec.calibration_device, prepared.spec.calibration_dtype)


def check_value_fit(prepared: PreparedConversion) -> None:
    """`--value-fit output` refits the calibrated merge's values to each head's attention, which it
    computes itself as softmax(scaling · q kᵀ): an encoder–decoder whose attention adds no position
    bias to the scores (BART's family, Marian, M2M100/NLLB, Pegasus, Whisper; not T5's)."""
    arch, fit = prepared.conversion.arch, prepared.spec.value_fit
    if not arch.encoder_decoder:
        raise UptrainError(
            f"--value-fit {fit} applies to encoder–decoders' calibrated merge; this model is decoder-only (drop it)"
        )
    if any(site.layout.query_head_tensors for site in arch.sites):  # T5's family: a bias, and no scaling
        raise UptrainError(
            f"--value-fit {fit} computes each head's attention as softmax(scaling · q kᵀ), and {arch.name}'s adds a "
            "relative position bias to the scores: not supported (drop it)"
        )


def refits_values(prepared: PreparedConversion) -> bool:
    """Whether the conversion refits its calibrated merge's values (`--value-fit output`, `fit_values`)."""
    return (
        prepared.spec.value_fit == "output"
        and prepared.strategy.needs_calibration
        and prepared.strategy.merges_layers
        and prepared.conversion.arch.encoder_decoder
    )


def fit_values(prepared: PreparedConversion, calibration: Calibration, progress: bool | None = None) -> Calibration:
    """`--value-fit output` (`value_refit.py`): every merged layer of the converted attentions solved
    from `calibration`'s moments, then a second pass of the source model over the same calibration
    batches, the merged queries and keys in its hooks, folds what refits each layer's values to its
    heads' attention output; `calibration` with those solutions (`site_solved`, for this conversion
    alone), not changed itself. A layer the allocation leaves at its source KV heads is copied, not
    refit (`LayerMerger.keeps_heads`)."""
    from uptrain.convert.calibration_seq2seq import collect_output_moments, uniform_moment
    from uptrain.convert.layer_merge import LayerSolution
    from uptrain.convert.value_refit import RefitTarget, refit_solution

    check_value_fit(prepared)
    spec = prepared.spec
    merger = prepared.conversion.merger(prepared.checkpoint, calibration, progress=False)
    solved, targets = {}, {}
    for name, site in merger.mergers.items():
        for layer in range(site.geometry.num_layers):
            if site.keeps_heads(layer):
                continue
            solution, attention = site.solved(layer)
            g = site.allocation[layer]
            solved[(name, layer)] = solution
            targets[(name, layer)] = RefitTarget(attention, site.strategy.apply(attention, g, solution.merge), g)
    found = collect_output_moments(
        prepared.source.folder,
        spec.calibration_data,
        targets,
        CalibrationSettings.of(spec),
        progress=progress,
        keys=_prompt_keys(spec),
    )
    refit: dict[str, dict[int, LayerSolution]] = {name: {} for name in merger.mergers}
    for (name, layer), target in targets.items():
        c = uniform_moment(calibration.moments, name, layer).to(torch.float64)
        merge = refit_solution(
            target.source, target.groups, solved[(name, layer)].merge, found[(name, layer)], c, spec.value_fit_blend
        )
        refit[name][layer] = LayerSolution(solved[(name, layer)].order, merge)
    info = {**calibration.info, "value_fit": spec.value_fit, "value_fit_blend": spec.value_fit_blend}
    return replace(calibration, info=info, site_solved=refit, solved_for=_solved_for(prepared))


def _prompt_keys(spec: ConversionSpec):
    """The keys that choose the prompt of the calibration pairs' targets (as training frames them)."""
    from uptrain.objectives.prompts import PromptKeys

    return PromptKeys(
        language=spec.language,
        speech_task=spec.speech_task,
        source_lang=spec.source_lang,
        target_lang=spec.target_lang,
    )


def _solved_for(prepared: PreparedConversion) -> tuple:
    spec = prepared.spec
    allocation = tuple(sorted(prepared.plan.allocation.items()))  # each layer's KV heads decide its merge
    fit = (spec.value_fit, spec.value_fit_blend, spec.calibration_weighting) if spec.value_fit != "inputs" else ()
    return (str(prepared.source.folder), allocation, spec.pooling, spec.grouping, *fit)


def calibrate(
    prepared: PreparedConversion, progress: bool | None = None, keep_moments: bool = False
) -> Calibration | None:
    """Calibration statistics when the conversion uses them, else None.

    Each layer's merge is solved as soon as its moment is complete, on the calibration device,
    and the moment dropped: no layer's moment outlives its layer (7B: 134 MB each, 4.3 GB in
    all). `keep_moments`: keep every moment instead (to reuse them for other conversions).

    `--allocation calibrated`: no layer's G is known until every layer is calibrated, so the moments
    are kept (spilled to a temporary file, as for `keep_moments`), the allocation is chosen from
    them and `prepared` planned again for it (`settle_allocation`); each layer's merge is then
    solved from its moment when it is written."""
    if not prepared.needs_calibration:
        return None
    from uptrain.convert.calibration import collect_attention_moments

    settle = prepared.conversion.pending_budget is not None
    spec = prepared.spec
    settings = CalibrationSettings.of(spec)  # what both kinds of calibration read, and how
    if prepared.conversion.arch.encoder_decoder:
        # The whole model reads the objective's examples; every attention's moments are kept.
        from uptrain.convert.calibration_seq2seq import collect_seq2seq_moments

        moments, info = collect_seq2seq_moments(
            prepared.source.folder, spec.calibration_data, settings, progress=progress, keys=_prompt_keys(spec)
        )
        calibration = Calibration(moments, info)
        if settle:
            settle_allocation(prepared, calibration)
        if refits_values(prepared) and not keep_moments:  # kept moments serve any conversion: refit in `execute`
            calibration = fit_values(prepared, calibration, progress)
        return calibration
    solver = None if keep_moments or settle else prepared.conversion.merger(prepared.checkpoint, None, progress=False)
    moments, info = collect_attention_moments(
        prepared.source.folder,
        spec.calibration_data,
        settings,
        progress=progress,
        per_layer=None if solver is None else solver.solve,
    )
    if solver is None:
        calibration = Calibration(moments, info)
        if settle:
            settle_allocation(prepared, calibration)
        return calibration
    return Calibration({}, info, solver.solutions, _solved_for(prepared))


def _measured_costs(prepared: PreparedConversion, calibration: Calibration) -> list[dict[int, float]]:
    """`--allocation-cost loss`: the source model, whole on the calibration device, scored on the
    calibration blocks (the same blocks, at the length calibration read them) with each layer alone
    converted to each candidate G (`layer_loss.layer_alone_costs`)."""
    from uptrain.convert.allocation import budget_candidates
    from uptrain.convert.calibration import calibration_device, first_calibration_blocks, load_calibration_tokenizer
    from uptrain.convert.in_memory import convert_model
    from uptrain.convert.layer_loss import layer_alone_costs
    from uptrain.loading import load_model

    folder, spec = prepared.source.folder, prepared.spec
    # The blocks calibration read, at the length it read them (at most the model's positions).
    seq_len = calibration.info.get("seq_len", spec.calibration_seq_len)
    settings = replace(CalibrationSettings.of(spec), calibration_seq_len=seq_len)
    blocks, _ = first_calibration_blocks(
        load_calibration_tokenizer(folder), spec.calibration_data, settings, settings.calibration_seq_len
    )
    device, dtype = calibration_device(settings.calibration_device, settings.calibration_dtype)
    model = load_model(folder, "the allocation's source", dtype=dtype).to(device)
    geometry = prepared.conversion.stacks[DECODER_SELF].geometry
    convert = functools.partial(
        convert_model, model, pooling=spec.pooling, grouping=spec.grouping, seed=spec.seed, calibration=calibration
    )
    candidates = budget_candidates(prepared.conversion)[DECODER_SELF]
    return layer_alone_costs(model, blocks, geometry.layer_kv_heads(), convert, candidates=candidates)


def settle_allocation(prepared: PreparedConversion, calibration: Calibration) -> None:
    """`--allocation calibrated`: choose each layer's KV heads by the spec's cost
    (`kv_heads.resolved_allocation_cost`): the model's loss with each layer merged, measured on the
    calibration blocks, or the merge's own loss from the calibration's moments
    (`allocation.settle_allocation`); plan `prepared` again for them, and keep the cost table that
    chose them in `calibration` (for uptrain.json and the card)."""
    from uptrain.convert.allocation import settle_allocation as settled

    spec = prepared.spec
    cost = resolved_allocation_cost(spec.allocation_cost, prepared.conversion.arch.encoder_decoder)
    if cost == "loss":
        if spec.calibration_data is None:
            raise UptrainError(
                "--allocation-cost loss measures the model's loss on the calibration blocks (--calibration-data FILE)"
            )
        costs = {DECODER_SELF: _measured_costs(prepared, calibration)}
    else:
        costs = None
    cast = DTYPES[spec.dtype] if spec.dtype is not None else None
    prepared.conversion, calibration.allocation_costs = settled(
        prepared.conversion, prepared.checkpoint, calibration.moments, cast, costs
    )
    calibration.allocation_cost = cost


def budget_record(spec: ConversionSpec, calibration: Calibration | None = None, forced: bool = False) -> dict | None:
    """What `uptrain.json` records of a `--kv-budget` (None without one): the budget and how it was
    spent; a calibrated allocation's cost table beside it (`allocation_costs`: per converted
    attention, per layer, each candidate G's cost; `allocation_cost_pooling`: the pooling it priced),
    or `allocation_forced` where the budget left one allocation and no cost was measured
    (`Conversion.allocation_forced`)."""
    if spec.kv_budget is None:
        return None
    record = {"kv_budget": spec.kv_budget, "allocation": spec.allocation}
    if spec.cross_kv_weight is not None:  # absent: every head weighs its head_dim, as before the option
        record["cross_kv_weight"] = spec.cross_kv_weight
    if forced:
        record["allocation_forced"] = True
    if calibration is not None and calibration.allocation_costs is not None:
        record["allocation_cost"] = calibration.allocation_cost
        # Both costs price the pooling the conversion applies (`allocation.layer_losses`,
        # `layer_loss.layer_alone_costs`); folders from before this key priced `merge` for the
        # calibrated merge whatever the pooling.
        record["allocation_cost_pooling"] = spec.pooling
        record["allocation_costs"] = {
            name: [{str(g): cost for g, cost in layer.items()} for layer in layers]
            for name, layers in calibration.allocation_costs.items()
        }
    return record


def execute(
    prepared: PreparedConversion,
    out: str | Path,
    overwrite: bool = False,
    calibration: Calibration | None = None,
    progress: bool | None = None,
) -> Path:
    """Stream the planned conversion into `out` (whole or not at all). Returns the output folder.

    Holds at most one layer's K and V (pooled ahead on a second thread) and the tensor being
    written — one layer's Q, K, V and O for `calibrated` pooling or `similarity` grouping.
    """
    spec, checkpoint = prepared.spec, prepared.checkpoint
    if prepared.conversion.pending_budget is not None:
        raise UptrainError(
            "--allocation calibrated chooses each layer's KV heads from calibration; run calibrate() first"
        )
    if prepared.strategy.needs_calibration and calibration is None:
        raise UptrainError(f"--pooling {spec.pooling} needs calibration statistics; run calibrate() first")
    if calibration is not None and refits_values(prepared) and calibration.site_solved is None:
        calibration = fit_values(prepared, calibration, progress)  # moments computed earlier (compare's)
    solved = calibration is not None and (calibration.solved or calibration.site_solved is not None)
    if solved and calibration.solved_for != _solved_for(prepared):
        raise UptrainError(
            f"this calibration was solved for another conversion {calibration.solved_for}; "
            "calibrate(..., keep_moments=True) gives moments that serve any conversion of the source"
        )
    out = Path(out).absolute()
    merger = prepared.conversion.merger(checkpoint, calibration, progress)
    with atomic_directory(out, overwrite) as tmp, BackgroundHasher(checkpoint.files, spec.source_hash) as hasher:
        write_weights(prepared.conversion, checkpoint, tmp, prepared.max_shard_bytes, progress, merger)
        source_files = hasher.result()
        written = write_config(prepared.source.folder, tmp, prepared.config, prepared.plan.config_kv_heads, spec.dtype)
        copy_side_files(prepared.source.folder, tmp, written)
        record = provenance(
            prepared.source,
            source_files,
            prepared.strategy,
            spec.seed,
            prepared.plan,
            spec.dtype,
            spec.grouping,
            merger.kv_orders,
            calibration.info if calibration is not None else None,
            budget_record(spec, calibration, prepared.conversion.allocation_forced),
        )
        (tmp / "uptrain.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(record, card_metadata(prepared.source.folder)))
    return out


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    num_kv_heads: int | None = None,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    calibration: Calibration | None = None,
    **options: Any,
) -> Path:
    """Convert the checkpoint at `src` to `num_kv_heads` KV heads (or, instead, `kv_heads_per_layer`
    or `kv_budget` among `options`; or `target="mla"` with `kv_rank`) and write it to `out`.

    `options` are the keys of `ConversionSpec` (pooling, grouping, seed, dtype, calibration_data,
    calibration_tokens, calibration_device, source_hash, max_shard_size, …). Pass `calibration`
    to reuse statistics computed earlier for the same source; otherwise they are computed from
    `calibration_data` when the conversion needs them. `out` appears only when everything
    succeeded. Returns the output folder.
    """
    spec = conversion_spec(source=str(src), num_kv_heads=num_kv_heads, **options)
    if spec.target == "mla":
        from uptrain.convert.mla import convert_mla

        return convert_mla(spec, out, overwrite, progress)
    with prepare(spec, out, overwrite, calibration_given=calibration is not None) as prepared:
        if calibration is None:
            calibration = calibrate(prepared, progress)
        elif prepared.conversion.pending_budget is not None:  # moments computed earlier choose the allocation
            settle_allocation(prepared, calibration)
        return execute(prepared, out, overwrite, calibration, progress)
