"""uptrain's GQA modeling of BART, mBART, Marian, Whisper, M2M100 and Pegasus (bart_gqa,
mbart_gqa, marian_gqa, whisper_gqa, m2m_100_gqa, pegasus_gqa): at G = h each is transformers' own
model bit for bit, on eager and SDPA; with K/V heads identical within each group, a model with
G < h heads (its k/v rows sliced here, independently of the converter) computes the same logits;
both KV caches hold G heads; a saved model loads without uptrain, under the installed
transformers 5 and under 4.57, with the same logits and greedy tokens; training steps run and
reach every K/V projection.

Tiny real models: d_model 32, 4 heads of 8 dims, 2 layers each side, vocabulary 64.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import uptrain.modeling  # noqa: F401  registers bart_gqa, …: loads without trust_remote_code in-process
from tests.modeling.second_environment import transformers4_python
from uptrain.architecture import architecture
from uptrain.modeling import CLASSES

HEADS, HEAD_DIM, D_MODEL, VOCAB = 4, 8, 32, 64
SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=D_MODEL,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=HEADS,
    decoder_attention_heads=HEADS,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    init_std=0.5,  # large weights: greedy tokens depend on the context rather than repeat one
)
TEXT = dict(
    SEQ2SEQ, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2, forced_eos_token_id=None
)
# model_type → (transformers' config class, its model with the task head, its config fields)
ARCHITECTURES = {
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(TEXT, decoder_start_token_id=2)),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(TEXT, decoder_start_token_id=2)),
    "marian": ("MarianConfig", "MarianMTModel", dict(TEXT, decoder_start_token_id=1)),
    # M2M100 (and NLLB): scaled embeddings, positions counted from the padding token; no layer drop
    # (its default skips layers at random in training). Pegasus's decoder starts from padding.
    "m2m_100": (
        "M2M100Config",
        "M2M100ForConditionalGeneration",
        dict(TEXT, decoder_start_token_id=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0),
    ),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", dict(TEXT, decoder_start_token_id=1)),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            SEQ2SEQ,
            num_mel_bins=8,
            max_source_positions=8,  # 16 input frames (the convolutions halve them)
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
    ),
}
NAMES = sorted(ARCHITECTURES)
BACKENDS = ["eager", "sdpa"]
KV_KEYS = {
    "encoder": "encoder_num_key_value_heads",
    "decoder-self": "decoder_num_key_value_heads",
    "cross": "cross_attention_num_key_value_heads",
}
NEW_TOKENS = 8


def reference(name: str, backend: str = "eager", seed: int = 0):
    """transformers' own model of the architecture, random, its biases and norms randomised too
    (fresh ones are zeros and ones)."""
    config_class, model_class, fields = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**fields, attn_implementation=backend)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("bias") or "layer_norm" in key or "layernorm" in key:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def gqa_model(name: str, kv_heads: dict[str, int], backend: str = "eager", seed: int = 0, **fields):
    """uptrain's GQA model of the architecture (random), `kv_heads` per attention (others MHA);
    `fields` override the config's."""
    modeling = architecture(name).modeling
    config_class, _, head_class = CLASSES[modeling.model_type]
    fields = dict(ARCHITECTURES[name][2], **{KV_KEYS[a]: g for a, g in kv_heads.items()}, **fields)
    torch.manual_seed(seed)
    return head_class(config_class(**fields, attn_implementation=backend)).eval()


def grouped_model(name: str, kv_heads: dict[str, int], backend: str = "eager"):
    """A GQA model with `reference`'s weights, all but the first K/V head of each group dropped."""
    gqa = gqa_model(name, kv_heads, backend)
    gqa.load_state_dict(sliced_state_dict(reference(name, backend), kv_heads), strict=True)
    return gqa


def attention_of(key: str) -> str | None:
    """Which attention a K/V parameter belongs to ("encoder", "decoder-self", "cross"), or None."""
    if ".k_proj." not in key and ".v_proj." not in key:
        return None
    if ".encoder_attn." in key:
        return "cross"
    return "encoder" if ".encoder.layers." in key else "decoder-self"


def make_heads_identical(model, kv_heads: dict[str, int]) -> None:
    """In each attention of `kv_heads`, every K and V head equal to the first of its contiguous group."""
    with torch.no_grad():
        for key, p in model.named_parameters():
            attention = attention_of(key)
            if attention in kv_heads:
                heads = p.data.view(HEADS, HEAD_DIM, *p.shape[1:])
                r = HEADS // kv_heads[attention]
                for i in range(HEADS):
                    heads[i] = heads[(i // r) * r]


def sliced_state_dict(model, kv_heads: dict[str, int]) -> dict[str, torch.Tensor]:
    """`model`'s weights with the K/V rows of the first head of each group only."""
    state = {}
    for key, p in model.state_dict().items():
        attention = attention_of(key)
        if attention in kv_heads:
            r = HEADS // kv_heads[attention]
            p = p.view(HEADS, HEAD_DIM, *p.shape[1:])[::r].reshape(-1, *p.shape[1:])
        state[key] = p.clone()
    return state


def inputs(name: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch of 2: the encoder's input (token ids with left padding in one row, or log-mel
    features) and decoder input ids."""
    gen = torch.Generator().manual_seed(seed)
    # Begun by the decoder start token, as generate() expects (it prepends one otherwise, except
    # for Whisper: test_whisper_keeps_a_decoder_prompt_as_given).
    decoder = torch.randint(3, VOCAB, (2, 6), generator=gen)
    decoder[:, 0] = ARCHITECTURES[name][2]["decoder_start_token_id"]
    batch = {"decoder_input_ids": decoder}
    if name == "whisper":
        batch["input_features"] = torch.randn(2, 8, 16, generator=gen)
    else:
        batch["input_ids"] = torch.randint(3, VOCAB, (2, 10), generator=gen)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, :3] = 0
    return batch


def encoder_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "decoder_input_ids"}


def greedy(model, batch: dict[str, torch.Tensor], use_cache: bool):
    """Greedy continuation of the batch's decoder input ids (no end-of-sequence stop): the
    generated sequences and the scores of each step. Whisper's `generate` adds language, task
    and timestamp handling that these tiny models have no configuration for: plain greedy
    decoding (transformers' GenerationMixin) is what is compared, for every architecture."""
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        pad_token_id=model.config.pad_token_id,
        use_cache=use_cache,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, **batch, generation_config=config)
    return out.sequences, torch.stack(out.scores)


# Test the grouping with different counts per attention: a cache of the wrong attention's G shows.
GROUPED = {"decoder-self": 2, "cross": 1}
ALL_GROUPED = {"encoder": 2, "decoder-self": 2, "cross": 1}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_g_equal_h_is_transformers_model_bit_for_bit(name, backend):
    ref = reference(name, backend)
    gqa = gqa_model(name, {}, backend)
    assert gqa.config._attn_implementation == backend
    assert [getattr(gqa.config, key) for key in KV_KEYS.values()] == [HEADS] * 3
    gqa.load_state_dict(ref.state_dict(), strict=True)
    batch = inputs(name)
    with torch.no_grad():
        assert torch.equal(gqa(**batch).logits, ref(**batch).logits)
        if "attention_mask" in batch:  # and without padding, where transformers passes no mask
            unpadded = {k: v for k, v in batch.items() if k != "attention_mask"}
            assert torch.equal(gqa(**unpadded).logits, ref(**unpadded).logits)
    for got, expected in zip(greedy(gqa, batch, use_cache=True), greedy(ref, batch, use_cache=True)):
        assert torch.equal(got, expected)


@pytest.mark.slow  # inductor compiles flex attention's kernels on CPU: ~30 s per architecture
@pytest.mark.parametrize("name", NAMES)
def test_flex_attention_serves_it_too(name):
    """Flex attention (transformers' function, through the same interface): at G = h
    transformers' own model on flex bit for bit; grouped, the eager model's logits to float noise."""
    ref, gqa = reference(name, "flex_attention"), gqa_model(name, {}, "flex_attention")
    gqa.load_state_dict(ref.state_dict(), strict=True)
    batch = inputs(name)
    with torch.no_grad():
        assert torch.equal(gqa(**batch).logits, ref(**batch).logits)
        flex, eager = (grouped_model(name, ALL_GROUPED, backend) for backend in ("flex_attention", "eager"))
        torch.testing.assert_close(flex(**batch).logits, eager(**batch).logits, rtol=1e-4, atol=1e-4)


def test_whisper_keeps_a_decoder_prompt_as_given():
    """transformers' generation puts the decoder start token before decoder ids that lack it,
    except for `model_type` "whisper", whose prompts begin with <|startofprev|>: whisper_gqa
    too."""
    ref, gqa = reference("whisper"), gqa_model("whisper", {})
    gqa.load_state_dict(ref.state_dict(), strict=True)
    batch = inputs("whisper")
    batch["decoder_input_ids"][:, 0] = 5  # not the decoder start token (1)
    for got, expected in zip(greedy(gqa, batch, use_cache=True), greedy(ref, batch, use_cache=True)):
        assert torch.equal(got, expected)
    assert greedy(gqa, batch, use_cache=True)[0].shape == (2, 6 + NEW_TOKENS)


def test_whispers_own_generate_runs_it_as_whisper():
    """Whisper's `generate` (its short-form path; a minimal generation config, no language or
    task tokens) gives whisper_gqa at G = h the tokens it gives transformers' Whisper."""
    ref, gqa = reference("whisper"), gqa_model("whisper", {})
    gqa.load_state_dict(ref.state_dict(), strict=True)
    features = inputs("whisper")["input_features"]
    tokens = []
    for model in (ref, gqa, grouped_model("whisper", ALL_GROUPED)):
        model.generation_config = transformers.GenerationConfig(
            decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, max_length=NEW_TOKENS + 1
        )
        with torch.no_grad():
            tokens.append(model.generate(features))
    assert torch.equal(tokens[0], tokens[1]) and tokens[2].shape == tokens[0].shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [GROUPED, ALL_GROUPED], ids=["decoder-self+cross", "all"])
@pytest.mark.parametrize("name", NAMES)
def test_identical_heads_in_each_group_pool_losslessly(name, kv_heads, backend):
    # In float64: G heads and h heads order their float sums differently, which float32 shows at
    # the tolerance's edge after four layers (M2M100's scaled embeddings); float64's ~1e-13 do not.
    ref = reference(name, backend).double()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in inputs(name).items()}
    gqa = gqa_model(name, kv_heads, backend).double()
    gqa.load_state_dict(sliced_state_dict(ref, kv_heads), strict=True)
    with torch.no_grad():
        # Distinct heads: dropping all but one per group changes the model (the check can fail).
        assert not torch.allclose(gqa(**batch).logits, ref(**batch).logits, atol=1e-3)
        make_heads_identical(ref, kv_heads)
        gqa.load_state_dict(sliced_state_dict(ref, kv_heads), strict=True)
        torch.testing.assert_close(gqa(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_generation_with_the_cache_holds_g_heads_and_equals_generation_without(name):
    gqa = grouped_model(name, ALL_GROUPED)
    batch = inputs(name)
    with torch.no_grad():
        cache = gqa(**batch, use_cache=True).past_key_values
    for i in range(2):
        assert cache.self_attention_cache.layers[i].keys.shape == (2, 2, 6, HEAD_DIM)
        assert cache.self_attention_cache.layers[i].values.shape == (2, 2, 6, HEAD_DIM)
        source = 8 if name == "whisper" else 10
        assert cache.cross_attention_cache.layers[i].keys.shape == (2, 1, source, HEAD_DIM)
        assert cache.cross_attention_cache.layers[i].values.shape == (2, 1, source, HEAD_DIM)
    (cached, cached_scores), (uncached, uncached_scores) = greedy(gqa, batch, True), greedy(gqa, batch, False)
    assert cached.shape == (2, 6 + NEW_TOKENS)
    assert torch.equal(cached, uncached)
    # The same scores up to float32 rounding: the two compute each step's attention over keys of different extents.
    torch.testing.assert_close(cached_scores, uncached_scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_training_steps_reach_every_kv_projection(name):
    gqa = gqa_model(name, ALL_GROUPED, init_std=0.02).train()  # transformers' usual initialisation
    batch = inputs(name)
    labels = batch["decoder_input_ids"]
    optimizer = torch.optim.AdamW(gqa.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        loss = gqa(**encoder_inputs(batch), labels=labels).loss
        loss.backward()
        if step == 0:
            kv = {key: p.grad for key, p in gqa.named_parameters() if attention_of(key) and key.endswith("weight")}
            assert len(kv) == 2 * 2 * 3  # K and V of 2 layers × 3 attentions
            assert all(g is not None and g.abs().sum() > 0 for g in kv.values())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_converted_checkpoint_loads_with_its_auto_class(name, tmp_path):
    """`uptrain convert` of transformers' model: at G = h its logits bit for bit; with identical
    heads in each group, pooled over every attention to G = 2 (of 4), the same logits."""
    from uptrain.convert import convert_checkpoint

    ref = reference(name)
    ref.save_pretrained(tmp_path / "src")
    auto = getattr(transformers, architecture(name).auto_class)
    batch = inputs(name)
    out = convert_checkpoint(tmp_path / "src", tmp_path / "g4", HEADS, progress=False)
    same = auto.from_pretrained(out, attn_implementation="eager")
    assert type(same).__name__ == CLASSES[architecture(name).modeling.model_type][2].__name__
    with torch.no_grad():
        assert torch.equal(same.eval()(**batch).logits, ref(**batch).logits)
    make_heads_identical(ref, dict.fromkeys(KV_KEYS, 2))
    ref.save_pretrained(tmp_path / "identical")
    out = convert_checkpoint(
        tmp_path / "identical", tmp_path / "g2", 2, attention="encoder,decoder-self,cross", progress=False
    )
    pooled = auto.from_pretrained(out, attn_implementation="eager").eval()
    assert [getattr(pooled.config, key) for key in KV_KEYS.values()] == [2, 2, 2]
    with torch.no_grad():
        torch.testing.assert_close(pooled(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)


# Run in a fresh process without uptrain (the 5.x venv, or the 4.57 one): load each saved folder
# from the code beside its weights and save its logits and greedy tokens, per backend.
LOAD_WITHOUT_UPTRAIN = textwrap.dedent(
    """
    import sys, torch, transformers
    cases, backends, new_tokens, destination = torch.load(sys.argv[1])
    results = {}
    for name, (folder, auto_class, batch) in cases.items():
        for backend in backends:
            model = getattr(transformers, auto_class).from_pretrained(
                folder, trust_remote_code=True, attn_implementation=backend
            ).eval()
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            assert model.config._attn_implementation == backend
            config = transformers.GenerationConfig(
                max_new_tokens=new_tokens, do_sample=False, num_beams=1, use_cache=True,
                pad_token_id=model.config.pad_token_id, return_dict_in_generate=True, output_scores=True,
            )
            with torch.no_grad():
                logits = model(**batch).logits
                out = transformers.GenerationMixin.generate(model, **batch, generation_config=config)
            results[f"{name}/{backend}"] = (logits, out.sequences, torch.stack(out.scores))
    assert not [m for m in sys.modules if m.split(".")[0] == "uptrain"], "uptrain was imported"
    torch.save((transformers.__version__, results), destination)
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each architecture's GQA model (every attention grouped), saved, loaded through uptrain's
    registered Auto classes and saved again (the usual load–fine-tune–save); its logits and
    greedy tokens in this process. Folder names are unique per architecture: transformers caches
    remote code by the folder's name."""
    root = tmp_path_factory.mktemp("bart_family")
    cases, expected = {}, {}
    for name in NAMES:
        auto_class = architecture(name).auto_class
        grouped_model(name, ALL_GROUPED).save_pretrained(root / f"{name}-first")
        loaded = getattr(transformers, auto_class).from_pretrained(root / f"{name}-first")
        assert type(loaded).__module__ == f"uptrain.modeling.{architecture(name).modeling.module}"
        loaded.save_pretrained(root / f"{name}-gqa")
        assert {f"{architecture(name).modeling.module}.py", "attention.py"} <= {
            p.name for p in (root / f"{name}-gqa").iterdir()
        }
        batch = inputs(name)
        cases[name] = (str(root / f"{name}-gqa"), auto_class, batch)
        for backend in BACKENDS:
            model = getattr(transformers, auto_class).from_pretrained(root / f"{name}-gqa", attn_implementation=backend)
            with torch.no_grad():
                logits = model.eval()(**batch).logits
            expected[f"{name}/{backend}"] = (logits, *greedy(model, batch, use_cache=True))
    return root, cases, expected


def load_without_uptrain(python, root, cases, label: str):
    spec, out = root / f"spec-{label}.pt", root / f"results-{label}.pt"
    torch.save((cases, BACKENDS, NEW_TOKENS, str(out)), spec)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(root / f"hf-{label}"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [str(python), "-I", "-c", LOAD_WITHOUT_UPTRAIN, str(spec)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def assert_same(results: dict, expected: dict, version: str, sdpa_scores_exact: bool = True) -> None:
    assert sorted(results) == sorted(expected) == sorted(f"{n}/{b}" for n in NAMES for b in BACKENDS)
    for case, (logits, tokens, scores) in expected.items():
        assert torch.equal(results[case][0], logits), f"{case}: logits differ under transformers {version}"
        assert torch.equal(results[case][1], tokens), f"{case}: tokens differ under transformers {version}"
        if sdpa_scores_exact or not case.endswith("/sdpa"):
            assert torch.equal(results[case][2], scores), f"{case}: generation scores differ under {version}"
        else:
            torch.testing.assert_close(results[case][2], scores, rtol=0, atol=1e-5, msg=f"{case} under {version}")


def test_a_saved_model_loads_without_uptrain(saved):
    root, cases, expected = saved
    version, results = load_without_uptrain(sys.executable, root, cases, "5")
    assert version == transformers.__version__
    assert_same(results, expected, version)


def test_transformers_4_57_gives_the_same_logits_and_tokens(saved):
    python, versions = transformers4_python()
    root, cases, expected = saved
    version, results = load_without_uptrain(python, root, cases, "4")
    assert version.startswith("4.57.") and version == versions["transformers"]
    # Decoding one token at a time with grouped K/V and a padding mask, transformers 5's SDPA
    # function packs each group's queries into one (`pack_gqa`) where 4.57's repeats K/V: the same
    # attention in a different order of float operations, for transformers' native GQA models
    # too. Everything else, and every eager result, is bit for bit.
    assert_same(results, expected, version, sdpa_scores_exact=False)
