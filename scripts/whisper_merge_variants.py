"""What the calibrated merge should minimise on Whisper: variants of its calibration, measured at α = 0.

    python scripts/whisper_merge_variants.py --model whisper-base --train-data speech/train.jsonl \\
        --eval-data speech/test.jsonl --output-dir whisper-study --kv-heads 4 2

The `calibrated` merge (uptrain/convert/calibrated.py) weighs each attention's key and value error
by C = E[x xᵀ] over every position the keys and values read: for cross-attention, all 1500 encoder
frames of a clip, most of them the padding after the speech, which the decoder barely attends to.
What the next layer reads is the attention's output, Σ_t p_t O V x_t: its value error is weighted by
the moment of the attention-pooled inputs y = Σ_t p_t x_t, and its score error matters where the
attention goes. The variants, all solved by uptrain's own `solve_values` / `solve_keys` /
`apply_calibrated` (only the moments change):

- `uniform`: C over every position (uptrain's calibrated, computed here again as a check);
- `pooled-values`: values weighted by E[y yᵀ] (y: each head's attention-pooled input, heads averaged);
- `pooled`: that, and keys weighted by the attention each position receives (Σ over heads and queries);
- `sequential`: `uniform`, layer by layer in order: each decoder layer's self-attention calibrated on
  the decoder with the layers before it already merged, its cross-attention after its own
  self-attention is (each sees the other's error);
- `sequential-pooled`: both;
- `output`: `uniform`'s keys, then the values refitted to the attention output as the next layer
  reads it — `uptrain convert --value-fit output` (uptrain/convert/value_refit.py), which this
  variant calls: with the merged keys in place each head's attention moves (p' for MHA's p), and the
  shared V'_g and each head's map M_h (folded into its o_proj columns) minimise
  Σ_{h∈g} E‖O_h (M_h V'_g z'_h − V_h z_h)‖², z'_h = Σ_t p'_{h,t} x̃_t, z_h = Σ_t p_{h,t} x̃_t (x̃: the
  inputs with a constant 1, so the bias is refitted too), from the moments E[z' z'ᵀ] and E[z z'ᵀ]
  per head on the MHA model's states (projected into the span of the group's source value heads,
  where V'_g is kept; blended by λ = `--output-blend` with uptrain's value objective over every position);
- `sequential-output`: `output` layer by layer in order on the decoder merged so far: z' from the
  merged model's own states, z from the MHA model's (each layer also makes up for the error of
  the layers before it).

Each variant's model (MHA-shaped: the G shared K/V heads repeated, which computes exactly what the
GQA checkpoint computes) is scored as scripts/whisper_study.py scores its rows (WER, CER, perplexity
of the true transcript) on the same held-out clips; results in --output-dir/variants/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import whisper_study  # noqa: E402  the study's scorer and settings

from uptrain.convert.calibrated import augmented_inputs  # noqa: E402
from uptrain.convert.spec import DEFAULT_VALUE_FIT_BLEND  # noqa: E402

VARIANTS = ("uniform", "pooled-values", "pooled", "sequential", "sequential-pooled", "output", "sequential-output")
SITES = ("decoder-self", "cross")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--model", "--train-data", "--eval-data"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--output-dir", default="whisper-study")
    parser.add_argument("--language", default="en")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--calibration-clips", type=int, default=64)
    parser.add_argument("--eval-clips", type=int, default=40)
    parser.add_argument("--batch-eval", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--output-blend",
        type=float,
        default=OUTPUT_BLEND,
        help="λ of the output variants (uptrain convert --value-fit-blend)",
    )
    args = parser.parse_args(argv)
    args.quick = False
    return args


class Moments:
    """One attention module's moments over the calibration batches."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, rows: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Σ w x xᵀ over rows [n, D+1] (weights [n], default 1)."""
        w = torch.ones(len(rows), dtype=rows.dtype) if weights is None else weights.to(rows.dtype)
        s = (rows * w[:, None]).mT @ rows
        self.sums[name] = self.sums.get(name, 0) + s
        self.weights[name] = self.weights.get(name, 0.0) + float(w.sum())

    def get(self, name: str) -> torch.Tensor:
        return self.sums[name] / self.weights[name]


def hook(module, site: str, moments: Moments, state: dict):
    """A forward pre-hook folding the module's K/V input moment (uniform and attention-weighted),
    its queries' input moment and the attention-pooled inputs' moment, padding left out."""

    def fold(mod, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        kv = kwargs.get("key_value_states")
        kv = hidden if kv is None else kv
        valid = state["valid"]  # [b, t_dec] target positions that are not padding
        b, tq, _ = hidden.shape
        h, d = mod.num_heads, mod.head_dim
        q = (mod.q_proj(hidden) * mod.scaling).view(b, tq, h, d).transpose(1, 2)
        k = mod.k_proj(kv).view(b, kv.shape[1], h, d).transpose(1, 2)
        scores = (q @ k.mT).float()
        if site == "decoder-self":
            causal = torch.ones(tq, tq, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        p = scores.softmax(-1).to(torch.float64)  # [b, h, tq, tk]
        x = augmented_inputs(kv)  # [b, tk, D+1]
        xq = augmented_inputs(hidden)
        for i in range(b):
            rows_q = valid[i]
            keys_valid = rows_q if site == "decoder-self" else torch.ones(kv.shape[1], dtype=torch.bool)
            moments.add("uniform", x[i][keys_valid])
            moments.add("queries", xq[i][rows_q])
            pi = p[i][:, rows_q]  # [h, n_q, tk]
            pooled = pi @ x[i]  # [h, n_q, D+1]
            moments.add("pooled", pooled.reshape(-1, pooled.shape[-1]))
            moments.add("received", x[i], pi.sum((0, 1)))

    return module.register_forward_pre_hook(fold, with_kwargs=True)


def attention_module(model, site: str, layer: int):
    decoder = model.model.decoder.layers[layer]
    return decoder.self_attn if site == "decoder-self" else decoder.encoder_attn


def collect(model, targets: list[tuple[str, int]], batches, encoded) -> dict:
    """Moments of each (site, layer) in `targets`, from one pass of the decoder over the batches."""
    found = {t: Moments() for t in targets}
    state: dict = {}
    handles = [hook(attention_module(model, s, layer), s, found[(s, layer)], state) for s, layer in targets]
    try:
        with torch.inference_mode():
            for batch, outputs in zip(batches, encoded):
                state["valid"] = batch["labels"] != -100
                model(encoder_outputs=outputs, labels=batch["labels"], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def merge(module, g: int, moments: Moments, variant: str) -> None:
    """Merge one Whisper attention module to `g` KV heads in place (the shared heads repeated)."""
    write(module, g, solve_merge(module, g, moments, variant)[1])


def solve_merge(module, g: int, moments: Moments, variant: str):
    """(the module's weights, its calibrated merge to `g` KV heads from `moments`) as LayerAttention."""
    from uptrain.convert.calibrated import apply_calibrated

    layer, solution = solve(module, g, moments, variant)
    return layer, apply_calibrated(layer, g, solution)


def solve(module, g: int, moments: Moments, variant: str):
    """(the module's weights as LayerAttention, its calibrated merge's solution to `g` KV heads from `moments`)."""
    from uptrain.convert.calibrated import (
        CalibratedSolution,
        LayerAttention,
        regularised,
        solve_keys,
        solve_values,
    )

    h, d = module.num_heads, module.head_dim

    def f64(t):
        return None if t is None else t.detach().to(torch.float64)

    layer = LayerAttention(
        q_w=f64(module.q_proj.weight),
        k_w=f64(module.k_proj.weight),
        v_w=f64(module.v_proj.weight),
        o_w=f64(module.out_proj.weight),
        q_b=f64(module.q_proj.bias),
        k_b=None,
        v_b=f64(module.v_proj.bias),
        num_heads=h,
        num_kv_heads=h,
        head_dim=d,
        rotary_dim=0,
    )
    pooled = variant.endswith("pooled") or variant == "pooled-values"
    c_values = regularised(moments.get("pooled" if pooled else "uniform"))
    keys_from = "received" if variant in ("pooled", "sequential-pooled") else "uniform"
    c_keys, c_query = regularised(moments.get(keys_from)), regularised(moments.get("queries"))
    return layer, CalibratedSolution(*solve_values(layer, g, c_values), *solve_keys(layer, g, c_keys, c_query))


def repeated(w: torch.Tensor, g: int, h: int) -> torch.Tensor:
    """[g·d, …] → [h·d, …]: each shared head for its h/g query heads."""
    d = w.shape[0] // g
    return w.view(g, d, *w.shape[1:]).repeat_interleave(h // g, 0).reshape(h * d, *w.shape[1:])


def write(module, g: int, merged) -> None:
    """Put a merged LayerAttention into the (MHA-shaped) module, the shared K/V heads repeated."""
    h = module.num_heads

    with torch.no_grad():
        module.q_proj.weight.copy_(merged.q_w)
        module.q_proj.bias.copy_(merged.q_b)
        module.k_proj.weight.copy_(repeated(merged.k_w, g, h))
        module.v_proj.weight.copy_(repeated(merged.v_w, g, h))
        module.v_proj.bias.copy_(repeated(merged.v_b, g, h))
        module.out_proj.weight.copy_(merged.o_w)


OUTPUT_BLEND = DEFAULT_VALUE_FIT_BLEND  # λ of the output variants: `uptrain convert --value-fit-blend`'s default


def collect_outputs(model, targets: dict, batches, encoded, reference: dict | None = None) -> dict:
    """uptrain's `OutputMoments` (`--value-fit output`'s second pass, `value_refit.fold_example`) of
    each target in `targets` (target → `RefitTarget`: the merged queries and keys make p'), over
    one pass of `model`: z' from the model's own states; z from the same states with the source
    weights, or from `reference[target][batch]` where given (the MHA model's inputs of the module,
    `reference_inputs`)."""
    from uptrain.convert.value_refit import OutputMoments, fold_example

    found = {t: OutputMoments() for t in targets}
    state: dict = {}

    def hook(target):
        site = target[0]

        def fold(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            kv = kwargs.get("key_value_states")
            kv = hidden if kv is None else kv
            valid = state["valid"]
            for i in range(len(valid)):
                given = reference[target][state["batch"]] if reference else None
                fold_example(
                    targets[target],
                    found[target],
                    hidden[i],
                    kv[i],
                    mod.scaling,
                    valid[i],
                    causal=site == "decoder-self",
                    reference=None if given is None else (given[0][i], given[1][i]),
                )

        return attention_module(model, *target).register_forward_pre_hook(fold, with_kwargs=True)

    handles = [hook(t) for t in targets]
    try:
        with torch.inference_mode():
            for n, (batch, outputs) in enumerate(zip(batches, encoded)):
                state["valid"], state["batch"] = batch["labels"] != -100, n
                model(encoder_outputs=outputs, labels=batch["labels"], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def reference_inputs(source, target, batches, encoded) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What one target module reads in the MHA model, (hidden, kv) per batch."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fold(mod, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        kv = kwargs.get("key_value_states")
        kept.append((hidden, hidden if kv is None else kv))

    handle = attention_module(source, *target).register_forward_pre_hook(fold, with_kwargs=True)
    try:
        with torch.inference_mode():
            for batch, outputs in zip(batches, encoded):
                source(encoder_outputs=outputs, labels=batch["labels"], use_cache=False)
    finally:
        handle.remove()
    return kept


def refit(model, targets, solved, moments, outputs, g: int, blend: float) -> None:
    """Write each target's merge with its values refit (`value_refit.refit_solution`) into `model`."""
    from uptrain.convert.calibrated import apply_calibrated
    from uptrain.convert.value_refit import refit_solution

    for t in targets:
        layer, solution = solved[t]
        fitted = refit_solution(layer, g, solution, outputs[t], moments[t].get("uniform"), blend)
        write(attention_module(model, *t), g, apply_calibrated(layer, g, fitted))


def output_model(source, g: int, batches, encoded, sequential: bool, blend: float):
    """A copy of the MHA model merged with `uniform`'s keys and values refitted to the attention
    output (uptrain's `--value-fit output`, `value_refit.py`): all at once from the MHA model's
    states, or layer by layer in order."""
    import copy

    from uptrain.convert.calibrated import apply_calibrated
    from uptrain.convert.value_refit import RefitTarget

    model = copy.deepcopy(source)
    layers = len(model.model.decoder.layers)
    targets = [(s, layer) for layer in range(layers) for s in SITES]
    groups = [targets] if not sequential else [[t] for t in targets]
    for chosen in groups:  # all at once, or each on the model merged so far
        found = collect(model, chosen, batches, encoded)
        solved = {t: solve(attention_module(model, *t), g, found[t], "uniform") for t in chosen}
        refits = {t: RefitTarget(layer, apply_calibrated(layer, g, sol), g) for t, (layer, sol) in solved.items()}
        reference = {t: reference_inputs(source, t, batches, encoded) for t in chosen} if sequential else None
        outputs = collect_outputs(model, refits, batches, encoded, reference)
        refit(model, chosen, solved, found, outputs, g, blend)
    return model


def variant_model(source, g: int, variant: str, batches, encoded, blend: float = OUTPUT_BLEND):
    """A copy of the MHA model with decoder self- and cross-attention merged as `variant` says."""
    import copy

    if variant.endswith("output"):
        return output_model(source, g, batches, encoded, variant.startswith("sequential"), blend)
    model = copy.deepcopy(source)
    layers = len(model.model.decoder.layers)
    targets = [(s, layer) for layer in range(layers) for s in SITES]
    if not variant.startswith("sequential"):
        found = collect(model, targets, batches, encoded)  # every moment from the MHA model
        for target in targets:
            merge(attention_module(model, *target), g, found[target], variant)
        return model
    for target in targets:  # in order: each on the model merged so far
        found = collect(model, [target], batches, encoded)
        merge(attention_module(model, *target), g, found[target], variant)
    return model


def loops(scored: dict) -> int:
    """How many predictions run on: more than 1.5× their reference's words (greedy decoding looping)."""
    pairs = scored["predictions"]
    norm = whisper_study.normalise
    return sum(len(norm(p["prediction"]).split()) > 1.5 * len(norm(p["reference"]).split()) for p in pairs)


def main(argv=None) -> None:
    from uptrain.architecture import architecture
    from uptrain.convert.calibration_seq2seq import calibration_batches
    from uptrain.convert.spec import CalibrationSettings
    from uptrain.model_info import read_config
    from uptrain.objectives.prompts import PromptKeys
    from uptrain.speed import load_model

    args = parse_args(argv)
    from uptrain.evaluation.scores import require
    from uptrain.evaluation.tasks import TASKS

    # Every variant is scored with jiwer: refuse now, not after the calibration clips are encoded.
    asr = TASKS["asr"]
    require(asr.module, asr.package, "whisper_merge_variants.py's WER and CER (as uptrain evaluate --task asr)")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    root = Path(args.output_dir).absolute() / "variants"
    arch = architecture(read_config(args.model).get("model_type"))
    settings = CalibrationSettings(calibration_tokens=args.calibration_clips * 256, calibration_seq_len=256)
    keys = PromptKeys(language=args.language, speech_task="transcribe")
    batches, info = calibration_batches(Path(args.model), arch, args.train_data, settings, 4, keys)
    source = load_model(args.model, "float32", "cpu")
    began = time.perf_counter()
    with torch.inference_mode():
        encoded = [source.get_encoder()(b["input_features"]) for b in batches]
    log(f"[variants] encoded {info['examples']} calibration clips in {time.perf_counter() - began:.0f} s")
    scorer = whisper_study.Scorer(args, log)
    mha = scorer.stored_or_scored(root / "mha.json", lambda: source)
    results = {"mha": {**{k: mha[k] for k in ("wer", "cer", "perplexity", "wall_s")}, "loops": loops(mha)}}
    for g in args.kv_heads:
        for variant in args.variants:
            name = f"g{g}-{variant}" + (f"-blend{args.output_blend:g}" if variant.endswith("output") else "")
            began = time.perf_counter()
            scored = scorer.stored_or_scored(
                root / f"{name}.json",
                lambda g=g, v=variant: variant_model(source, g, v, batches, encoded, args.output_blend),
            )
            results[name] = {**{k: scored[k] for k in ("wer", "cer", "perplexity", "wall_s")}, "loops": loops(scored)}
            log(f"[variants] {name}: {results[name]} ({time.perf_counter() - began:.0f} s)")
    print(json.dumps({k: {m: v[m] for m in ("wer", "cer", "perplexity", "loops")} for k, v in results.items()}))


if __name__ == "__main__":
    from uptrain import UptrainError

    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")
