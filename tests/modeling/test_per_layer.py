"""Per-layer KV heads in every GQA modeling uptrain ships (issue #32): config.json's
`<kv_heads_key>_per_layer` lists, one entry per layer of that attention, the scalar key the
largest entry. For each family (GPT-2, GPT-NeoX, OPT, GPT-J, BLOOM, GPT-Neo, MPT, Falcon;
BART, mBART, Marian, M2M100, Pegasus, Whisper; T5, UMT5), at a mixed allocation (distinct lists
for the encoder, the decoder self-attention and the cross-attention):

- greedy `generate()` with the KV cache equals it without, token for token (and with a static
  cache, where transformers' own model of the family runs one), and the cache of layer l holds
  layer l's KV heads;
- the model is, layer by layer, the uniform modeling: each attention swapped for the one a
  uniform model with that layer's G builds, it computes the same logits and hidden states bit
  for bit; a per-layer list that is uniform ([G, G]) is the scalar-G model, bit for bit;
- `save_pretrained` → `from_pretrained` keeps the lists and the logits, under the installed
  transformers 5 and, without uptrain, under 4.57 (which writes the lists back when it saves);
- uptrain's own reader of config.json (`model_info.layer_kv_heads`, through the architecture
  record) gives the heads the modeling builds, and the KV bytes per token its cache holds;
- a bad list is refused in one line; a uniform config writes no list.

Tiny random models: decoder-only 8 heads of 8 dims, hidden 64; encoder–decoders 4 heads of 8
dims, d_model 32; 2 layers (each side).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import textwrap

import pytest
import torch
import transformers

import uptrain.modeling  # noqa: F401  registers the GQA classes, as a user's `import uptrain` does
from tests.modeling import test_bart_family_gqa as bart_family
from tests.modeling import test_t5_gqa as t5_family
from tests.modeling.classic_models import CONFIGS, SHARED, token_ids
from tests.modeling.second_environment import falcon_rewritten_between, transformers4_python
from uptrain.architecture import architecture, find_architecture
from uptrain.modeling import CLASSES
from uptrain.modeling.attention import STACK_KV_HEADS

DECODER_ONLY = sorted(CONFIGS)  # transformers' model_type of the source
BART_FAMILY = bart_family.NAMES
T5_FAMILY = ["t5", "umt5"]
FAMILIES = DECODER_ONLY + BART_FAMILY + T5_FAMILY
KV = "num_key_value_heads"
ENCODER, DECODER, CROSS = (STACK_KV_HEADS[a] for a in ("encoder", "decoder-self", "cross"))
# Mixed allocations: each attention its own list, so a layer (or an attention) given another's
# heads shows in the weights' shapes, the caches and the logits.
MIXED_DECODER_ONLY = {KV: [4, 1]}  # of 8 heads
MIXED_ENCODER_DECODER = {ENCODER: [4, 2], DECODER: [1, 2], CROSS: [2, 1]}  # of 4 heads
NEW_TOKENS = 8
# transformers' own Falcon fails with a static cache (its layers unpack a cache tuple) and its own
# GPT-Neo gives other tokens with one (the local window): not this modeling's to fix.
NO_STATIC_CACHE = {"falcon", "gpt_neo"}


def mixed(family: str) -> dict[str, list[int]]:
    return MIXED_DECODER_ONLY if family in DECODER_ONLY else MIXED_ENCODER_DECODER


def gqa_type(family: str) -> str:
    if family in T5_FAMILY:
        return t5_family.gqa_type(family)
    return architecture(family).modeling.model_type


def config_fields(family: str) -> dict:
    """The family's tiny config, KV heads aside, at a scale where greedy tokens depend on the input."""
    if family in DECODER_ONLY:
        return {**CONFIGS[family], **SHARED, "initializer_range": 0.5}
    if family in BART_FAMILY:
        return dict(bart_family.ARCHITECTURES[family][2])
    return {**t5_family.SHARED, **t5_family.KINDS[family][2], "initializer_factor": 2.0}


def gqa_config(family: str, kv_heads: dict[str, int | list[int]], backend: str = "eager"):
    """The family's GQA config with each attention's KV heads: an int is the scalar key alone (a
    uniform config, as before #32); a list goes under `<key>_per_layer`, its largest entry under
    the key (as a conversion writes it)."""
    fields = config_fields(family)
    for key, heads in kv_heads.items():
        if isinstance(heads, list):
            fields[key + "_per_layer"] = heads
            heads = max(heads)
        fields[key] = heads
    return CLASSES[gqa_type(family)][0](**fields, attn_implementation=backend)


def build(family: str, kv_heads: dict[str, int | list[int]], seed: int = 0):
    """A random GQA model with the task head, its biases and norms moved off their init too."""
    config = gqa_config(family, kv_heads)
    torch.manual_seed(seed)
    model = CLASSES[gqa_type(family)][2](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    if family == "umt5":
        # An `lm_head` of its own, as UMT5 on the Hub has: one tied to the embeddings is not in
        # the file, and 4.57 (which unties UMT5's) would load a fresh one (t5_family.py).
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    return model


def inputs(family: str) -> dict[str, torch.Tensor]:
    """A batch of 2 with padding in one row (and the decoder's first ids for an encoder–decoder)."""
    if family in BART_FAMILY:
        return bart_family.inputs(family)
    if family in T5_FAMILY:
        return t5_family.inputs()
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as generation pads
    return {"input_ids": ids, "attention_mask": mask}


def greedy(model, batch: dict[str, torch.Tensor], use_cache: bool, scores: bool = False, cache: str | None = None):
    """NEW_TOKENS greedy tokens after the batch (no end-of-sequence stop: every step compared),
    and with `scores` each step's scores too; transformers' GenerationMixin for every family
    (Whisper's own `generate` adds language and task handling these tiny models have no
    configuration for); `cache` a cache implementation ("static")."""
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        use_cache=use_cache,
        pad_token_id=model.config.pad_token_id,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        cache_implementation=cache,
    )
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, **batch, generation_config=config)
    return (out.sequences, torch.stack(out.scores)) if scores else out.sequences


def forward(model, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The logits and every hidden state (each stack's) of one forward pass without the cache."""
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True, use_cache=False)
    hidden = [*(out.get("encoder_hidden_states") or ()), *(out.get("decoder_hidden_states") or ())]
    return [out.logits, *(hidden or out.hidden_states)]


def attentions(model) -> dict[str, tuple[str, int]]:
    """Each GQA attention module's name → (the config key of its KV heads, its layer), told from
    the module's place (transformers' names), not from the modeling."""
    found = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("GQAAttention"):
            continue
        layer = int(re.search(r"\.(\d+)\.", name).group(1))
        if model.config.is_encoder_decoder:
            cross = "encoder_attn" in name or "EncDecAttention" in name
            in_encoder = re.search(r"(^|\.)encoder\.", name) is not None
            key = CROSS if cross else ENCODER if in_encoder else DECODER
        else:
            key = KV
        found[name] = (key, layer)
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_the_cache_equals_without_and_the_cache_holds_each_layer_s_heads(family):
    allocation = mixed(family)
    model = build(family, allocation)
    batch = inputs(family)
    (cached, cached_scores), (uncached, uncached_scores) = (greedy(model, batch, c, scores=True) for c in (True, False))
    assert torch.equal(cached, uncached)
    # Every step's scores too (some of these tiny models repeat a token, which says less): the
    # same up to float32 rounding, each step's attention being over keys of different extents.
    torch.testing.assert_close(cached_scores, uncached_scores, rtol=1e-4, atol=1e-4)
    if family not in NO_STATIC_CACHE:
        # A static cache allocates each layer at the first K/V it is given: its own heads.
        assert torch.equal(greedy(model, batch, True, cache="static"), cached)
    with torch.no_grad():
        cache = model(**batch, use_cache=True).cache
    b = batch["decoder_input_ids" if "decoder_input_ids" in batch else "input_ids"].shape
    if family in DECODER_ONLY:
        stores = [(cache.layers, allocation[KV], b[1])]
    else:
        source = model.config.max_source_positions if family == "whisper" else batch["input_ids"].shape[1]
        stores = [
            (cache.self_attention_cache.layers, allocation[DECODER], b[1]),
            (cache.cross_attention_cache.layers, allocation[CROSS], source),
        ]
    head_dim = 8
    for layers, heads, length in stores:
        assert len(layers) == len(heads) == 2
        for layer, g in zip(layers, heads):
            assert layer.keys.shape == layer.values.shape == (b[0], g, length, head_dim)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_is_the_uniform_modeling_of_its_heads(family):
    """The mixed model's logits and hidden states equal, bit for bit, a model whose every
    attention is the module a *uniform* model (scalar G, no list) builds for that place, G the
    test's own list entry for it, holding the mixed model's weights (loaded strictly: a layer
    built with other heads does not load)."""
    allocation = mixed(family)
    model = build(family, allocation)
    uniform = {g: build(family, dict.fromkeys(allocation, g)) for g in {g for gs in allocation.values() for g in gs}}
    places = attentions(model)
    assert len(places) == (2 if family in DECODER_ONLY else 6)
    reference = copy.deepcopy(uniform[max(uniform)])
    for name, (key, layer) in places.items():
        parent, _, child = name.rpartition(".")
        g = allocation[key][layer]
        setattr(reference.get_submodule(parent), child, copy.deepcopy(uniform[g].get_submodule(name)))
        assert model.get_submodule(name).num_key_value_heads == g
    reference.load_state_dict(model.state_dict(), strict=True)
    batch = inputs(family)
    got, expected = forward(model, batch), forward(reference, batch)
    assert len(got) == len(expected) >= 4
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # The layers differ: one G for every layer would not compute this.
    other = build(family, dict.fromkeys(allocation, max(uniform)))
    assert not torch.equal(forward(other, batch)[0], got[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_uniform_list_is_the_scalar_model_bit_for_bit(family):
    scalars = {KV: 2} if family in DECODER_ONLY else {ENCODER: 2, DECODER: 1, CROSS: 2}
    scalar = build(family, scalars)
    listed = build(family, {key: [g, g] for key, g in scalars.items()}, seed=1)
    assert [getattr(listed.config, key + "_per_layer") for key in scalars] == [[g, g] for g in scalars.values()]
    listed.load_state_dict(scalar.state_dict(), strict=True)
    batch = inputs(family)
    with torch.no_grad():
        assert torch.equal(listed(**batch).logits, scalar(**batch).logits)
    assert torch.equal(greedy(listed, batch, True), greedy(scalar, batch, True))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_uniform_config_writes_no_list(family, tmp_path):
    scalars = {KV: 2} if family in DECODER_ONLY else {ENCODER: 2, DECODER: 1, CROSS: 2}
    build(family, scalars).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert [key for key in saved if key.endswith("_per_layer")] == []
    assert [saved[key] for key in scalars] == list(scalars.values())


def per_layer_lists(config: dict) -> dict[str, list[int]]:
    return {key: value for key, value in config.items() if key.endswith("_per_layer")}


def expected_lists(family: str) -> dict[str, list[int]]:
    return {key + "_per_layer": heads for key, heads in mixed(family).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_keep_the_lists_and_the_logits(family, tmp_path):
    model = build(family, mixed(family))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert per_layer_lists(saved) == expected_lists(family)
    assert [saved[key] for key in mixed(family)] == [max(heads) for heads in mixed(family).values()]
    auto = getattr(transformers, find_architecture(gqa_type(family)).auto_class)
    loaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is type(model)
    assert per_layer_lists(loaded.config.to_dict()) == expected_lists(family)
    batch = inputs(family)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


# Run in a fresh process of the transformers 4.57 environment, without uptrain: load each saved
# folder from the code beside its weights, save its logits, greedy tokens (with and without the
# cache) and the lists of the config.json it writes when it saves the model again.
UNDER_4_57 = textwrap.dedent(
    """
    import json, sys, torch, transformers
    cases, new_tokens, destination = torch.load(sys.argv[1])
    results = {}
    for family, (folder, auto_class, batch) in cases.items():
        model = getattr(transformers, auto_class).from_pretrained(
            folder, trust_remote_code=True, attn_implementation="eager"
        ).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        tokens = []
        for use_cache in (True, False):
            config = transformers.GenerationConfig(
                max_new_tokens=new_tokens, do_sample=False, num_beams=1, use_cache=use_cache,
                pad_token_id=model.config.pad_token_id, eos_token_id=None,
            )
            with torch.no_grad():
                tokens.append(transformers.GenerationMixin.generate(model, **batch, generation_config=config))
        with torch.no_grad():
            logits = model(**batch).logits
        model.save_pretrained(folder + "-resaved")
        with open(folder + "-resaved/config.json") as f:
            written = json.load(f)
        lists = {k: v for k, v in written.items() if k.endswith("_per_layer")}
        results[family] = (logits, tokens[0], tokens[1], lists)
    assert not [m for m in sys.modules if m.split(".")[0] == "uptrain"], "uptrain was imported"
    torch.save((transformers.__version__, results), destination)
    """
)


def test_transformers_4_57_loads_the_lists_computes_the_same_and_writes_them_back(tmp_path):
    python, versions = transformers4_python()
    cases, expected = {}, {}
    for family in FAMILIES:
        model = build(family, mixed(family))
        folder = tmp_path / f"{family}-per-layer"  # unique: transformers caches remote code by folder name
        model.save_pretrained(folder)
        batch = inputs(family)
        cases[family] = (str(folder), find_architecture(gqa_type(family)).auto_class, batch)
        with torch.no_grad():
            expected[family] = (model(**batch).logits, greedy(model, batch, True))
    spec, out = tmp_path / "spec.pt", tmp_path / "results.pt"
    torch.save((cases, NEW_TOKENS, str(out)), spec)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [str(python), "-I", "-c", UNDER_4_57, str(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    version, results = torch.load(out)
    assert version.startswith("4.57.") and version == versions["transformers"]
    assert sorted(results) == sorted(FAMILIES)
    for family, (logits, cached, uncached, lists) in results.items():
        if family.startswith("falcon") and falcon_rewritten_between(version):
            torch.testing.assert_close(logits, expected[family][0], rtol=1e-5, atol=1e-5, msg=family)
        else:
            assert torch.equal(logits, expected[family][0]), f"{family}: logits differ under {version}"
        assert torch.equal(cached, expected[family][1]), f"{family}: tokens differ under {version}"
        assert torch.equal(cached, uncached), f"{family}: the cache changes the tokens under {version}"
        assert lists == expected_lists(family), f"{family}: {version} wrote {lists}"


def bad_lists(family: str) -> list[tuple[dict, str]]:
    """(config fields, what the one-line refusal says) for lists a config must refuse."""
    if family in DECODER_ONLY:
        key, heads = KV, 8
    else:
        key, heads = CROSS, 4  # another attention's list than the first one checked
    name = key + "_per_layer"
    return [
        ({name: [heads]}, rf"{name} has 1 entries for the .*'s 2 layers"),
        ({name: [heads, 1, 1]}, rf"{name} has 3 entries for the .*'s 2 layers"),
        ({name: [heads, 3]}, rf"{name}\[1\] = 3 does not divide the .*'s {heads} heads"),
        ({name: [heads, 0]}, rf"{name} must be a list of whole numbers >= 1"),
        ({name: [heads, "1"]}, rf"{name} must be a list of whole numbers >= 1"),
        ({name: heads}, rf"{name} must be a list of whole numbers >= 1"),
        ({name: [2, 1], key: heads}, rf"{key} {heads} is not the largest entry of {name} \[2, 1\]"),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bad_list_is_refused_in_one_line(family, tmp_path):
    config_class = CLASSES[gqa_type(family)][0]
    for fields, message in bad_lists(family):
        with pytest.raises(ValueError, match=message) as refused:
            config_class(**config_fields(family), **fields)
        assert "\n" not in str(refused.value)
    # As config.json gives it: loading refuses it the same way.
    config = json.loads(gqa_config(family, mixed(family)).to_json_string())
    key = next(iter(mixed(family)))
    config[key + "_per_layer"] = config[key + "_per_layer"][:1]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{key}_per_layer has 1 entries"):
        transformers.AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["gpt2", "bart", "t5"])
def test_a_list_alone_sets_the_scalar_to_its_largest_entry(family):
    config = CLASSES[gqa_type(family)][0](
        **config_fields(family), **{key + "_per_layer": heads for key, heads in mixed(family).items()}
    )
    assert [getattr(config, key) for key in mixed(family)] == [max(heads) for heads in mixed(family).values()]
    if family != "gpt2":  # an encoder–decoder's mirror: the decoder self-attention's scalar
        assert config.num_key_value_heads == max(MIXED_ENCODER_DECODER[DECODER])


@pytest.mark.parametrize("family", FAMILIES)
def test_uptrain_reads_the_heads_the_modeling_builds_and_the_bytes_its_cache_holds(family, tmp_path):
    """The saved config.json read by uptrain (`model_info.layer_kv_heads` through the
    architecture record's geometry) gives each layer the heads the modeling built it with, and
    KV bytes per token equal to what the cache holds (decoder self-attention: per decoded token;
    cross-attention: per source position), float32."""
    model = build(family, mixed(family))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    stacks = find_architecture(gqa_type(family)).stacks(config)
    built = {}
    for name, (key, layer) in attentions(model).items():
        built.setdefault(key, {})[layer] = model.get_submodule(name).num_key_value_heads
    for attention, stack in stacks.items():
        key = KV if family in DECODER_ONLY else STACK_KV_HEADS[attention]
        assert stack.geometry.layer_kv_heads() == tuple(mixed(family)[key])
        assert stack.geometry.layer_kv_heads() == tuple(built[key][layer] for layer in sorted(built[key]))
    batch = inputs(family)
    with torch.no_grad():
        cache = model(**batch, use_cache=True).cache
    caches = (
        {"decoder-self": cache}
        if family in DECODER_ONLY
        else {
            "decoder-self": cache.self_attention_cache,
            "cross": cache.cross_attention_cache,
        }
    )
    for attention, stored in caches.items():
        tensors = [t for layer in stored.layers for t in (layer.keys, layer.values)]
        batch_size, positions = tensors[0].shape[0], tensors[0].shape[2]
        measured = sum(t.numel() * t.element_size() for t in tensors) // (batch_size * positions)
        assert measured == stacks[attention].geometry.kv_cache_bytes_per_token(4)


@pytest.mark.parametrize("family", DECODER_ONLY)
def test_vllm_s_transformers_backend_is_refused_mixed_layers(family):
    """vLLM's transformers backend (attention implementation "vllm", which serves GPT-NeoX, OPT
    and GPT-J) gives every layer's cache one KV-head count: refused in one line before anything
    is built; a uniform list is not refused there (the refusal happens first, so the build fails
    later only on the implementation transformers does not know here)."""
    config = gqa_config(family, mixed(family))
    config._attn_implementation_internal = "vllm"
    with pytest.raises(ValueError, match=r"per-layer KV heads \[4, 1\] cannot serve in vLLM's transformers backend"):
        CLASSES[gqa_type(family)][2](config)
    uniform = gqa_config(family, {KV: [2, 2]})
    uniform._attn_implementation_internal = "vllm"
    with pytest.raises(Exception) as other:
        CLASSES[gqa_type(family)][2](uniform)
    assert "per-layer" not in str(other.value)
