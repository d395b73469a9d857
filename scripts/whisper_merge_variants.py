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
  reads it: with the merged keys in place each head's attention moves (p' for MHA's p), and the
  shared V'_g and each head's map M_h (folded into its o_proj columns) minimise
  Σ_{h∈g} E‖O_h (M_h V'_g z'_h − V_h z_h)‖², z'_h = Σ_t p'_{h,t} x̃_t, z_h = Σ_t p_{h,t} x̃_t (x̃: the
  inputs with a constant 1, so the bias is refitted too), from the moments E[z' z'ᵀ] and E[z z'ᵀ]
  per head on the MHA model's states (`refit_values`: V'_g kept in the span of the group's source
  value heads, and blended by λ = `--output-blend` with uptrain's value objective over every position);
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
        "--output-blend", type=float, default=OUTPUT_BLEND, help="λ of the output variants (refit_values)"
    )
    args = parser.parse_args(argv)
    args.quick = False
    return args


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[n, D] → [n, D+1] float64 with the constant 1 (biases ride along)."""
    x = x.to(torch.float64)
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)


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
        x = _rows(kv)  # [b, tk, D+1]
        xq = _rows(hidden)
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
    from uptrain.convert.calibrated import (
        CalibratedSolution,
        LayerAttention,
        apply_calibrated,
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
    solution = CalibratedSolution(*solve_values(layer, g, c_values), *solve_keys(layer, g, c_keys, c_query))
    return layer, apply_calibrated(layer, g, solution)


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


OUTPUT_BLEND = 0.1  # λ of `refit_values`


class OutputMoments:
    """Per query head h of one attention: Σ z'_h z'_hᵀ and Σ z_h z'_hᵀ over the kept queries, where
    z' pools the inputs with the merged keys' attention and z with MHA's."""

    def __init__(self):
        self.merged: torch.Tensor | float = 0.0  # [h, D+1, D+1]
        self.cross: torch.Tensor | float = 0.0
        self.count = 0

    def add(self, pooled_merged: torch.Tensor, pooled: torch.Tensor) -> None:
        """Rows [h, n, D+1] of z' and z."""
        self.merged = self.merged + pooled_merged.mT @ pooled_merged
        self.cross = self.cross + pooled.mT @ pooled_merged
        self.count += pooled.shape[1]


def _probabilities(site: str, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ) [b, h, tq, tk] in float64 (q scaled already; decoder self-attention causal)."""
    scores = (q @ k.mT).to(torch.float64)
    if site == "decoder-self":
        tq = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(tq, tq, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1)


def pooled_inputs(mod, site: str, hidden, kv, q_w=None, q_b=None, k_w=None) -> torch.Tensor:
    """Each head's attention-pooled inputs Σ_t p_t x̃_t [b, h, tq, D+1], the attention from the
    module's own queries and keys or, given, from `q_w`, `q_b`, `k_w` (float64, MHA-shaped)."""
    b, tq, _ = hidden.shape
    h, d = mod.num_heads, mod.head_dim
    if q_w is None:
        q = mod.q_proj(hidden).to(torch.float64) * mod.scaling
        k = mod.k_proj(kv).to(torch.float64)
    else:
        q = (hidden.to(torch.float64) @ q_w.mT + q_b) * mod.scaling
        k = kv.to(torch.float64) @ k_w.mT
    q = q.view(b, tq, h, d).transpose(1, 2)
    k = k.view(b, kv.shape[1], h, d).transpose(1, 2)
    return _probabilities(site, q, k) @ _rows(kv)[:, None]


def collect_outputs(model, merged: dict, batches, encoded, reference: dict | None = None) -> dict:
    """OutputMoments of each target in `merged` (target → the merged LayerAttention whose queries
    and keys make p'), over one pass of `model`: z' from the model's own states; z from the same
    states with the module's own (MHA) weights, or `reference[target][batch]` where given (the MHA
    model's z, `reference_pooled`)."""
    found = {t: OutputMoments() for t in merged}
    state: dict = {}

    def hook(target):
        site = target[0]
        m = merged[target]
        module = attention_module(model, *target)
        g, h = m.num_kv_heads, m.num_heads
        k_w = repeated(m.k_w, g, h)

        def fold(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            kv = kwargs.get("key_value_states")
            kv = hidden if kv is None else kv
            z_merged = pooled_inputs(mod, site, hidden, kv, m.q_w, m.q_b, k_w)
            z = reference[target][state["batch"]] if reference else pooled_inputs(mod, site, hidden, kv)
            valid = state["valid"]
            for i in range(len(valid)):
                found[target].add(z_merged[i][:, valid[i]], z[i][:, valid[i]])

        return module.register_forward_pre_hook(fold, with_kwargs=True)

    handles = [hook(t) for t in merged]
    try:
        with torch.inference_mode():
            for n, (batch, outputs) in enumerate(zip(batches, encoded)):
                state["valid"], state["batch"] = batch["labels"] != -100, n
                model(encoder_outputs=outputs, labels=batch["labels"], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def reference_pooled(source, target, batches, encoded) -> list[torch.Tensor]:
    """The MHA model's attention-pooled inputs z of one target, per batch."""
    site = target[0]
    kept: list[torch.Tensor] = []

    def fold(mod, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        kv = kwargs.get("key_value_states")
        kept.append(pooled_inputs(mod, site, hidden, hidden if kv is None else kv))

    handle = attention_module(source, *target).register_forward_pre_hook(fold, with_kwargs=True)
    try:
        with torch.inference_mode():
            for batch, outputs in zip(batches, encoded):
                source(encoder_outputs=outputs, labels=batch["labels"], use_cache=False)
    finally:
        handle.remove()
    return kept


def refit_values(layer, merged, g: int, found: OutputMoments, c_inputs: torch.Tensor, blend: float):
    """`merged` with its values refitted to the attention output (the `output` variant): per group
    the shared V'_g (d × (D+1), the bias its last column) and per head h the map M_h folded into
    O_h minimising Σ_h E‖O_h (M_h V' z'_h − V_h z_h)‖². Given V', M_h = V_h X_h V'ᵀ (V' C'_h V'ᵀ)⁻¹
    (X_h = E[z z'ᵀ], C'_h = E[z' z'ᵀ]). V' is kept in the span of the group's source value heads
    (a = √(O_hᵀ O_h) V_h stacked, as uptrain's value merge: the merged values read only what the
    source values read; unconstrained, the fit leans on directions the pooled inputs barely
    visit and blows up on held-out speech): V' = Lᵀ a with L the top-d generalized eigenvectors
    of a (Σ_h X_hᵀ V_hᵀ O_hᵀ O_h V_h X_h) aᵀ against a C'_g aᵀ, C'_g the group's C' (heads
    averaged: where every head's C'_h is that average this is the exact optimum in the span; with
    p' = p and one input moment it is uptrain's value merge).

    `blend` λ adds λ·Σ_h E‖O_h (M_h V' x − V_h x)‖² over every position x (`c_inputs`: C = E[x xᵀ],
    uptrain's value objective): X_h + λC for X_h and C'_h + λC for C'_h. The pooled inputs of a
    few dozen clips leave directions barely visited, where the fit alone puts large weights that
    held-out speech then reads; λ → ∞ is uptrain's value merge."""
    from dataclasses import replace

    from uptrain.convert.calibrated import _augment, _psd_sqrt, _split, _value_inputs, regularised

    h, d = layer.num_heads, layer.head_dim
    if layer.num_kv_heads != h:
        raise ValueError("refit_values merges MHA modules")
    r = h // g
    c_merged = found.merged / found.count + blend * c_inputs
    cross = found.cross / found.count + blend * c_inputs
    v_aug = _augment(layer.v_w, layer.v_b)
    o_w, shared = merged.o_w.clone(), []
    for j in range(g):
        heads = range(j * r, (j + 1) * r)
        a = _value_inputs(layer, v_aug, j, r)  # [r·d, D+1]
        c_group = regularised(a @ (sum(c_merged[s] for s in heads) / r) @ a.mT)
        target = 0.0
        for s in heads:
            o = layer.o_w[:, s * d : (s + 1) * d]
            read = _psd_sqrt(o.mT @ o) @ v_aug[s * d : (s + 1) * d] @ cross[s] @ a.mT  # [d, r·d]
            target = target + read.mT @ read
        lower = torch.linalg.cholesky(c_group)
        whiten = torch.linalg.solve_triangular(lower, torch.eye(len(lower), dtype=lower.dtype), upper=False)
        vals, vecs = torch.linalg.eigh(whiten @ target @ whiten.mT)
        w = (whiten.mT @ vecs[:, -d:].flip(1)).mT @ a  # [d, D+1], w C'_g wᵀ = I
        shared.append(w)
        for s in heads:
            own = regularised(w @ c_merged[s] @ w.mT)
            head_map = torch.linalg.solve(own, (v_aug[s * d : (s + 1) * d] @ cross[s] @ w.mT).mT).mT
            o_w[:, s * d : (s + 1) * d] = layer.o_w[:, s * d : (s + 1) * d] @ head_map
    v_w, v_b = _split(torch.cat(shared), layer.v_b is not None)
    return replace(merged, v_w=v_w, v_b=v_b, o_w=o_w)


def output_model(source, g: int, batches, encoded, sequential: bool, blend: float):
    """A copy of the MHA model merged with `uniform`'s keys and values refitted to the attention
    output (`refit_values`): all at once from the MHA model's states, or layer by layer in order."""
    import copy

    model = copy.deepcopy(source)
    layers = len(model.model.decoder.layers)
    targets = [(s, layer) for layer in range(layers) for s in SITES]
    if not sequential:
        found = collect(model, targets, batches, encoded)
        solved = {t: solve_merge(attention_module(model, *t), g, found[t], "uniform") for t in targets}
        outputs = collect_outputs(model, {t: m for t, (_, m) in solved.items()}, batches, encoded)
        for t, (layer, m) in solved.items():
            write(attention_module(model, *t), g, refit_values(layer, m, g, outputs[t], found[t].get("uniform"), blend))
        return model
    for t in targets:
        found = collect(model, [t], batches, encoded)[t]
        layer, m = solve_merge(attention_module(model, *t), g, found, "uniform")
        reference = {t: reference_pooled(source, t, batches, encoded)}
        outputs = collect_outputs(model, {t: m}, batches, encoded, reference)
        write(attention_module(model, *t), g, refit_values(layer, m, g, outputs[t], found.get("uniform"), blend))
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
