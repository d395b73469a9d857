"""Per-layer KV heads (#32): `--kv-heads-per-layer` and `--kv-budget`, checked at the weight level on
tiny real models (uptrain's modeling learns per-layer heads elsewhere; these outputs are read here as
tensors and config keys).

Each converted layer must equal the uniform conversion at that layer's G, a layer whose K/V heads
are identical within its groups must pool losslessly at its G (and lossily at another), and a
uniform allocation however asked for must write exactly today's config.json and tensors."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.test_encoder_decoder import MODELS
from tests.modeling.classic_models import HEAD_DIM, HEADS, build
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.convert.in_memory import converted_tensors
from uptrain.convert.kv_heads import KVHeadsRequest
from uptrain.model_info import attention_geometry, read_config, stack_geometry

# Each decoder-only family's K and V rows per layer, from transformers' own layout (written here,
# independently of uptrain's layout tables): name pattern → how to view [kv heads, head_dim, …].
LAYER = re.compile(r"\.(\d+)\.")


def kv_views(model_type: str, name: str, t: torch.Tensor) -> tuple[torch.Tensor | None, ...] | None:
    """Views `[kv heads, head_dim, …]` of a tensor's K and V parts (None: not a K/V tensor)."""
    q = HEADS * HEAD_DIM
    if model_type == "gpt2" and name.endswith("attn.c_attn.weight"):  # Conv1D [in, Q | K | V]
        kv = (t.shape[1] - q) // 2
        return tuple(
            t[:, q + i * kv : q + (i + 1) * kv].view(-1, kv // HEAD_DIM, HEAD_DIM).permute(1, 2, 0) for i in (0, 1)
        )
    if model_type == "gpt2" and name.endswith("attn.c_attn.bias"):
        kv = (t.shape[0] - q) // 2
        return tuple(t[q + i * kv : q + (i + 1) * kv].view(kv // HEAD_DIM, HEAD_DIM) for i in (0, 1))
    heads = t.shape[0] // HEAD_DIM
    if model_type == "opt" and re.search(r"self_attn\.k_proj\.(weight|bias)$", name):
        return t.view(heads, HEAD_DIM, *t.shape[1:]), None
    if model_type == "opt" and re.search(r"self_attn\.v_proj\.(weight|bias)$", name):
        return None, t.view(heads, HEAD_DIM, *t.shape[1:])
    return None


def tie_heads(model, model_type: str, groups: tuple[int, ...]) -> None:
    """Layer l's K and V heads each equal to the first head of its contiguous group of HEADS / groups[l]."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            views = kv_views(model_type, name, p.data)
            if views is None:
                continue
            r = HEADS // groups[int(LAYER.search(name).group(1))]
            for heads in views:
                if heads is not None:
                    for i in range(HEADS):
                        heads[i] = heads[(i // r) * r]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def convert(src: Path, out: Path, *flags) -> Path:
    assert main(["convert", str(src), str(out), "--source-hash", "none", *map(str, flags)]) == 0
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    built = {}

    def get(model_type: str, groups: tuple[int, ...] | None = None) -> Path:
        if (model_type, groups) not in built:
            model = build(model_type)
            if groups is not None:
                tie_heads(model, model_type, groups)
            built[model_type, groups] = tmp_path_factory.mktemp(model_type) / "src"
            model.save_pretrained(built[model_type, groups])
        return built[model_type, groups]

    return get


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_identical_heads_pool_losslessly_at_their_allocation_only(model_type, sources, tmp_path):
    """Layer 0's heads are equal in pairs (G = 4), layer 1's in fours (G = 2): at 4,2 every K/V
    head of the source is its group's pooled head exactly (`first` keeps bits; `mean` of equal
    values within float rounding), and at 2,4 layer 0 loses what its pairs held apart."""
    src = sources(model_type, (4, 2))
    before = tensors(src)
    for pooling in ("first", "mean"):
        after = tensors(convert(src, tmp_path / pooling, "--kv-heads-per-layer", "4,2", "--pooling", pooling))
        checked = 0
        for name, t in before.items():
            views = kv_views(model_type, name, t)
            if views is None:
                continue
            g = (4, 2)[int(LAYER.search(name).group(1))]
            for source, pooled in zip(views, kv_views(model_type, name, after[name]), strict=True):
                if source is None:
                    continue
                assert pooled.shape == (g, *source.shape[1:]), name  # the layer's own heads
                expanded = pooled.repeat_interleave(HEADS // g, dim=0)  # each query head's KV head
                if pooling == "first":
                    assert torch.equal(expanded, source), name
                else:
                    torch.testing.assert_close(expanded, source, rtol=1e-6, atol=0)
                checked += 1
        assert checked >= 4  # K and V of both layers
    swapped = tensors(convert(src, tmp_path / "swapped", "--kv-heads-per-layer", "2,4"))
    lossy = [
        name
        for name, t in before.items()
        if (views := kv_views(model_type, name, t)) and ".0." in name
        for source, pooled in zip(views, kv_views(model_type, name, swapped[name]), strict=True)
        if source is not None and not torch.allclose(pooled.repeat_interleave(4, dim=0), source)
    ]
    assert lossy  # layer 0 at 2 merges pairs that differ


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "opt", "falcon"])
def test_each_layer_equals_the_uniform_conversion_at_its_g(model_type, sources, tmp_path):
    """Layer l of a 4,2 conversion is, tensor for tensor, layer l of `-g 4` (l = 0) or `-g 2` (l = 1);
    every tensor outside attention is the source's, bit for bit."""
    src = sources(model_type)
    mixed = tensors(convert(src, tmp_path / "mixed", "--kv-heads-per-layer", "4,2"))
    uniform = {g: tensors(convert(src, tmp_path / f"g{g}", "-g", g)) for g in (4, 2)}
    assert sorted(mixed) == sorted(uniform[4])
    for name, t in mixed.items():
        layer = LAYER.search(name)
        reference = uniform[(4, 2)[int(layer.group(1))]] if layer else uniform[4]
        assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name


def test_config_and_record_list_each_layers_heads(sources, tmp_path):
    """config.json: the list beside the scalar key, which holds the largest; uptrain.json: the heads,
    groups and query → KV map per layer; the card says so; model_info reads it back."""
    src = sources("gpt2")
    out = convert(src, tmp_path / "out", "--kv-heads-per-layer", "4,1")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_key_value_heads_per_layer"]) == (4, [4, 1])
    geometry = attention_geometry(read_config(out))
    assert geometry.kv_heads_per_layer == (4, 1)
    assert geometry.kv_cache_bytes_per_token(4) == 2 * (4 + 1) * HEAD_DIM * 4
    record = json.loads((out / "uptrain.json").read_text())
    assert (record["num_key_value_heads"], record["num_key_value_heads_per_layer"]) == (4, [4, 1])
    assert record["kv_groups"] == {"0": [[0, 1], [2, 3], [4, 5], [6, 7]], "1": [list(range(8))]}
    assert record["query_to_kv"] == {"0": [0, 0, 1, 1, 2, 2, 3, 3], "1": [0] * 8}
    card = (out / "README.md").read_text()
    assert "with per-layer KV heads" in card and "each layer's own KV heads (4, 1, layer 0 first)" in card
    assert "--kv-budget" not in card


def test_a_uniform_allocation_writes_todays_checkpoint(sources, tmp_path):
    """4,4 and --kv-budget 0.5 are -g 4: the same config.json bytes, tensors and record keys."""
    src = sources("gpt2")
    today = convert(src, tmp_path / "g", "-g", 4)
    for flags, budget in ((("--kv-heads-per-layer", "4,4"), None), (("--kv-budget", 0.5), 0.5)):
        out = convert(src, tmp_path / f"{flags[0]}", *flags)
        assert (out / "config.json").read_bytes() == (today / "config.json").read_bytes()
        before, after = tensors(today), tensors(out)
        assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
        records = [json.loads((f / "uptrain.json").read_text()) for f in (today, out)]
        added = {"kv_budget": budget, "allocation": "uniform"} if budget else {}
        assert set(records[1]) == set(records[0]) | set(added)
        assert {k: records[1][k] for k in added} == added
        for key in ("num_key_value_heads", "kv_groups", "query_to_kv"):
            assert records[0][key] == records[1][key]
    card = (tmp_path / "--kv-budget" / "README.md").read_text()
    assert "`--kv-budget 0.5` (`--allocation uniform`)" in card


def test_in_memory_equals_the_checkpoint(sources, tmp_path):
    """`converted_tensors` with per-layer heads equals `uptrain convert`'s tensors (one conversion)."""
    src = sources("gpt_neox")
    out = tensors(convert(src, tmp_path / "out", "--kv-heads-per-layer", "2,8"))
    model = build("gpt_neox")
    converted, plan = converted_tensors(model, KVHeadsRequest(per_layer=((2, 8),)))
    assert plan.allocation == {"decoder-self": (2, 8)} and plan.config_kv_heads == (2, 8)
    assert sorted(converted) == sorted(out)
    assert all(torch.equal(converted[n], out[n]) for n in out)


def test_similarity_grouping_takes_each_layers_g(sources, tmp_path):
    """Whole-layer merges (similarity grouping, weight space) solve each layer at its own G: layer l
    equals the uniform merge at G_l, and the record's per-layer groups have G_l groups."""
    src = sources("opt")
    out = convert(src, tmp_path / "mixed", "--kv-heads-per-layer", "2,4", "--grouping", "similarity")
    mixed = tensors(out)
    uniform = {g: tensors(convert(src, tmp_path / f"g{g}", "-g", g, "--grouping", "similarity")) for g in (2, 4)}
    for name, t in mixed.items():
        layer = LAYER.search(name)
        reference = uniform[(2, 4)[int(layer.group(1))]] if layer else uniform[2]
        assert torch.equal(t, reference[name]), name
    groups = json.loads((out / "uptrain.json").read_text())["kv_groups"]
    assert [len(groups[layer]) for layer in ("0", "1")] == [2, 4]


def test_encoder_decoder_lists_per_attention(tmp_path):
    """T5 (2 encoder blocks, 3 decoder blocks): decoder-self and cross each get their own list; each
    layer equals the uniform conversion at its G; the mirror `num_key_value_heads` is the decoder's scalar."""
    model_class, config = MODELS["t5"]
    torch.manual_seed(0)
    src = tmp_path / "src"
    model_class(config()).save_pretrained(src)
    out = convert(src, tmp_path / "out", "--kv-heads-per-layer", "8,2,4/1,2,2")
    saved = json.loads((out / "config.json").read_text())
    assert saved["decoder_num_key_value_heads"] == 8 and saved["decoder_num_key_value_heads_per_layer"] == [8, 2, 4]
    assert saved["cross_attention_num_key_value_heads"] == 2
    assert saved["cross_attention_num_key_value_heads_per_layer"] == [1, 2, 2]
    assert saved["num_key_value_heads"] == 8 and "num_key_value_heads_per_layer" not in saved
    keys = dict(layers_key="num_decoder_layers", heads_key="num_heads", head_dim_key="d_kv", hidden_key="d_model")
    cross = stack_geometry(saved, kv_heads_key="cross_attention_num_key_value_heads", **keys)
    assert cross.kv_heads_per_layer == (1, 2, 2) and cross.kv_cache_bytes_per_token(2) == 2 * 5 * 6 * 2
    record = json.loads((out / "uptrain.json").read_text())
    assert record["attentions"]["cross"]["num_key_value_heads_per_layer"] == [1, 2, 2]
    assert record["attentions"]["decoder-self"]["kv_groups"]["1"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "num_key_value_heads_per_layer" not in record["attentions"]["encoder"]
    card = (out / "README.md").read_text()
    assert "with per-layer KV heads in its decoder" in card and "8 → each layer's own KV heads (1, 2, 2" in card
    mixed = tensors(out)
    uniform = {g: tensors(convert(src, tmp_path / f"g{g}", "-g", g)) for g in (8, 4, 2, 1)}
    allocation = {"SelfAttention": (8, 2, 4), "EncDecAttention": (1, 2, 2)}
    for name, t in mixed.items():
        g = 8  # the encoder and everything outside the decoder's attentions: the source's
        if m := re.fullmatch(r"decoder\.block\.(\d+)\.layer\.\d\.(SelfAttention|EncDecAttention)\.[kv]\.weight", name):
            g = allocation[m.group(2)][int(m.group(1))]
            assert t.shape == (g * 6, 32), name
        assert torch.equal(t, uniform[g][name]), name


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--kv-heads-per-layer", "4,2,1"],
            "--kv-heads-per-layer 4,2,1: 3 entries for the 2 layers; give one per layer",
        ),
        (["--kv-heads-per-layer", "4,3"], "--kv-heads-per-layer: layer 1's 3 does not divide the model's 8 attention"),
        (["--kv-heads-per-layer", "4,16"], "--kv-heads-per-layer: layer 1's 16 exceeds the model's 8 attention heads"),
        (["--kv-heads-per-layer", "4,x"], "'4,x' is not a comma list of whole numbers ≥ 1"),
        (["--kv-heads-per-layer", "4,0"], "'4,0' is not a comma list of whole numbers ≥ 1"),
        (["--kv-heads-per-layer", "4,2/2,2"], "--kv-heads-per-layer gives 2 lists (split by /), and the conversion"),
        (["--kv-budget", "0.3"], "--kv-budget 0.3 with --allocation uniform: no single G gives that fraction"),
        (["--kv-budget", "0"], "`kv_budget`: must be more than 0"),
        (["--kv-budget", "1.5"], "`kv_budget`: must be at most 1"),
        (["-g", "2", "--kv-budget", "0.25"], "give exactly one of -g/--num-kv-heads G, --kv-heads-per-layer"),
        ([], "give exactly one of -g/--num-kv-heads G, --kv-heads-per-layer LISTS or --kv-budget F (none was given)"),
        (["-g", "2", "--allocation", "calibrated"], "--allocation calibrated spends a --kv-budget; with -g"),
        (
            ["--kv-budget", "0.25", "--allocation", "calibrated"],
            "--allocation calibrated measures what each layer's merge loses on calibration data (--calibration-data",
        ),
        (
            ["--kv-budget", "0.5", "--allocation-cost", "merge"],
            "--allocation-cost merge is the cost --allocation calibrated minimises; --allocation uniform chooses no",
        ),
        (
            ["--kv-budget", "0.1", "--allocation", "calibrated"],
            "--kv-budget 0.1 is below what any allocation reaches: 1 KV head in every layer keeps 0.125 of the",
        ),
    ],
)
def test_refusals_are_one_line_and_write_nothing(flags, expected, sources, capsys, tmp_path):
    from tests.convert.test_errors import fails

    fails(capsys, tmp_path, [sources("gpt2"), *flags], expected)


def test_a_family_on_transformers_own_modeling_refuses_per_layer_heads(capsys, tmp_path):
    """Mistral's config holds one num_key_value_heads for transformers, and the per-layer layout
    engines serve (DeciLM, the Llama family's: tests/modeling/test_per_layer_llama.py) has no
    sliding window: per-layer heads are refused in one line (one G, however asked for, converts
    as always)."""
    from tests.convert.test_errors import fails
    from tests.convert.tiny_models import build_model, save

    src = save(build_model("mistral"), tmp_path / "src")
    fails(capsys, tmp_path, [src, "--kv-heads-per-layer", "4,2"], "Mistral cannot take its own KV heads per layer")
    convert(src, tmp_path / "uniform", "--kv-heads-per-layer", "2,2")
    assert json.loads((tmp_path / "uniform" / "config.json").read_text())["num_key_value_heads"] == 2


def test_an_encoder_decoders_lists_follow_attention(tmp_path, capsys):
    """One list per converted attention: the default converts the decoder's two, --attention another set."""
    from tests.convert.test_errors import fails

    model_class, config = MODELS["bart"]
    torch.manual_seed(0)
    src = tmp_path / "src"
    model_class(config()).save_pretrained(src)
    fails(capsys, tmp_path, [src, "--kv-heads-per-layer", "4,2"], "converts 2 attentions (decoder-self, cross")
    out = convert(src, tmp_path / "converted", "--kv-heads-per-layer", "2,1/8,2", "--attention", "encoder,cross")
    saved = json.loads((out / "config.json").read_text())
    assert saved["encoder_num_key_value_heads_per_layer"] == [2, 1]
    assert saved["cross_attention_num_key_value_heads_per_layer"] == [8, 2]
    assert "decoder_num_key_value_heads_per_layer" not in saved
    fails(
        capsys,
        tmp_path,
        [src, "--kv-heads-per-layer", "8,1/8,2", "--attention", "encoder,cross"],
        "--kv-heads-per-layer: layer 0's 8 exceeds the model's 4 attention heads of its encoder self-attention",
    )


def test_calibrated_merge_solves_each_layer_at_its_g(tokenizer, calibration_text, tmp_path):
    """`--pooling calibrated` solves each layer's merge while calibrating (`pipeline.calibrate`), at
    that layer's G: layer l of 4,2 equals layer l of the uniform calibrated merge at G_l, bit for bit."""
    from tests.convert.test_calibrated import save as save_with_tokenizer
    from tests.convert.test_calibrated_classic import build as build_calibrated
    from uptrain.convert import convert_checkpoint

    src = save_with_tokenizer(build_calibrated("gpt2", tokenizer), tokenizer, tmp_path / "src")
    keys = dict(pooling="calibrated", calibration_data=str(calibration_text), calibration_tokens=512)
    keys |= dict(calibration_device="cpu", source_hash="none", progress=False)
    mixed = tensors(convert_checkpoint(src, tmp_path / "mixed", kv_heads_per_layer="4,2", **keys))
    uniform = {g: tensors(convert_checkpoint(src, tmp_path / f"g{g}", g, **keys)) for g in (4, 2)}
    for name, t in mixed.items():
        layer = LAYER.search(name)
        reference = uniform[(4, 2)[int(layer.group(1))]] if layer else uniform[4]
        assert torch.equal(t, reference[name]), name
    record = json.loads((tmp_path / "mixed" / "uptrain.json").read_text())
    assert record["num_key_value_heads_per_layer"] == [4, 2] and record["calibration"]["tokens"] > 0


def test_a_layer_at_its_source_heads_is_copied_not_solved(tokenizer, calibration_text, tmp_path):
    """A calibrated allocation may keep a layer's every KV head (Whisper base at 1/4 with
    --cross-kv-weight kept the decoder's self-attention whole): that layer is the source's, bit for
    bit — the merge over groups of one head is the identity only in exact arithmetic (it divides by
    the queries' weakest directions) — and the other layer is the uniform merge at its G."""
    from tests.convert.test_calibrated import save as save_with_tokenizer
    from tests.convert.test_calibrated_classic import build as build_calibrated
    from uptrain.convert import convert_checkpoint

    src = save_with_tokenizer(build_calibrated("gpt2", tokenizer), tokenizer, tmp_path / "src")
    keys = dict(pooling="calibrated", calibration_data=str(calibration_text), calibration_tokens=512)
    keys |= dict(calibration_device="cpu", source_hash="none", progress=False)
    kept = tensors(convert_checkpoint(src, tmp_path / "kept", kv_heads_per_layer=f"{HEADS},2", **keys))
    merged = tensors(convert_checkpoint(src, tmp_path / "g2", 2, **keys))
    source = tensors(src)
    assert sorted(kept) == sorted(source)
    for name, t in kept.items():
        assert torch.equal(t, (source if ".h.0." in name else merged)[name]), name
    assert not torch.equal(merged["transformer.h.0.attn.c_attn.weight"], source["transformer.h.0.attn.c_attn.weight"])


def test_random_pooling_gives_a_kept_layer_fresh_heads_under_either_grouping(sources, tmp_path):
    """Only a whole-layer merge copies a layer kept at its source heads: row pooling pools it
    under similarity grouping as under contiguous, so `random` (the fresh-initialisation ablation)
    re-initialises it either way, as it does at a uniform G = kv."""
    src = sources("gpt2")
    key = "transformer.h.0.attn.c_attn.weight"
    source = tensors(src)[key]
    for grouping in ("contiguous", "similarity"):
        out = convert(
            src,
            tmp_path / grouping,
            "--kv-heads-per-layer",
            f"{HEADS},2",
            "--pooling",
            "random",
            "--grouping",
            grouping,
        )
        assert not torch.equal(tensors(out)[key], source), grouping


def test_encoder_decoder_similarity_takes_each_layers_g(tmp_path):
    """BART, similarity grouping in weight space over the decoder's two attentions: each layer's
    merge at its own G, as the uniform merge at that G."""
    model_class, config = MODELS["bart"]
    torch.manual_seed(0)
    src = tmp_path / "src"
    model_class(config()).save_pretrained(src)
    mixed = tensors(convert(src, tmp_path / "mixed", "--kv-heads-per-layer", "2,4/4,2", "--grouping", "similarity"))
    uniform = {g: tensors(convert(src, tmp_path / f"g{g}", "-g", g, "--grouping", "similarity")) for g in (2, 4)}
    allocation = {"self_attn": (2, 4), "encoder_attn": (4, 2)}
    for name, t in mixed.items():
        g = 2  # outside the decoder's attentions every conversion copies the source
        if m := re.fullmatch(rf"model\.decoder\.layers\.(\d+)\.({'|'.join(allocation)})\..*", name):
            g = allocation[m.group(2)][int(m.group(1))]
        assert torch.equal(t, uniform[g][name]), name


def test_a_budget_weighs_each_attentions_heads_by_its_head_dim():
    """BART's encoder (4 heads of 8) and cross-attention (8 heads of 4), two layers each: one G spends
    G × 8 and G × 4 per layer, so G = 2 is (2·8 + 2·4) / (4·8 + 8·4) = 3/8 of the source's bytes."""
    from uptrain import UptrainError
    from uptrain.convert.kv_heads import kv_fraction, resolve_allocation

    geometries = {
        "encoder": stack_geometry(
            {"model_type": "bart", "encoder_layers": 2, "encoder_attention_heads": 4, "d_model": 32},
            layers_key="encoder_layers",
            heads_key="encoder_attention_heads",
            kv_heads_key="encoder_num_key_value_heads",
            head_dim_key=None,
            hidden_key="d_model",
        ),
        "cross": stack_geometry(
            {"model_type": "bart", "decoder_layers": 2, "decoder_attention_heads": 8, "d_model": 32},
            layers_key="decoder_layers",
            heads_key="decoder_attention_heads",
            kv_heads_key="cross_attention_num_key_value_heads",
            head_dim_key=None,
            hidden_key="d_model",
        ),
    }
    chosen = ("encoder", "cross")
    assert resolve_allocation(geometries, chosen, KVHeadsRequest(budget=0.375)) == {"encoder": (2, 2), "cross": (2, 2)}
    assert kv_fraction(geometries, {"encoder": (4, 1), "cross": (8, 2)}) == Fraction(4 * 8 + 1 * 8 + 8 * 4 + 2 * 4, 128)
    with pytest.raises(
        UptrainError, match=r"no single G gives that fraction .*\(G=4: 0\.75, G=2: 0\.375, G=1: 0\.1875\)"
    ):
        resolve_allocation(geometries, chosen, KVHeadsRequest(budget=0.5))


def test_a_per_layer_checkpoint_pools_further_layer_by_layer(sources, capsys, tmp_path):
    """A 4,2 gpt2_gqa output converts again: each layer from its own heads (one G must divide both),
    and one G for every layer drops the list from config.json."""
    first = convert(sources("gpt2"), tmp_path / "first", "--kv-heads-per-layer", "4,2")
    again = convert(first, tmp_path / "again", "-g", 2, "--pooling", "first")
    config = json.loads((again / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and "num_key_value_heads_per_layer" not in config
    before, after = tensors(first), tensors(again)
    layer1 = [n for n in before if ".1." in n]
    assert layer1 and all(torch.equal(before[n], after[n]) for n in layer1)  # 2 → 2: the same bits
    k0 = kv_views("gpt2", "h.0.attn.c_attn.weight", before["transformer.h.0.attn.c_attn.weight"])[0]
    k0_after = kv_views("gpt2", "h.0.attn.c_attn.weight", after["transformer.h.0.attn.c_attn.weight"])[0]
    assert torch.equal(k0_after, k0[::2])  # `first` of each pair of layer 0's 4 heads
    record = json.loads((again / "uptrain.json").read_text())
    assert record["source_num_key_value_heads_per_layer"] == [4, 2] and record["kv_groups"]["0"] == [[0, 1], [2, 3]]
    from tests.convert.test_errors import fails

    expected = "--num-kv-heads 4 does not divide the checkpoint's current 2 KV heads in layer 1"
    fails(capsys, tmp_path, [first, "-g", 4], expected)


def test_convert_model_takes_the_same_three_ways():
    """`convert_model` as `uptrain convert`: one G however asked for is the same model, and exactly one way is given."""
    from tests.convert.tiny_models import build_model
    from uptrain import UptrainError
    from uptrain.convert import convert_model

    model = build_model("llama")
    by_g = convert_model(model, 2).state_dict()
    for asked in (dict(kv_heads_per_layer=[2, 2]), dict(kv_heads_per_layer="2,2"), dict(kv_budget=0.25)):
        converted = convert_model(model, **asked)
        assert converted.config.num_key_value_heads == 2
        assert all(torch.equal(t, by_g[n]) for n, t in converted.state_dict().items()), asked
    with pytest.raises(UptrainError, match="give exactly one of -g/--num-kv-heads G"):
        convert_model(model)
    with pytest.raises(UptrainError, match="Mistral cannot take its own KV heads per layer"):
        convert_model(build_model("mistral"), kv_heads_per_layer=[4, 2])


@pytest.mark.parametrize("typed", [0.333333, 0.3333, 0.0833333, 1 / 3])
def test_a_uniform_budget_takes_the_fraction_as_the_refusal_prints_it(typed):
    """The refusal of an unmet uniform budget prints each G's fraction to 6 digits (1/3 as
    0.333333): typed back, each is met (12 heads: 0.333333 is G = 4, 0.0833333 is G = 1)."""
    from uptrain.convert.kv_heads import resolve_allocation
    from uptrain.model_info import AttentionGeometry

    geometry = {"decoder-self": AttentionGeometry("gpt2", 2, 12, 12, 64, 768)}
    want = 1 if typed < 0.1 else 4
    assert resolve_allocation(geometry, ("decoder-self",), KVHeadsRequest(budget=typed)) == {
        "decoder-self": (want,) * 2
    }
    with pytest.raises(UptrainError, match=r"G=4: 0\.333333, .*G=1: 0\.0833333"):
        resolve_allocation(geometry, ("decoder-self",), KVHeadsRequest(budget=0.3))


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"kv_budget": 0.5, "allocation": "calibrate"}, "must be one of 'uniform', 'calibrated'"),
        ({"kv_budget": 0.0}, "kv_budget"),
        ({"num_kv_heads": 2, "kv_budget": 0.5}, "give exactly one of"),
    ],
)
def test_convert_model_checks_the_kv_head_keys_as_the_command_line_does(keys, message):
    """A mistyped allocation was silently uniform in convert_model; now every key is checked by the
    schema the flags come from."""
    from uptrain.convert.in_memory import convert_model

    with pytest.raises(UptrainError, match=message):
        convert_model(build("gpt2"), **keys)


def test_a_calibrated_allocation_without_kept_moments_is_one_line(tmp_path):
    """settle_allocation is handed a calibration that kept no moments: one line, not a KeyError."""
    from uptrain.convert.allocation import settle_allocation

    with pytest.raises(UptrainError, match="calibration moments kept whole"):
        settle_allocation(None, None, {})
