"""`--allocation calibrated`: each layer's merge loss in closed form, and the exact knapsack over layers."""

from __future__ import annotations

import functools
import itertools
import json
import math
from contextlib import closing
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.convert.test_calibrated import build, save
from tests.convert.test_calibrated_encoder_decoder import ALL, calibration_batches, relate_heads_exactly
from tests.convert.test_calibrated_encoder_decoder import build as build_seq2seq
from uptrain import UptrainError
from uptrain.architecture import architecture
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.convert.allocation import (
    allocate,
    calibration_costs,
    choose_allocation,
    layer_losses,
)
from uptrain.convert.calibrated import (
    CrossMoments,
    LayerAttention,
    _augment,
    _rotary_pairs,
    _shared_vector,
    apply_calibrated,
    merge_loss,
    pooled_loss,
    regularised,
    solve_calibrated,
)
from uptrain.convert.calibration import collect_attention_moments
from uptrain.convert.calibration_seq2seq import seq2seq_moments
from uptrain.convert.conversion import conversion_for
from uptrain.convert.kv_heads import KVHeadsRequest, head_weights, kv_fraction, resolve_allocation
from uptrain.convert.pooling import PoolingContext, get_strategy
from uptrain.convert.spec import CalibrationSettings
from uptrain.model_info import AttentionGeometry, divisors, read_config

# ---------------------------------------------------------------- the merge loss, in closed form


def random_layer(rotary_dim: int, seed: int = 0, kv: int = 4, n_rep: int = 2, d: int = 4, hidden: int = 12):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    h = kv * n_rep
    return LayerAttention(
        q_w=rand(h * d, hidden),
        k_w=rand(kv * d, hidden),
        v_w=rand(kv * d, hidden),
        o_w=rand(hidden, h * d),
        q_b=rand(h * d),
        k_b=rand(kv * d),
        v_b=None,
        num_heads=h,
        num_kv_heads=kv,
        head_dim=d,
        rotary_dim=rotary_dim,
    )


def random_moment(hidden: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(200, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    x = torch.cat([x @ mix, torch.ones(200, 1, dtype=torch.float64)], 1)  # correlated inputs, a constant 1
    return x.mT @ x / len(x)


def value_error(source: LayerAttention, merged: LayerAttention, c: torch.Tensor) -> float:
    """Σ_q E‖O'_q V'_j x̃ − O_q V_s x̃‖²: each query head's value path through o_proj, merged vs source."""
    d, n_rep = source.head_dim, source.n_rep
    v, v2 = _augment(source.v_w, source.v_b), _augment(merged.v_w, merged.v_b)
    r = source.num_kv_heads // merged.num_kv_heads
    total = 0.0
    for q in range(source.num_heads):
        s, j = q // n_rep, q // (n_rep * r)
        delta = merged.o_w[:, q * d : (q + 1) * d] @ v2[j * d : (j + 1) * d] - (
            source.o_w[:, q * d : (q + 1) * d] @ v[s * d : (s + 1) * d]
        )
        total += float(torch.trace(delta @ c @ delta.mT))
    return total


def logit_error(
    source: LayerAttention, merged: LayerAttention, c: torch.Tensor, c_query: torch.Tensor | None = None
) -> float:
    """Σ_q E[(q'_qᵀ k'_j − q_qᵀ k_s)²] with the query's and the key's inputs independent, of moments
    C_query (default C) and C: the score as a bilinear form B_q of (query input, key input),
    E = tr(B_qᵀ C_query B_q C)."""
    c_query = c if c_query is None else c_query
    d, n_rep = source.head_dim, source.n_rep
    q1, k1 = _augment(source.q_w, source.q_b), _augment(source.k_w, source.k_b)
    q2, k2 = _augment(merged.q_w, merged.q_b), _augment(merged.k_w, merged.k_b)
    r = source.num_kv_heads // merged.num_kv_heads
    total = 0.0
    for q in range(source.num_heads):
        s, j = q // n_rep, q // (n_rep * r)
        rows = slice(q * d, (q + 1) * d)
        b = q2[rows].mT @ k2[j * d : (j + 1) * d] - q1[rows].mT @ k1[s * d : (s + 1) * d]
        total += float(torch.trace(b.mT @ c_query @ b @ c))
    return total


@pytest.mark.parametrize("groups", [1, 2])
def test_merge_loss_is_the_error_the_applied_merge_leaves(groups):
    """Without rotary dims both halves are errors of the merged weights themselves, computed here
    from what `apply_calibrated` wrote, not from the solver's eigenvalues."""
    layer = random_layer(rotary_dim=0)
    c = random_moment(12)
    merged = apply_calibrated(layer, groups, solve_calibrated(layer, groups, c))
    loss = merge_loss(layer, groups, c)
    reg = regularised(c)  # the merge is solved, and its loss counted, under the ridged C
    assert loss.values == pytest.approx(value_error(layer, merged, reg), rel=1e-6)
    assert loss.keys == pytest.approx(logit_error(layer, merged, reg), rel=1e-6)
    d = layer.head_dim
    v = _augment(layer.v_w, layer.v_b)
    paths = [layer.o_w[:, q * d : (q + 1) * d] @ v[q // layer.n_rep * d : (q // layer.n_rep + 1) * d] for q in range(8)]
    assert loss.values_energy == pytest.approx(sum(float(torch.trace(p @ reg @ p.mT)) for p in paths), rel=1e-9)
    assert 0 < loss.values < loss.values_energy and 0 < loss.keys < loss.keys_energy


@pytest.mark.parametrize("groups", [1, 2])
def test_rotary_key_loss_is_the_rank_one_fit_of_the_solution(groups):
    """On rotary pairs the merge fits each group's keys by complex scales of one shared key: the
    loss is Σ_s α_s ‖u_s − σ_s v‖²_C at the solved σ and v."""
    layer = random_layer(rotary_dim=4)  # every dim rotates
    c = random_moment(12)
    solution = solve_calibrated(layer, groups, c)
    reg = regularised(c)
    d, kv, r = layer.head_dim, layer.num_kv_heads, layer.num_kv_heads // groups
    k_aug = _augment(layer.k_w, layer.k_b).view(kv, d, -1)
    real, imag = torch.arange(2), torch.arange(2, 4)
    total = 0.0
    for j in range(groups):
        sources = list(range(j * r, (j + 1) * r))
        u = _rotary_pairs(k_aug[sources], real, imag)  # [pairs, r, D+1]
        solved = solution.key_rotary[j]
        v = _shared_vector(u, solved)
        delta = u - solved.sigma[..., None] * v[:, None, :]
        total += float(
            (solved.alpha * torch.einsum("prx,xy,pry->pr", delta.conj(), reg.to(delta.dtype), delta).real).sum()
        )
    assert merge_loss(layer, groups, c).keys == pytest.approx(total, rel=1e-6)


def test_no_merge_loses_nothing_and_wider_groups_lose_more():
    layer = random_layer(rotary_dim=2, kv=8, n_rep=1)
    losses = layer_losses(layer, random_moment(12))
    assert list(losses) == [1, 2, 4, 8]
    assert losses[8].values == 0 and losses[8].keys == 0  # G = kv: every group one head
    for fewer, more in [(1, 2), (2, 4), (4, 8)]:  # nested groups: a coarser merge fits no better
        assert losses[fewer].values >= losses[more].values and losses[fewer].keys >= losses[more].keys
        assert losses[fewer].values_energy == pytest.approx(losses[more].values_energy)


# ---------------------------------------------------------------- a row pooling's cost


def field_context(field: str) -> PoolingContext:
    return PoolingContext("bias" if field.endswith("_b") else "weight", field, 0, 0.02)


def pooled_layer(layer: LayerAttention, pooling: str, groups: int) -> LayerAttention:
    return get_strategy(pooling).pool_layer(layer, groups, None, field_context)


@pytest.mark.parametrize("pooling", ["mean", "first", "random"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_a_pooling_costs_the_error_its_pooled_heads_leave(pooling, groups):
    """Without rotary dims, `pooled_loss` is the pooled weights' own error in the merge's terms,
    computed here from the pooled layer (its Q and O the source's: no maps) under cross-attention's
    three moments, each where the merge reads it; its energies are the merge's, so shares compare."""
    layer = random_layer(rotary_dim=0)
    c, c_query, c_values = random_moment(12), random_moment(12, seed=5), random_moment(12, seed=9)
    out = pooled_layer(layer, pooling, groups)
    loss = pooled_loss(layer, out, c, c_query, c_values)
    assert loss.values == pytest.approx(value_error(layer, out, regularised(c_values)), rel=1e-9)
    assert loss.keys == pytest.approx(logit_error(layer, out, regularised(c), regularised(c_query)), rel=1e-9)
    merged = merge_loss(layer, groups, c, c_query, c_values)
    assert (loss.values_energy, loss.keys_energy) == pytest.approx((merged.values_energy, merged.keys_energy), rel=1e-9)
    assert loss.values > 0 and loss.keys > 0 or (pooling != "random" and groups == 4)


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_a_pooling_costs_its_rotary_keys_as_the_merge_weighs_them(pooling):
    """Every dim rotates: each pair (i, i + 2) of each source head s costs its queries' energy
    Σ_{q→s} E[q_i² + q_{i+2}²] times its pooled key's error ‖Δk_i‖²_C + ‖Δk_{i+2}‖²_C (`merge_loss`'s
    rank-one fit, at σ = 1 and the pooled key)."""
    layer = random_layer(rotary_dim=4)
    c, c_query = random_moment(12), random_moment(12, seed=5)
    out = pooled_layer(layer, pooling, 2)
    reg, reg_q = regularised(c), regularised(c_query)
    d, r = layer.head_dim, 2
    k, pooled_k, q = _augment(layer.k_w, layer.k_b), _augment(out.k_w, out.k_b), _augment(layer.q_w, layer.q_b)
    total = 0.0
    for head in range(layer.num_heads):
        s = head // layer.n_rep
        delta = pooled_k[s // r * d : (s // r + 1) * d] - k[s * d : (s + 1) * d]
        for pair in ((0, 2), (1, 3)):
            energy = sum(float(q[head * d + i] @ reg_q @ q[head * d + i]) for i in pair)
            total += energy * sum(float(delta[i] @ reg @ delta[i]) for i in pair)
    assert pooled_loss(layer, out, c, c_query).keys == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("rotary_dim", [0, 2, 4])
def test_heads_identical_within_groups_cost_mean_and_first_nothing_at_that_g(rotary_dim):
    """K and V heads (and K biases) identical in pairs: pooling them to 2 heads, by mean or first,
    changes nothing the layer computes, and its cost there is exactly 0; at 1 head it is not."""
    layer = random_layer(rotary_dim, kv=4)
    d = layer.head_dim
    for t in (layer.k_w, layer.v_w, layer.k_b):
        heads = t.view(4, d, -1)
        heads[1::2] = heads[0::2].clone()
    for pooling in ("mean", "first"):
        losses = layer_losses(layer, random_moment(12), pooling=get_strategy(pooling), context=field_context)
        assert [(losses[g].values, losses[g].keys) for g in (2, 4)] == [(0.0, 0.0)] * 2
        assert losses[1].values > 1e-3 * losses[1].values_energy and losses[1].keys > 1e-3 * losses[1].keys_energy


@pytest.mark.parametrize("rotary_dim", [0, 2, 4])
def test_the_calibrated_merge_never_loses_more_than_a_pooling(rotary_dim):
    """The merge minimises the same two errors over a family that holds every row pooling (shared
    heads, maps M_s = I, scales σ_s = 1): at every G its loss is at most each pooling's."""
    for seed in range(3):
        layer = random_layer(rotary_dim, seed=seed, kv=8, n_rep=1)
        moment = CrossMoments(random_moment(12, seed), random_moment(12, seed + 10), random_moment(12, seed + 20))
        merged = layer_losses(layer, moment)
        for pooling in ("mean", "first", "random"):
            pooled = layer_losses(layer, moment, pooling=get_strategy(pooling), context=field_context)
            for g, loss in merged.items():
                assert loss.values <= pooled[g].values + 1e-9 * loss.values_energy, (pooling, g)
                assert loss.keys <= pooled[g].keys + 1e-9 * loss.keys_energy, (pooling, g)


# ---------------------------------------------------------------- the knapsack


def brute_force(costs, head_dims, budget):
    """Every allocation, the least by (summed cost, KV units, heads in order), summed as the DP sums."""
    layers = [(name, options) for name in costs for options in costs[name]]
    best = None
    for heads in itertools.product(*(sorted(options) for _, options in layers)):
        units = sum(g * head_dims[name] for g, (name, _) in zip(heads, layers))
        if units > budget:
            continue
        cost = 0.0
        for g, (_, options) in reversed(list(zip(heads, layers))):
            cost = options[g] + cost
        if best is None or (cost, units, heads) < best:
            best = (cost, units, heads)
    return best


@st.composite
def instances(draw, integer_costs: bool):
    attentions = draw(st.integers(1, 2))
    names = ["encoder", "decoder-self"][:attentions]
    dims = {name: draw(st.sampled_from([16, 32, 48, 64])) for name in names}
    costs = {}
    for name in names:
        layers = draw(st.integers(1, 5 if attentions == 1 else 3))
        costs[name] = []
        for _ in range(layers):
            kv = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
            value = st.integers(0, 6).map(float) if integer_costs else st.floats(0, 10, allow_nan=False)
            costs[name].append({g: draw(value) for g in divisors(kv)})
    smallest = sum(min(o) * dims[n] for n in names for o in costs[n])
    largest = sum(max(o) * dims[n] for n in names for o in costs[n])
    budget = draw(st.integers(smallest, largest + 16))
    return costs, dims, budget


@settings(max_examples=300, deadline=None)
@given(instances(integer_costs=True))
def test_knapsack_equals_brute_force_ties_included(instance):
    """Integer costs tie often: the tie-break (smaller cache, then fewer heads earliest) is exact."""
    costs, dims, budget = instance
    chosen = choose_allocation(costs, dims, budget)
    _, _, heads = brute_force(costs, dims, budget)
    assert tuple(g for name in costs for g in chosen[name]) == heads
    assert [len(chosen[name]) for name in costs] == [len(costs[name]) for name in costs]


@settings(max_examples=200, deadline=None)
@given(instances(integer_costs=False))
def test_knapsack_reaches_the_least_cost(instance):
    costs, dims, budget = instance
    chosen = choose_allocation(costs, dims, budget)
    least, _, _ = brute_force(costs, dims, budget)
    assert sum(costs[n][i][g] for n in costs for i, g in enumerate(chosen[n])) == pytest.approx(least, abs=1e-9)
    assert sum(g * dims[n] for n in costs for g in chosen[n]) <= budget


@pytest.mark.parametrize("layers,kv,groups", [(6, 8, 2), (4, 8, 4), (3, 12, 3), (5, 6, 1), (2, 4, 4)])
def test_one_convex_cost_for_every_layer_gives_the_uniform_allocation(layers, kv, groups):
    """The same strictly convex, decreasing cost in every layer: at a budget of exactly kv/G no
    uneven allocation can do better (Jensen), so the knapsack must return uniform G."""
    costs = {"decoder-self": [{g: 3.0 / g + 0.1 * layer for g in divisors(kv)} for layer in range(layers)]}
    chosen = allocate(costs, {"decoder-self": (kv,) * layers}, {"decoder-self": 32}, groups / kv)
    assert chosen == {"decoder-self": (groups,) * layers}


def test_a_budget_below_one_head_per_layer_is_refused_in_one_line():
    costs = {"decoder-self": [{g: 1.0 / g for g in (1, 2, 4, 8)}] * 6}
    with pytest.raises(UptrainError) as err:
        allocate(costs, {"decoder-self": (8,) * 6}, {"decoder-self": 32}, 0.1)
    assert "\n" not in str(err.value) and "0.125" in str(err.value) and "--kv-budget 0.1" in str(err.value)
    assert allocate(costs, {"decoder-self": (8,) * 6}, {"decoder-self": 32}, 0.125) == {"decoder-self": (1,) * 6}
    with pytest.raises(UptrainError, match="below the smallest allocation"):
        choose_allocation(costs, {"decoder-self": 32}, 6 * 32 - 1)


def test_a_budget_counts_every_attention_in_its_own_head_dim():
    """Two attentions of different head_dim: the budget is Σ G × head_dim; the cheaper heads win
    the spare units when their cost drops more."""
    costs = {"encoder": [{1: 5.0, 2: 0.0}], "decoder-self": [{1: 4.0, 2: 0.0}]}
    dims = {"encoder": 64, "decoder-self": 32}
    assert choose_allocation(costs, dims, 64 + 32 + 32) == {"encoder": (1,), "decoder-self": (2,)}
    assert choose_allocation(costs, dims, 128 + 32) == {"encoder": (2,), "decoder-self": (1,)}


# ---------------------------------------------------------------- costs from real calibration


def test_costs_from_real_calibration_choose_the_layer_whose_heads_are_related(tokenizer, calibration_text, tmp_path):
    """A tiny Llama whose layer 0 has K and V heads identical in pairs: the calibrated merge of
    layer 0 to 4 heads loses nothing, layer 1's does, and at a budget of (4 + 8) / 16 the
    allocation gives layer 0 four heads and layer 1 all eight — from the real calibration pass."""
    model = build("llama", tokenizer)
    d, kv = 8, 8
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        for proj in (attn.k_proj, attn.v_proj):
            heads = proj.weight.view(kv, d, -1)
            heads[1::2] = heads[0::2].clone()
            if proj.bias is not None:
                proj.bias.view(kv, d)[1::2] = proj.bias.view(kv, d)[0::2].clone()
    src = save(model, tokenizer, tmp_path / "src")
    moments, _ = collect_attention_moments(
        src, str(calibration_text), CalibrationSettings(calibration_tokens=2048, calibration_seq_len=64), progress=False
    )
    config = read_config(src)
    conversion = conversion_for(config, 8, get_strategy("calibrated"), "contiguous", "decoder-self", 0)
    with closing(SourceCheckpoint(src)) as checkpoint:
        costs = calibration_costs(conversion, checkpoint, moments)
    layer0, layer1 = costs["decoder-self"]
    assert layer0[4] < 1e-9 and layer0[2] > 1e-3 and layer1[4] > 1e-3
    assert layer0[8] == 0 and layer1[8] == 0
    chosen = allocate(costs, {"decoder-self": (8, 8)}, {"decoder-self": d}, 12 / 16)
    assert chosen == {"decoder-self": (4, 8)}
    # Uniform at the same budget does not exist (12/16 is not 8/G): the choice is the allocation's own.
    assert allocate(costs, {"decoder-self": (8, 8)}, {"decoder-self": d}, 0.5) == {"decoder-self": (4, 4)}


def test_costs_of_an_encoder_decoder_cover_every_chosen_attention(tmp_path):
    """A tiny BART whose heads are exactly related within 2 groups in every attention: for each
    of encoder, decoder self- and cross-attention (its keys and values read the encoder's output),
    merging to 2 heads loses nothing and to one head does."""
    model = build_seq2seq("bart")
    relate_heads_exactly(model, 2)
    model.save_pretrained(tmp_path / "src")
    arch = architecture(model.config.model_type)
    moments = seq2seq_moments(model, arch, calibration_batches("bart"), progress=False)
    config = read_config(tmp_path / "src")
    conversion = conversion_for(config, 1, get_strategy("calibrated"), "contiguous", ALL, 0)
    with closing(SourceCheckpoint(tmp_path / "src")) as checkpoint:
        costs = calibration_costs(conversion, checkpoint, moments)
    assert list(costs) == ["encoder", "decoder-self", "cross"]
    for name, layers in costs.items():
        heads = config["encoder_attention_heads" if name == "encoder" else "decoder_attention_heads"]
        assert len(layers) == config["encoder_layers" if name == "encoder" else "decoder_layers"]
        for layer in layers:
            assert set(layer) == set(divisors(heads))
            assert layer[1] > 1e-3 and layer[2] < 1e-6 * layer[1], (name, layer)
            assert layer[heads] == 0
    assert math.isfinite(sum(c for layers in costs.values() for layer in layers for c in layer.values()))


def test_ties_go_to_the_smaller_cache_then_to_fewer_heads_earliest():
    costs = {"decoder-self": [{1: 1.0, 2: 0.0, 4: 1.0, 8: 1.0}, {1: 1.0, 2: 1.0, 4: 1.0, 8: 0.0}]}
    # (1, 8) and (2, 1) both cost 1 within 9 heads: the smaller cache wins, not the fewer first heads.
    assert choose_allocation(costs, {"decoder-self": 1}, 9) == {"decoder-self": (2, 1)}
    # (1, 4) and (4, 1): equal cost, equal cache: fewer heads in the first layer.
    costs = {"decoder-self": [{1: 1.0, 4: 0.0}, {1: 1.0, 4: 0.0}]}
    assert choose_allocation(costs, {"decoder-self": 1}, 5) == {"decoder-self": (1, 4)}


# ---------------------------------------------------------------- end to end


def test_convert_spends_a_budget_where_the_layers_lose(tokenizer, calibration_text, tmp_path):
    """`uptrain convert --kv-budget 0.75 --allocation calibrated` on a tiny GPT-2 whose layer 0 has
    K and V heads identical in pairs: layer 0 gets 4 heads (its merge loses nothing), layer 1 all 8;
    the weights are those of `--kv-heads-per-layer 4,8`, bit for bit, and uptrain.json and the card
    carry the cost table."""
    from tests.convert.test_calibrated_classic import build as build_classic
    from tests.convert.test_calibrated_classic import kv_views
    from tests.convert.test_per_layer import tensors
    from uptrain.cli import main

    model = build_classic("gpt2", tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            views = kv_views(name, p)
            if views is not None and ".h.0." in name:
                for heads in views:
                    heads[1::2] = heads[0::2].clone()
    src = save(model, tokenizer, tmp_path / "src")
    keys = ["--pooling", "calibrated", "--calibration-data", calibration_text, "--calibration-tokens", 512]
    keys += ["--calibration-device", "cpu", "--source-hash", "none"]

    def convert(out, *flags):
        assert main(["convert", str(src), str(tmp_path / out), *map(str, flags), *map(str, keys)]) == 0
        return tmp_path / out

    chosen = convert("chosen", "--kv-budget", 0.75, "--allocation", "calibrated", "--allocation-cost", "merge")
    assert json.loads((chosen / "config.json").read_text())["num_key_value_heads_per_layer"] == [4, 8]
    record = json.loads((chosen / "uptrain.json").read_text())
    assert record["num_key_value_heads_per_layer"] == [4, 8]
    assert (record["kv_budget"], record["allocation"], record["allocation_cost"]) == (0.75, "calibrated", "merge")
    costs = record["allocation_costs"]["decoder-self"]
    assert [sorted(layer, key=int) for layer in costs] == [["1", "2", "4", "8"]] * 2
    assert costs[0]["4"] < 1e-9 < costs[0]["2"] and costs[1]["4"] > 1e-3 and costs[0]["8"] == costs[1]["8"] == 0
    card = (chosen / "README.md").read_text()
    assert "`allocation_costs`" in card and "| attention | layer | G = 1 | G = 2 | G = 4 | G = 8 |" in card
    assert f"| 1 | {costs[1]['1']:.4g} | {costs[1]['2']:.4g} | {costs[1]['4']:.4g} | 0 |" in card
    explicit = tensors(convert("explicit", "--kv-heads-per-layer", "4,8"))
    assert tensors(chosen).keys() == explicit.keys()
    assert all(torch.equal(t, explicit[name]) for name, t in tensors(chosen).items())


def test_an_encoder_decoder_spends_its_budget_across_its_attentions(tmp_path):
    """BART, the decoder's self- and cross-attention converted: every layer's heads exactly related
    within 2 groups except cross-attention's layer 1 (made anew). At 14/32 of the KV bytes the one
    allocation that loses nothing is 2,2 / 2,8 — chosen from moments computed beforehand (as
    `uptrain compare` passes them), and recorded per attention."""
    from uptrain.convert import convert_checkpoint
    from uptrain.convert.pipeline import Calibration

    model = build_seq2seq("bart")
    relate_heads_exactly(model, 2)
    with torch.no_grad():
        for proj in (
            model.model.decoder.layers[1].encoder_attn.k_proj,
            model.model.decoder.layers[1].encoder_attn.v_proj,
        ):
            proj.weight.copy_(torch.randn_like(proj.weight) * proj.weight.std())
    model.save_pretrained(tmp_path / "src")
    moments = seq2seq_moments(model, architecture("bart"), calibration_batches("bart"), progress=False)
    out = convert_checkpoint(
        tmp_path / "src",
        tmp_path / "out",
        kv_budget=14 / 32,
        allocation="calibrated",
        pooling="calibrated",
        calibration=Calibration(moments),
        source_hash="none",
        progress=False,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["decoder_num_key_value_heads"] == 2 and "decoder_num_key_value_heads_per_layer" not in config
    assert config["cross_attention_num_key_value_heads_per_layer"] == [2, 8]
    costs = json.loads((out / "uptrain.json").read_text())["allocation_costs"]
    assert list(costs) == ["decoder-self", "cross"] and costs["cross"][1]["2"] > 1e-3 > costs["cross"][0]["2"]


def test_convert_model_spends_a_budget_from_given_moments(tokenizer, calibration_text, tmp_path):
    """In memory (`converted_tensors`, what `convert_model` loads into its copy): the same choice as
    the checkpoint path (4, 8 on a GPT-2 whose layer 0 pairs its heads) and the weights of the
    explicit allocation; without moments, refused in one line."""
    from tests.convert.test_calibrated_classic import build as build_classic
    from tests.convert.test_calibrated_classic import kv_views
    from uptrain.convert.in_memory import converted_tensors
    from uptrain.convert.kv_heads import KVHeadsRequest
    from uptrain.convert.pipeline import Calibration
    from uptrain.convert.spec import ConversionOptions
    from uptrain.options import validated

    model = build_classic("gpt2", tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (views := kv_views(name, p)) is not None and ".h.0." in name:
                for heads in views:
                    heads[1::2] = heads[0::2].clone()
    src = save(model, tokenizer, tmp_path / "src")
    settings = CalibrationSettings(calibration_tokens=512, calibration_seq_len=64, calibration_device="cpu")
    calibration = Calibration(*collect_attention_moments(src, str(calibration_text), settings, progress=False))
    options = validated(ConversionOptions, pooling="calibrated")
    budget = KVHeadsRequest(budget=0.75, allocation="calibrated")
    chosen, plan = converted_tensors(model, budget, options, calibration=calibration, allocation_cost="merge")
    assert plan.allocation == {"decoder-self": (4, 8)}
    explicit, _ = converted_tensors(model, KVHeadsRequest(per_layer=((4, 8),)), options, calibration=calibration)
    assert chosen.keys() == explicit.keys() and all(torch.equal(t, explicit[name]) for name, t in chosen.items())
    with pytest.raises(UptrainError, match="allocation 'calibrated' measures each layer's merge") as err:
        converted_tensors(model, budget, validated(ConversionOptions), calibration=None, allocation_cost="merge")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the measured cost (--allocation-cost loss)


def paired_llama(tokenizer):
    """A tiny Llama whose layer 0 has its 8 K heads all identical, and its 8 V heads: mean pooling
    merges layer 0 to any G without changing what it computes (to rounding); layer 1's are distinct."""
    model = build("llama", tokenizer)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight.view(8, 8, -1)[1:] = proj.weight.view(8, 8, -1)[0].clone()
            if proj.bias is not None:
                proj.bias.view(8, 8)[1:] = proj.bias.view(8, 8)[0].clone()
    return model


def own_samples(model, tokenizer, rows=8, length=64):
    """Blocks the model samples itself (temperature 1): on them the source's loss is its own entropy,
    which any other model's loss exceeds in expectation, so a merge that changes the model costs
    more than nothing (on text, a tiny random model's loss moves either way with a merge)."""
    torch.manual_seed(0)
    start = torch.full((rows, 1), tokenizer.eos_token_id)
    return model.generate(
        input_ids=start,
        attention_mask=torch.ones_like(start),
        do_sample=True,
        top_k=0,
        max_new_tokens=length - 1,
        min_new_tokens=length - 1,
        pad_token_id=tokenizer.pad_token_id,
    )


def test_the_measured_cost_gives_the_layer_that_loses_nothing_the_fewest_heads(tokenizer):
    """Layer 0's identical heads merge to any G at no loss (to rounding), layer 1's distinct heads
    do not; the cost of each (l, G) is exactly the loss of `convert_model` with layer l alone at G
    minus the source's; at 9/16 of the cache the allocation is 1, 8 (uniform has no G there), and
    `convert_model` spends the budget to the weights of `kv_heads_per_layer=(1, 8)`, bit for bit."""
    from uptrain.convert.in_memory import convert_model
    from uptrain.convert.layer_loss import layer_alone_costs, mean_loss

    model = paired_llama(tokenizer)
    blocks = own_samples(model, tokenizer)
    costs = layer_alone_costs(model, blocks, (8, 8), functools.partial(convert_model, model))
    assert [sorted(layer) for layer in costs] == [[1, 2, 4, 8]] * 2
    assert costs[0][8] == costs[1][8] == 0
    assert max(abs(c) for c in costs[0].values()) < 1e-5 and min(costs[1][g] for g in (1, 2, 4)) > 1e-2
    merged = convert_model(model, kv_heads_per_layer=(8, 2)).eval()
    assert costs[1][2] == mean_loss(merged, blocks) - mean_loss(model, blocks)
    chosen = convert_model(model, kv_budget=9 / 16, allocation="calibrated", calibration_blocks=blocks)
    explicit = convert_model(model, kv_heads_per_layer=(1, 8))
    assert chosen.config.num_key_value_heads_per_layer == [1, 8]
    chosen_state, explicit_state = chosen.state_dict(), explicit.state_dict()
    assert chosen_state.keys() == explicit_state.keys()
    assert all(torch.equal(t, explicit_state[name]) for name, t in chosen_state.items())


def test_convert_spends_a_budget_by_the_measured_loss(tokenizer, calibration_text, tmp_path):
    """`uptrain convert --kv-budget 0.5625 --allocation calibrated` (the measured cost: the default for
    a decoder-only model) on the same Llama: the costs recorded are the in-memory ones on the
    calibration blocks (layer 0's about 0), the allocation is the knapsack's of that table, the
    weights those of the same `--kv-heads-per-layer`, bit for bit, and uptrain.json and the card say
    which cost chose them."""
    from tests.convert.test_per_layer import tensors
    from uptrain.cli import main
    from uptrain.convert.calibration import first_calibration_blocks
    from uptrain.convert.in_memory import convert_model
    from uptrain.convert.layer_loss import layer_alone_costs

    model = paired_llama(tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    keys = ["--calibration-data", calibration_text, "--calibration-tokens", 512, "--calibration-device", "cpu"]
    keys += ["--source-hash", "none"]

    def convert(out, *flags):
        assert main(["convert", str(src), str(tmp_path / out), *map(str, flags), *map(str, keys)]) == 0
        return tmp_path / out

    chosen = convert("chosen", "--kv-budget", 0.5625, "--allocation", "calibrated")
    record = json.loads((chosen / "uptrain.json").read_text())
    assert (record["allocation"], record["allocation_cost"], record["allocation_cost_pooling"]) == (
        "calibrated",
        "loss",
        "mean",
    )
    recorded = [{int(g): c for g, c in layer.items()} for layer in record["allocation_costs"]["decoder-self"]]
    settings = CalibrationSettings(calibration_tokens=512, calibration_seq_len=record["calibration"]["seq_len"])
    blocks, _ = first_calibration_blocks(tokenizer, str(calibration_text), settings, settings.calibration_seq_len)
    assert recorded == layer_alone_costs(model, blocks, (8, 8), functools.partial(convert_model, model))
    assert max(abs(c) for c in recorded[0].values()) < 1e-5
    heads = allocate({"decoder-self": recorded}, {"decoder-self": (8, 8)}, {"decoder-self": 8}, 0.5625)
    assert record["num_key_value_heads_per_layer"] == list(heads["decoder-self"])
    assert "model's loss" in (chosen / "README.md").read_text()
    explicit = tensors(convert("explicit", "--kv-heads-per-layer", ",".join(map(str, heads["decoder-self"]))))
    assert tensors(chosen).keys() == explicit.keys()
    assert all(torch.equal(t, explicit[name]) for name, t in tensors(chosen).items())


def test_the_measured_cost_is_refused_where_it_is_not_measured(tokenizer, tmp_path):
    """In memory without blocks to measure on; an encoder–decoder asked for it (one line each)."""
    from uptrain.convert import convert_checkpoint
    from uptrain.convert.in_memory import convert_model
    from uptrain.convert.pipeline import Calibration

    with pytest.raises(UptrainError, match="allocation cost 'loss' measures the model's loss on calibration blocks"):
        convert_model(paired_llama(tokenizer), kv_budget=0.75, allocation="calibrated", calibration=Calibration({}))
    build_seq2seq("bart").save_pretrained(tmp_path / "bart")
    with pytest.raises(UptrainError, match="an encoder–decoder's is its objective's") as err:
        convert_checkpoint(
            tmp_path / "bart",
            tmp_path / "out",
            kv_budget=0.5,
            allocation="calibrated",
            allocation_cost="loss",
            calibration_data="text.jsonl",
        )
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_a_budget_with_one_allocation_is_taken_without_measuring(tokenizer, calibration_text, tmp_path, capsys):
    """At 1/8 of an 8-KV-head Llama's cache every layer must take 1 head: `--allocation calibrated`
    (its default cost, the model's loss with each layer merged, L × 3 conversions) takes that
    allocation as it is — no calibration pass (uptrain.json records none), no cost table, and
    uptrain.json, the card and `uptrain inspect` say it was forced — and its weights are `-g 1`'s,
    bit for bit. In memory it needs no blocks to measure on; at 3/16 (a layer may take 2) it does."""
    from tests.convert.test_per_layer import tensors
    from uptrain.cli import main
    from uptrain.convert.in_memory import convert_model

    model = paired_llama(tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    keys = ["--calibration-data", calibration_text, "--calibration-device", "cpu", "--source-hash", "none"]

    def convert(out, *flags):
        assert main(["convert", str(src), str(tmp_path / out), *map(str, flags), *map(str, keys)]) == 0
        return tmp_path / out

    forced = convert("forced", "--kv-budget", 0.125, "--allocation", "calibrated")
    record = json.loads((forced / "uptrain.json").read_text())
    assert (record["kv_budget"], record["allocation"], record["allocation_forced"]) == (0.125, "calibrated", True)
    assert "allocation_costs" not in record and "allocation_cost" not in record and "calibration" not in record
    assert record["num_key_value_heads"] == 1
    card = (forced / "README.md").read_text()
    assert "no costs were measured" in card and "allocation_costs" not in card
    capsys.readouterr()
    assert main(["inspect", str(forced)]) == 0
    assert "(calibrated allocation; forced: the only allocation within the budget, no costs measured)" in (
        capsys.readouterr().out
    )
    uniform = tensors(convert("uniform", "-g", 1))
    assert tensors(forced).keys() == uniform.keys()
    assert all(torch.equal(t, uniform[name]) for name, t in tensors(forced).items())
    chosen = convert_model(model, kv_budget=0.125, allocation="calibrated").state_dict()
    explicit = convert_model(model, num_kv_heads=1).state_dict()
    assert chosen.keys() == explicit.keys() and all(torch.equal(t, explicit[n]) for n, t in chosen.items())
    with pytest.raises(UptrainError, match="allocation cost 'loss' measures the model's loss on calibration blocks"):
        convert_model(model, kv_budget=0.1875, allocation="calibrated")


def test_candidates_no_allocation_within_the_budget_can_take_are_not_measured(tokenizer, calibration_text, tmp_path):
    """At 3/16 of an 8-KV-head, 2-layer Llama's cache a layer can take 1 or 2 heads (4 with the
    other at 1 is 5/16): both costs record only G = 1 and 2 for each layer (2 of the loss's 6
    passes), the allocation is the knapsack's of that table, and the card's table has those columns."""
    from uptrain.cli import main

    src = save(paired_llama(tokenizer), tokenizer, tmp_path / "src")
    keys = ["--calibration-data", calibration_text, "--calibration-tokens", 512, "--calibration-device", "cpu"]
    for cost in ("loss", "merge"):
        out = tmp_path / cost
        flags = ["--kv-budget", 0.1875, "--allocation", "calibrated", "--allocation-cost", cost, *keys]
        assert main(["convert", str(src), str(out), "--source-hash", "none", *map(str, flags)]) == 0
        record = json.loads((out / "uptrain.json").read_text())
        costs = [{int(g): c for g, c in layer.items()} for layer in record["allocation_costs"]["decoder-self"]]
        assert [sorted(layer) for layer in costs] == [[1, 2]] * 2 and "allocation_forced" not in record
        heads = allocate({"decoder-self": costs}, {"decoder-self": (8, 8)}, {"decoder-self": 8}, 0.1875)
        assert record["num_key_value_heads_per_layer"] == list(heads["decoder-self"])
        assert sorted(heads["decoder-self"]) == [1, 2]
        assert "| attention | layer | G = 1 | G = 2 |\n" in (out / "README.md").read_text()


# ---------------------------------------------------------------- the merge cost of a row pooling, end to end


def scaled_pairs_llama(tokenizer):
    """A tiny Llama whose layer 0 K and V heads come in pairs, the second twice the first (a scale
    the calibrated merge folds into its maps: merging to 4 heads loses nothing; the mean of a and
    2a is 1.5a: mean pooling loses), and whose layer 1 pairs differ by 5 % noise (either loses little)."""
    model = build("llama", tokenizer)
    with torch.no_grad():
        for layer, make in ((0, lambda h: 2 * h), (1, lambda h: h + 0.05 * torch.randn_like(h))):
            attn = model.model.layers[layer].self_attn
            for t in (attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias):
                heads = t.view(8, 8, -1)  # biases too: the merge reads them as a column of the weights
                heads[1::2] = make(heads[0::2].clone())
    return model


def test_a_mean_pooled_budget_is_spent_by_what_mean_pooling_loses(tokenizer, calibration_text, tmp_path, capsys):
    """`--pooling mean --kv-budget 0.75 --allocation calibrated --allocation-cost merge`: the cost
    prices mean pooling, which keeps layer 0 whole and halves layer 1 (8, 4: brute force over the
    table agrees), where the calibrated merge's cost of the same moments, which would price a merge
    that loses nothing in layer 0, halves layer 0 instead (4, 8). The written weights are
    `--kv-heads-per-layer 8,4`'s bit for bit; uptrain.json, the card and inspect name the pooling priced."""
    from tests.convert.test_per_layer import tensors
    from uptrain.cli import main

    src = save(scaled_pairs_llama(tokenizer), tokenizer, tmp_path / "src")
    settings = CalibrationSettings(calibration_tokens=512, calibration_seq_len=64)
    moments, _ = collect_attention_moments(src, str(calibration_text), settings, progress=False)
    request = KVHeadsRequest(budget=0.75, allocation="calibrated")

    def costs(pooling: str) -> list[dict[int, float]]:
        conversion = conversion_for(read_config(src), request, get_strategy(pooling), "contiguous", "decoder-self", 0)
        with closing(SourceCheckpoint(src)) as checkpoint:
            return calibration_costs(conversion, checkpoint, moments)["decoder-self"]

    mean, merged = costs("mean"), costs("calibrated")
    assert merged[0][4] < 1e-9 < merged[1][4] < mean[1][4] < 0.5 * mean[0][4]
    assert mean[0][8] == mean[1][8] == 0

    def spent(table):
        return allocate({"decoder-self": table}, {"decoder-self": (8, 8)}, {"decoder-self": 8}, 0.75)["decoder-self"]

    assert (spent(merged), spent(mean)) == ((4, 8), (8, 4))
    assert spent(mean) == brute_force({"decoder-self": mean}, {"decoder-self": 8}, 96)[2]

    keys = ["--calibration-data", calibration_text, "--calibration-tokens", 512, "--calibration-device", "cpu"]
    keys += ["--source-hash", "none"]

    def convert(out, *flags):
        assert main(["convert", str(src), str(tmp_path / out), *map(str, flags), *map(str, keys)]) == 0
        return tmp_path / out

    chosen = convert("chosen", "--kv-budget", 0.75, "--allocation", "calibrated", "--allocation-cost", "merge")
    record = json.loads((chosen / "uptrain.json").read_text())
    assert record["num_key_value_heads_per_layer"] == [8, 4]
    assert (record["pooling"], record["allocation_cost"], record["allocation_cost_pooling"]) == (
        "mean",
        "merge",
        "mean",
    )
    card = (chosen / "README.md").read_text()
    assert "What `mean` pooling of each layer to G KV heads loses" in card
    capsys.readouterr()
    assert main(["inspect", str(chosen)]) == 0
    assert "each layer's costs (merge cost, priced for mean pooling) in uptrain.json" in capsys.readouterr().out
    explicit = tensors(convert("explicit", "--kv-heads-per-layer", "8,4"))
    assert tensors(chosen).keys() == explicit.keys()
    assert all(torch.equal(t, explicit[name]) for name, t in tensors(chosen).items())


# -------------------------------------------------- --cross-kv-weight: an encoder–decoder's budget in bytes


def geometries_of(self_heads: int, cross_heads: int, layers: int, d: int) -> dict[str, AttentionGeometry]:
    def geometry(heads):
        return AttentionGeometry("bart", layers, heads, heads, d, heads * d)

    return {"decoder-self": geometry(self_heads), "cross": geometry(cross_heads)}


@settings(max_examples=150, deadline=None)
@given(
    instances(integer_costs=True),
    st.sampled_from([0.25, 0.5, 1, 1.5, 3, 37.5, 0.333333]),
)
def test_the_knapsack_with_head_weights_equals_brute_force(instance, ratio):
    """The same search, a cross-attention head weighing `ratio` self-attention heads
    (`head_weights`: p × head_dim against q × head_dim, R = p/q): exact against every allocation."""
    drawn, dims, _ = instance  # one or two attentions, renamed: the second is the cross-attention
    names = dict(zip(drawn, ("decoder-self", "cross"), strict=False))
    costs = {names[old]: layers for old, layers in drawn.items()}
    geometries = {
        names[old]: AttentionGeometry("bart", len(drawn[old]), 12, 12, dims[old], 12 * dims[old]) for old in drawn
    }
    weights = head_weights(geometries, tuple(costs), ratio)
    if "cross" in weights:
        fraction = Fraction(ratio).limit_denominator(100)
        per_dim = {name: Fraction(weights[name], geometries[name].head_dim) for name in costs}
        assert per_dim["cross"] / per_dim["decoder-self"] == fraction  # a cross head weighs R self heads, per dim
    smallest = sum(min(o) * weights[n] for n in costs for o in costs[n])
    largest = sum(max(o) * weights[n] for n in costs for o in costs[n])
    for budget in (smallest, (smallest + largest) // 2, largest):
        chosen = choose_allocation(costs, weights, budget)
        assert tuple(g for name in costs for g in chosen[name]) == brute_force(costs, weights, budget)[2]


@pytest.mark.parametrize("ratio", [None, 0.5, 1, 37.5, 1500])
def test_a_uniform_allocation_keeps_its_fraction_whatever_the_cross_weight(ratio):
    """One G in every layer of every attention holds G/kv of the cache per target token and per
    source token alike: its budget and its bytes do not depend on the weight."""
    geometries = geometries_of(8, 8, 3, 16)
    for g in divisors(8):
        uniform = {name: (g,) * 3 for name in geometries}
        assert kv_fraction(geometries, uniform, ratio) == Fraction(g, 8)
        request = KVHeadsRequest(budget=g / 8, cross_kv_weight=ratio)
        assert resolve_allocation(geometries, tuple(geometries), request) == uniform


def heads_of(record: dict) -> tuple[int, ...]:
    """One attention's KV heads per layer as uptrain.json records them (the list only where layers differ)."""
    return tuple(record.get("num_key_value_heads_per_layer", [record["num_key_value_heads"]] * record["num_layers"]))


def test_a_heavy_cross_weight_keeps_self_attention_heads_and_cuts_cross_ones(tmp_path, capsys):
    """A tiny BART (decoder self + cross, 8 heads × 2 layers each) at a quarter of the cache, spent by
    mean pooling's cost: counted in heads (the default), 8 heads in all; with each cross head
    weighing 50 self heads (50 source positions cached per generated token), self-attention keeps
    all 16 (they cost 1/50 as much) and cross-attention 3, within the quarter of the bytes. uptrain.json,
    the card and inspect state the weight; uniform at the same budget is `-g 2`'s checkpoint, bit for bit."""
    from tests.convert.test_per_layer import tensors
    from uptrain.cli import main
    from uptrain.convert import convert_checkpoint
    from uptrain.convert.in_memory import convert_model
    from uptrain.convert.pipeline import Calibration

    model = build_seq2seq("bart")
    model.save_pretrained(tmp_path / "src")
    moments = seq2seq_moments(model, architecture("bart"), calibration_batches("bart"), progress=False)
    geometries = geometries_of(8, 8, 2, 4)

    def spend(out, weight):
        folder = convert_checkpoint(
            tmp_path / "src",
            tmp_path / out,
            kv_budget=0.25,
            allocation="calibrated",
            cross_kv_weight=weight,
            calibration=Calibration(moments),
            source_hash="none",
            progress=False,
        )
        record = json.loads((folder / "uptrain.json").read_text())
        return (
            folder,
            record,
            {name: heads_of(record["attentions"][name]) for name in geometries},
        )

    _, record, by_heads = spend("heads", None)
    assert "cross_kv_weight" not in record and sum(map(sum, by_heads.values())) == 8
    folder, record, by_bytes = spend("bytes", 50)
    assert by_bytes["decoder-self"] == (8, 8) and sum(by_bytes["cross"]) == 3
    assert record["cross_kv_weight"] == 50
    in_memory = convert_model(
        model, kv_budget=0.25, allocation="calibrated", cross_kv_weight=50, calibration=Calibration(moments)
    )
    assert in_memory.config.decoder_num_key_value_heads == 8  # 8 in both self layers: no per-layer list
    assert in_memory.config.cross_attention_num_key_value_heads_per_layer == list(by_bytes["cross"])
    assert kv_fraction(geometries, by_bytes, 50) <= Fraction(1, 4) < kv_fraction(geometries, by_bytes)
    assert kv_fraction(geometries, by_heads, 50) > Fraction(1, 4)  # counted in heads, it held more bytes
    assert "a cross-attention KV head weighs 50 self-attention heads" in (folder / "README.md").read_text()
    capsys.readouterr()
    assert main(["inspect", str(folder)]) == 0
    assert "a cross-attention head weighing 50 self-attention heads" in capsys.readouterr().out

    def convert(out, *flags):
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / out), "--source-hash", "none", *flags]) == 0
        return tmp_path / out

    uniform = tensors(convert("uniform", "--kv-budget", "0.25", "--cross-kv-weight", "37.5"))
    g2 = tensors(convert("g2", "-g", "2"))
    assert uniform.keys() == g2.keys() and all(torch.equal(t, g2[name]) for name, t in uniform.items())
    assert json.loads((tmp_path / "uniform" / "uptrain.json").read_text())["cross_kv_weight"] == 37.5


def test_a_cross_weight_that_weighs_nothing_is_refused_in_one_line(tmp_path, capsys):
    from tests.convert.test_errors import fails

    build_seq2seq("bart").save_pretrained(tmp_path / "src")
    src = tmp_path / "src"
    for flags, expected in (
        (["--kv-budget", "0.25", "--cross-kv-weight", "0"], "`cross_kv_weight`: must be more than 0"),
        (["--kv-budget", "0.25", "--cross-kv-weight", "nan"], "`cross_kv_weight`: must be a number or null"),
        (["--kv-budget", "0.25", "--cross-kv-weight", "0.001"], "is below 0.01, the least weight"),
        (["-g", "2", "--cross-kv-weight", "4"], "with -g or --kv-heads-per-layer the heads are already chosen"),
        (
            ["--kv-budget", "0.25", "--attention", "decoder-self", "--cross-kv-weight", "4"],
            "weighs cross-attention KV heads in the budget; its --attention converts none",
        ),
    ):
        fails(capsys, tmp_path, [src, *flags], expected)
