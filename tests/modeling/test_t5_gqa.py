"""T5 with grouped-query attention (`t5_gqa`, uptrain/modeling/modeling_t5_gqa.py): T5 v1.0
(ReLU), T5 v1.1 (gated GELU) and mT5; and UMT5 (`umt5_gqa`, modeling_umt5_gqa.py: a position
bias in every layer); each with its three attentions grouped on their own (encoder, decoder
self-attention, cross-attention).

- at G = h it is transformers' own T5 / mT5, bit for bit, on eager and SDPA;
- K/V heads made identical within each group pool losslessly into G heads;
- generation with the KV cache (self- and cross-attention caches at G heads) equals generation
  without it;
- `save_pretrained` of a loaded model carries its code: a fresh process without uptrain, under
  the installed transformers 5 and under transformers 4.57, loads it with `trust_remote_code`
  and computes the same logits and tokens, bit for bit;
- it trains.

The weights of the grouped models are sliced here, from transformers' own tensor layout (heads
are contiguous blocks of d_kv rows of `k` and `v`), independently of the converter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    MT5Config,
    MT5ForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

import uptrain.modeling  # noqa: F401  registers t5_gqa, as a user's `import uptrain` does
from tests.modeling.second_environment import transformers4_python
from uptrain.architecture.converted import modeling_files
from uptrain.convert import convert_checkpoint
from uptrain.modeling import CLASSES
from uptrain.modeling.attention import STACK_KV_HEADS
from uptrain.modeling.modeling_t5_gqa import T5GQAConfig, T5GQAForConditionalGeneration
from uptrain.modeling.modeling_umt5_gqa import UMT5GQAForConditionalGeneration

HEADS, VOCAB = 4, 64
SHARED = dict(
    vocab_size=VOCAB,
    d_model=32,
    num_heads=HEADS,
    num_layers=2,
    d_ff=48,
    dropout_rate=0.0,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
# Each family as its checkpoints on the Hub spell it (v1.1 and mT5: untied, unscaled output).
KINDS = {
    "t5": (T5Config, T5ForConditionalGeneration, dict(d_kv=8, feed_forward_proj="relu")),
    "t5-v1.1": (
        T5Config,
        T5ForConditionalGeneration,
        dict(d_kv=16, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    ),
    "mt5": (MT5Config, MT5ForConditionalGeneration, dict(d_kv=8, feed_forward_proj="gated-gelu")),
    "umt5": (
        UMT5Config,
        UMT5ForConditionalGeneration,
        dict(d_kv=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    ),
}
BACKENDS = ["eager", "sdpa"]
MHA = {attention: HEADS for attention in STACK_KV_HEADS}
DECODER_GROUPED = {"encoder": HEADS, "decoder-self": 2, "cross": 2}  # the paper's choice
ALL_GROUPED = {"encoder": 2, "decoder-self": 1, "cross": 2}


def gqa_type(kind: str) -> str:
    """The model_type of the GQA form of a family: UMT5 has modeling of its own."""
    return "umt5_gqa" if kind == "umt5" else "t5_gqa"


def build(kind: str, seed: int = 0, backend: str = "eager"):
    """transformers' own tiny T5 / mT5 / UMT5, with random norms (fresh ones are ones), position
    biases moved off their init, and a scale (`initializer_factor`) at which greedy generation
    depends on the input."""
    config_class, model_class, own = KINDS[kind]
    config = config_class(**SHARED, **own, initializer_factor=2.0, attn_implementation=backend)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or (kind == "umt5" and "relative_attention_bias" in name):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def attention_of(name: str) -> str | None:
    """Which attention a K or V weight of transformers' T5 belongs to."""
    if not name.endswith((".k.weight", ".v.weight")):
        return None
    if ".EncDecAttention." in name:
        return "cross"
    return "encoder" if name.startswith("encoder.") else "decoder-self"


def head_rows(weight: torch.Tensor, d_kv: int) -> torch.Tensor:
    """`[heads, d_kv, d_model]` view of a K or V weight: head i is rows i·d_kv … (i+1)·d_kv − 1."""
    return weight.view(-1, d_kv, weight.shape[-1])


def make_heads_identical(model, groups: dict[str, int]) -> None:
    """Every K and V head of each attention equal to the first head of its contiguous group."""
    d_kv = model.config.d_kv
    with torch.no_grad():
        for name, p in model.named_parameters():
            attention = attention_of(name)
            if attention is not None:
                heads, r = head_rows(p.data, d_kv), HEADS // groups[attention]
                for i in range(HEADS):
                    heads[i] = heads[(i // r) * r]


def gqa_twin(model, groups: dict[str, int], backend: str = "eager") -> T5GQAForConditionalGeneration:
    """A t5_gqa (umt5_gqa) model with the attentions' KV heads `groups`, holding `model`'s weights
    with each group's K/V the group's first head (the mean, where the heads are identical)."""
    umt5 = isinstance(model, UMT5ForConditionalGeneration)
    config_class, _, head_class = CLASSES["umt5_gqa" if umt5 else "t5_gqa"]
    config = model.config.to_dict()
    config.update({STACK_KV_HEADS[a]: g for a, g in groups.items()})
    if isinstance(model, MT5ForConditionalGeneration):
        # transformers' mT5 never rescales the decoder output (T5 does when tied): a converted
        # mT5's config says so.
        config["scale_decoder_outputs"] = False
    twin = head_class(config_class.from_dict(config, attn_implementation=backend)).eval()
    d_kv = model.config.d_kv
    state = {}
    for name, tensor in model.state_dict().items():
        attention = attention_of(name)
        if attention is not None:
            r = HEADS // groups[attention]
            tensor = head_rows(tensor, d_kv)[::r].reshape(-1, tensor.shape[-1])
        state[name] = tensor
    twin.load_state_dict(state)
    return twin


def inputs(seed: int = 1, batch: int = 2, source: int = 9, target: int = 6) -> dict[str, torch.Tensor]:
    """Source ids with right padding in one row (T5's tokenizer pads right), and decoder ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, source), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    ids[0, -3:] = 0
    decoder = torch.randint(2, VOCAB, (batch, target), generator=gen)
    decoder[:, 0] = 0  # the decoder start token
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}


def logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def greedy(model, batch: dict, use_cache: bool = True, new_tokens: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            eos_token_id=None,  # a fixed length: every step is compared
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_at_g_equal_h_it_is_transformers_t5(kind, backend):
    reference = build(kind, backend=backend)
    model = gqa_twin(reference, MHA, backend)
    assert model.config._attn_implementation == backend
    batch = inputs()
    assert torch.equal(logits(model, batch), logits(reference, batch))
    generated = greedy(model, batch)
    assert torch.equal(generated, greedy(reference, batch))
    assert len(set(generated[:, 1:].flatten().tolist())) > 3  # not one token repeated


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [DECODER_GROUPED, ALL_GROUPED], ids=["decoder-grouped", "all-grouped"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_identical_heads_pool_losslessly(kind, groups, backend):
    """In float32, within rounding: a grouped product sums in another order than h per-head
    ones, and T5's unscaled scores (logits ~70 here) amplify that to ~5e-6 of the logits' scale
    (identical heads are exact in float64, below)."""
    reference = build(kind, backend=backend)
    batch = inputs()
    before = logits(reference, batch)
    make_heads_identical(reference, groups)
    expected = logits(reference, batch)
    assert (expected - before).abs().max() > 1e-2  # the heads were different: the test can fail
    model = gqa_twin(reference, groups, backend)
    for attention, key in STACK_KV_HEADS.items():
        assert getattr(model.config, key) == groups[attention]
    k = model.decoder.block[1].layer[1].EncDecAttention.k.weight
    assert k.shape == (groups["cross"] * model.config.d_kv, model.config.d_model)
    got = logits(model, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * expected.abs().max().item())
    assert torch.equal(greedy(model, batch), greedy(reference, batch))


@pytest.mark.parametrize("groups", [DECODER_GROUPED, ALL_GROUPED], ids=["decoder-grouped", "all-grouped"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_identical_heads_pool_losslessly_in_float64(kind, groups):
    """The same in float64 (SDPA: uptrain's eager function takes its softmax in float32): equal
    to 1e-10, where a wrong head order or bias (one per query head) is off by ~1."""
    reference = build(kind, backend="sdpa")
    make_heads_identical(reference, groups)
    model = gqa_twin(reference, groups, "sdpa").double()
    reference = reference.double()
    batch = inputs()
    torch.testing.assert_close(logits(model, batch), logits(reference, batch), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generation_with_the_cache_equals_generation_without(kind):
    groups = {"encoder": 2, "decoder-self": 2, "cross": 1}
    model = gqa_twin(build(kind), groups)  # distinct heads: no MHA model computes the same
    batch = inputs()
    assert torch.equal(greedy(model, batch, use_cache=True), greedy(model, batch, use_cache=False))

    with torch.no_grad():
        cache = model(**batch, use_cache=True).cache
    b, s, t = batch["input_ids"].shape[0], batch["input_ids"].shape[1], batch["decoder_input_ids"].shape[1]
    d = model.config.d_kv
    for layer in range(model.config.num_decoder_layers):
        for stored in (cache.self_attention_cache.layers[layer].keys, cache.self_attention_cache.layers[layer].values):
            assert stored.shape == (b, groups["decoder-self"], t, d)
        for stored in (
            cache.cross_attention_cache.layers[layer].keys,
            cache.cross_attention_cache.layers[layer].values,
        ):
            assert stored.shape == (b, groups["cross"], s, d)


def test_the_config_checks_each_attention_s_heads():
    config = T5GQAConfig(**SHARED, d_kv=8, decoder_num_key_value_heads=2)
    assert (config.encoder_num_key_value_heads, config.num_key_value_heads) == (HEADS, 2)
    assert config.cross_attention_num_key_value_heads == HEADS
    with pytest.raises(ValueError, match="cross_attention_num_key_value_heads 3 does not divide"):
        T5GQAConfig(**SHARED, d_kv=8, cross_attention_num_key_value_heads=3)


@pytest.mark.parametrize("model_type", ["t5_gqa", "umt5_gqa"])
def test_the_base_model_groups_its_attentions_too(model_type):
    config_class, base_class, _ = CLASSES[model_type]
    config = config_class(**SHARED, d_kv=8, encoder_num_key_value_heads=1, decoder_num_key_value_heads=2)
    model = base_class(config)
    assert model.encoder.block[0].layer[0].SelfAttention.k.weight.shape == (8, 32)
    assert model.decoder.block[0].layer[0].SelfAttention.v.weight.shape == (16, 32)
    assert model.decoder.block[0].layer[1].EncDecAttention.v.weight.shape == (32, 32)
    out = model(**inputs()).last_hidden_state
    assert out.shape == (2, 6, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
@pytest.mark.parametrize("model_type", ["t5_gqa", "umt5_gqa"])
def test_backends_without_a_place_for_the_position_bias_are_refused(model_type, implementation):
    config_class, _, head_class = CLASSES[model_type]
    with pytest.raises(ValueError, match="does not support"):
        head_class(config_class(**SHARED, d_kv=8, attn_implementation=implementation))


@pytest.mark.parametrize("kind", ["t5-v1.1", "umt5"])
def test_a_few_training_steps_lower_the_loss(kind):
    model = gqa_twin(build(kind), ALL_GROUPED).train()
    batch = inputs()
    labels = batch.pop("decoder_input_ids")[:, 1:].contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    grad = model.decoder.block[0].layer[1].EncDecAttention.k.weight.grad
    assert grad.shape == (2 * model.config.d_kv, model.config.d_model) and grad.abs().sum() > 0
    # UMT5 learns a position bias in every self-attention layer, T5 in block 0 of each stack.
    biases = [p for n, p in model.named_parameters() if "relative_attention_bias" in n]
    assert len(biases) == (4 if kind == "umt5" else 2) and all(p.grad.abs().sum() > 0 for p in biases)
    assert losses[-1] < losses[0], losses


# Loads each folder with trust_remote_code on each backend; prints logits and greedy tokens.
# Run with `python -I` (nothing but the environment's own packages) under either transformers.
LOAD_WITHOUT_UPTRAIN = """
import json, sys
import torch, transformers
from transformers import AutoModelForSeq2SeqLM

spec = json.loads(open(sys.argv[1]).read())
batch = {k: torch.tensor(v) for k, v in spec["batch"].items()}
results = {}
for name, folder in spec["folders"].items():
    for backend in spec["backends"]:
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, attn_implementation=backend)
        model = model.eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        assert model.config._attn_implementation == backend, model.config._attn_implementation
        with torch.no_grad():
            logits = model(**batch).logits
            generated = model.generate(
                batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=spec["new_tokens"],
                do_sample=False, eos_token_id=None,
            )
        results[f"{name}/{backend}"] = {
            "logits": [float(x).hex() for x in logits.double().flatten().tolist()],
            "generated": generated.tolist(),
        }
assert not [m for m in sys.modules if m.split(".")[0] == "uptrain"], "uptrain was imported"
print(json.dumps({"transformers": transformers.__version__, "results": results}))
"""


@pytest.fixture(scope="module")
def resaved(tmp_path_factory):
    """Per family: a t5_gqa model (all three attentions grouped) saved, loaded back through
    uptrain's registered classes and saved again (the usual load-fine-tune-save); what that
    loaded model computes in this process on each backend; the spec for the fresh processes.
    Also a UMT5 converted by `convert_checkpoint` (its config.json the source's, edited)."""
    root = tmp_path_factory.mktemp("t5_gqa")
    batch = inputs()
    folders, expected = {}, {}

    def computed(loaded) -> dict:
        return {
            "logits": [float(x).hex() for x in logits(loaded, batch).double().flatten().tolist()],
            "generated": greedy(loaded, batch, new_tokens=6).tolist(),
        }

    source = build("umt5")
    source.lm_head.weight = torch.nn.Parameter(torch.randn_like(source.lm_head.weight))  # as UMT5 on the Hub
    source.save_pretrained(root / "umt5-source")
    folders["umt5-converted"] = str(
        convert_checkpoint(
            root / "umt5-source", root / "umt5-converted", 2, attention="encoder,decoder-self,cross", progress=False
        )
    )
    for backend in BACKENDS:
        converted = AutoModelForSeq2SeqLM.from_pretrained(folders["umt5-converted"], attn_implementation=backend)
        assert type(converted) is UMT5GQAForConditionalGeneration
        expected[f"umt5-converted/{backend}"] = computed(converted.eval())
    for kind in sorted(KINDS):
        made = gqa_twin(build(kind), ALL_GROUPED)
        if kind != "t5":
            # T5 v1.1, mT5 and UMT5 checkpoints have an `lm_head` of their own (not the embeddings).
            made.lm_head.weight = torch.nn.Parameter(torch.randn_like(made.lm_head.weight))
        made.save_pretrained(root / f"{kind}-made")
        for backend in BACKENDS:
            loaded = AutoModelForSeq2SeqLM.from_pretrained(root / f"{kind}-made", attn_implementation=backend).eval()
            assert type(loaded) is CLASSES[gqa_type(kind)][2]  # uptrain's class, not the file's
            if backend == BACKENDS[0]:
                loaded.save_pretrained(root / f"{kind}-resaved")
            expected[f"{kind}/{backend}"] = computed(loaded)
        folders[kind] = str(root / f"{kind}-resaved")
    spec = {
        "folders": folders,
        "batch": {k: v.tolist() for k, v in batch.items()},
        "backends": BACKENDS,
        "new_tokens": 6,
    }
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "load.py").write_text(LOAD_WITHOUT_UPTRAIN)
    return root, expected


def without_uptrain(python, root) -> dict:
    """What LOAD_WITHOUT_UPTRAIN prints, run by `python` in a fresh process that cannot import
    uptrain: isolated mode, no PYTHONPATH, its own (offline) Hugging Face cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(root / f"hf-{os.path.basename(os.path.dirname(str(python)))}"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [str(python), "-I", str(root / "load.py"), str(root / "spec.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_a_resaved_model_carries_its_code_and_loads_without_uptrain(resaved):
    root, expected = resaved
    for kind in KINDS:
        folder = root / f"{kind}-resaved"
        model_type = gqa_type(kind)
        for name, path in modeling_files(model_type).items():
            assert (folder / name).read_bytes() == path.read_bytes(), name
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == model_type
        # Made from a config of its own (no converter's `auto_map` to inherit): the head class's
        # marking writes its entries.
        config_class, _, head_class = CLASSES[model_type]
        assert config["auto_map"] == {
            "AutoConfig": f"modeling_{model_type}.{config_class.__name__}",
            "AutoModelForSeq2SeqLM": f"modeling_{model_type}.{head_class.__name__}",
        }
        assert {config[key] for key in STACK_KV_HEADS.values()} == {1, 2}
    got = without_uptrain(sys.executable, root)
    assert got["results"] == expected


def test_transformers_4_57_computes_the_same(resaved):
    python, versions = transformers4_python()
    root, expected = resaved
    got = without_uptrain(python, root)
    assert got["transformers"].startswith("4.57.") and got["transformers"] == versions["transformers"]
    assert sorted(got["results"]) == sorted(expected)
    for case, result in expected.items():
        for what in ("logits", "generated"):
            assert got["results"][case][what] == result[what], f"{case}: {what} differ under transformers 4.57"
