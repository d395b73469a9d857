"""A Llama with each layer's own KV heads, in the DeciLM / Nemotron-NAS layout engines serve
(`uptrain/architecture/decilm.py`, `uptrain/modeling/modeling_decilm.py`): every layer uniform
is transformers' Llama bit for bit; a mixed allocation is the Llama whose K/V heads repeat within
each layer's groups; `generate()` with the cache equals without, and the cache holds each layer's
heads; the checkpoint loads without uptrain (`trust_remote_code=True`) under transformers 5 and
4.57 with the same logits and tokens; vLLM serves it with its own DeciLMForCausalLM, transformers'
greedy tokens, each layer's heads in its cache and the capacity they give."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import uptrain.modeling  # noqa: F401  registers nemotron-nas: the in-process side loads without trust_remote_code
from tests.modeling import load_without_uptrain
from tests.modeling.second_environment import transformers4_python
from tests.modeling.test_transformers_versions import run_in
from tests.modeling.vllm_environment import served as vllm_served
from uptrain import UptrainError
from uptrain.architecture import architecture, find_architecture, modeling_of
from uptrain.architecture.converted import copy_modeling_files, native_per_layer_config
from uptrain.architecture.decilm import block_configs, check_decilm, engine_ffn_width, ffn_mult_for
from uptrain.model_info import layer_kv_heads
from uptrain.modeling import modeling_decilm, per_layer_counterpart
from uptrain.modeling.modeling_decilm import DeciLMConfig, DeciLMForCausalLM

BACKENDS = ["eager", "sdpa"]
ALLOCATIONS = {"4-2": (4, 2), "2-1": (2, 1)}


def llama_config(kv_heads: int = 4, intermediate: int = 256) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        # Not transformers' default base: a 4.x reader that missed rope_parameters would rotate
        # at 10000 and give other logits.
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=False,
    )


def decilm(kv_heads: tuple[int, ...], intermediate: int = 256) -> DeciLMForCausalLM:
    torch.manual_seed(0)
    source = llama_config(intermediate=intermediate).to_dict()
    config = DeciLMConfig.from_dict(native_per_layer_config(source, kv_heads))
    model = DeciLMForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that wrong heads change the tokens
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    return model


def token_ids() -> torch.Tensor:
    return torch.tensor([[5, 17, 3, 99, 42, 8, 64, 2, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9]])


def repeated_heads(model: DeciLMForCausalLM) -> LlamaForCausalLM:
    """transformers' Llama with every layer at the query heads' KV heads (MHA), each KV head of
    `model` repeated over its group: the model `model` is."""
    config = model.config
    llama = LlamaForCausalLM(llama_config(kv_heads=config.num_attention_heads)).eval()
    state = model.state_dict()
    for layer in range(config.num_hidden_layers):
        group = config.num_attention_heads // config.layer_kv_heads(layer)
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            heads = state[key].view(config.layer_kv_heads(layer), -1, config.hidden_size)
            state[key] = heads.repeat_interleave(group, dim=0).reshape(-1, config.hidden_size)
    llama.load_state_dict(state)
    return llama


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_blocks_are_transformers_llama(backend):
    model = decilm((2, 2))
    llama = LlamaForCausalLM(llama_config(kv_heads=2)).eval()
    llama.load_state_dict(model.state_dict())  # the same tensor names and shapes
    model.set_attn_implementation(backend)
    llama.set_attn_implementation(backend)
    with torch.no_grad():
        assert torch.equal(model(token_ids()).logits, llama(token_ids()).logits)


@pytest.mark.parametrize("kv_heads", ALLOCATIONS.values(), ids=ALLOCATIONS)
def test_each_layer_attends_with_its_own_heads(kv_heads):
    """Layer l's KV heads, repeated over its groups in an MHA Llama, give the same model."""
    model = decilm(kv_heads)
    assert [layer.self_attn.k_proj.out_features // 16 for layer in model.model.layers] == list(kv_heads)
    with torch.no_grad():
        got, expected = model(token_ids()).logits, repeated_heads(model)(token_ids()).logits
    assert torch.equal(got, expected)
    other = decilm((kv_heads[1], kv_heads[0]))  # the same weights' seed, layers swapped: another model
    with torch.no_grad():
        assert not torch.allclose(other(token_ids()).logits, got, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", ALLOCATIONS.values(), ids=ALLOCATIONS)
def test_generate_with_the_cache_equals_without(kv_heads, backend):
    model = decilm(kv_heads)
    model.set_attn_implementation(backend)
    ids = token_ids()
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **settings)
        uncached = model.generate(ids, use_cache=False, **settings)
        out = model(ids, use_cache=True)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, ids.shape[1] :].flatten().tolist())) > 3  # not one token repeated
    cache = out.past_key_values
    for layer, kv in enumerate(kv_heads):
        assert cache.layers[layer].keys.shape == (2, kv, ids.shape[1], 16)
        assert cache.layers[layer].values.shape == (2, kv, ids.shape[1], 16)


def test_the_config_is_the_engines_layout():
    """block_configs is what vLLM and llama.cpp read; the contract's list and the bound beside it."""
    config = native_per_layer_config(llama_config().to_dict(), (4, 2))
    assert config["model_type"] == "nemotron-nas" and config["architectures"] == ["DeciLMForCausalLM"]
    assert config["num_key_value_heads"] == 4 and config["num_key_value_heads_per_layer"] == [4, 2]
    assert [b["attention"]["n_heads_in_group"] for b in config["block_configs"]] == [1, 2]
    ffn = {"ffn_mult": 6.0, "no_op": False, "replace_with_linear": False}  # 2 · 6 · 64 / 3 = 256
    assert [b["ffn"] for b in config["block_configs"]] == [ffn, ffn]
    assert layer_kv_heads(config, "num_key_value_heads", 2, 4) == (4, 2)
    # llama.cpp's converter (DeciModel, not installed here) asserts an int n_heads_in_group and a
    # float ffn_mult per block, and reads these top-level keys.
    for block in config["block_configs"]:
        assert type(block["attention"]["n_heads_in_group"]) is int and type(block["ffn"]["ffn_mult"]) is float
    assert all(k in config for k in ("hidden_size", "max_position_embeddings", "rms_norm_eps", "vocab_size"))
    check_decilm(config)
    loaded = DeciLMConfig.from_dict(config)
    # vLLM reads the blocks by attribute (`block.attention.n_heads_in_group`, `hasattr(ffn, "ffn_mult")`).
    assert loaded.block_configs[1].attention.n_heads_in_group == 2 and hasattr(loaded.block_configs[1].ffn, "ffn_mult")
    assert json.loads(loaded.to_json_string())["block_configs"] == config["block_configs"]
    assert find_architecture("nemotron-nas") is architecture("llama")
    assert modeling_of("nemotron-nas").module == "modeling_decilm" and modeling_of("llama") is None


@pytest.mark.parametrize(
    "intermediate,hidden,mult",
    [(11008, 4096, 4.03125), (14336, 4096, 5.25), (28672, 8192, 5.25), (5632, 2048, 4.125), (1536, 576, 4.0)],
)
def test_published_llama_widths_are_reached_through_ffn_mult(intermediate, hidden, mult):
    """Llama 2 7B, Llama 3 8B and 70B, TinyLlama, SmolLM: widths that are multiples of 256."""
    assert ffn_mult_for(intermediate, hidden) == mult and engine_ffn_width(mult, hidden) == intermediate


def test_a_width_the_engines_cannot_reach_is_written_as_intermediate_size():
    """The reference Llama's MLP (704 of hidden 256) is no multiple of 256: no ffn_mult gives it
    (the engines round 2·m·256/3 up to 512 or 768), so the block states its width."""
    assert ffn_mult_for(704, 256) is None
    assert {engine_ffn_width(m / 100, 256) for m in range(250, 350)} == {512, 768}
    (block,) = block_configs((2,), 4, 704, 256)
    assert block["ffn"] == {"intermediate_size": 704, "no_op": False, "replace_with_linear": False}
    model = decilm((4, 2), intermediate=176)
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == [176, 176]


def test_configs_uptrain_did_not_write_are_refused():
    config = native_per_layer_config(llama_config().to_dict(), (4, 2))
    with pytest.raises(ValueError, match=r"num_key_value_heads_per_layer \[2, 2\] is not the KV heads"):
        DeciLMConfig.from_dict({**config, "num_key_value_heads_per_layer": [2, 2]})
    nas = {**config, "block_configs": [{**config["block_configs"][0], "attention": {"no_op": True}}] * 2}
    with pytest.raises(ValueError, match="no attention or MLP"):
        DeciLMConfig.from_dict(nas)
    for bad, message in (
        (nas, r"block_configs\[0\] replaces its attention or MLP"),
        ({**config, "num_key_value_heads_per_layer": [4, 4]}, r"n_heads_in_group is 2, which is not 4 heads"),
        ({k: v for k, v in config.items() if k != "num_key_value_heads_per_layer"}, "is not a layout uptrain wrote"),
        ({**config, "intermediate_size": 512}, r"an MLP of 256 columns, not intermediate_size 512"),
    ):
        with pytest.raises(UptrainError, match=message) as err:
            architecture("nemotron-nas").stacks(bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "phi3", "gemma"])
def test_other_native_families_refuse_a_per_layer_output_in_one_line(model_type):
    with pytest.raises(UptrainError, match="cannot take its own KV heads per layer") as err:
        native_per_layer_config({"model_type": model_type, "num_attention_heads": 4}, (4, 2))
    assert "\n" not in str(err.value) and architecture(model_type).per_layer_refusal in str(err.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each allocation saved as a conversion writes it: config.json, weights, modeling files."""
    root = tmp_path_factory.mktemp("decilm")
    folders = {}
    for name, kv_heads in ALLOCATIONS.items():
        folder = root / f"decilm-{name}"
        decilm(kv_heads).save_pretrained(folder)
        copy_modeling_files("nemotron-nas", folder)
        folders[name] = str(folder)
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    spec = {"folders": folders, "ids": ids.tolist(), "mask": mask.tolist(), "backends": BACKENDS, "new_tokens": 8}
    (root / "spec.json").write_text(json.dumps(spec))
    expected = load_without_uptrain.results(
        spec, lambda folder, backend: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend)
    )
    return root, expected


def test_loads_without_uptrain_under_transformers_5(saved):
    root, expected = saved
    found = run_in(sys.executable, root)
    assert found["results"] == expected


def test_loads_without_uptrain_under_transformers_4_57(saved):
    root, expected = saved
    python, versions = transformers4_python()
    found = run_in(python, root)
    assert found["transformers"].startswith("4.57.") and found["transformers"] == versions["transformers"]
    assert found["results"] == expected
    for name, kv_heads in ALLOCATIONS.items():  # 4.57's cache holds each layer's heads too
        assert [shape[1] for shape in found["results"][f"{name}/eager"]["cache"]] == list(kv_heads)


# vLLM (the cached CPU build) serves the layout with its own DeciLMForCausalLM: the MLP width
# through ffn_mult (256 of hidden 128) and through intermediate_size (192, no multiple of 256).
# vLLM's CPU attention takes head sizes of 32 and up: 4 heads of 32 here.
SERVED_WIDTHS = {"decilm-ffn-mult": 256, "decilm-intermediate-size": 192}
SERVED_HEADS = (4, 1)
PROMPTS = [[5, 17, 99, 42, 8, 61, 23, 77, 3, 50], [120, 4, 66, 31]]
KV_SPACE_GIB = 1


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict, dict]:
    """(case → folder, what serve_in_vllm.py reports of each) from one process in the vLLM environment."""
    root = tmp_path_factory.mktemp("decilm-vllm")
    folders = {}
    for case, width in SERVED_WIDTHS.items():
        source = LlamaConfig(
            vocab_size=128,
            hidden_size=128,
            intermediate_size=width,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            initializer_range=0.5,  # greedy tokens that depend on the context
        )
        torch.manual_seed(0)
        model = DeciLMForCausalLM(DeciLMConfig.from_dict(native_per_layer_config(source.to_dict(), SERVED_HEADS)))
        model.save_pretrained(root / case)
        copy_modeling_files("nemotron-nas", root / case)
        folders[case] = str(root / case)
    spec = {"cases": folders, "prompts": PROMPTS, "new_tokens": 8, "max_model_len": 64}
    return folders, vllm_served(spec, root, KV_SPACE_GIB, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SERVED_WIDTHS))
def test_vllm_serves_the_layout_with_transformers_tokens_and_each_layers_heads(case, served):
    folders, report = served
    result = report["cases"][case]
    assert "error" not in result, f"{case} does not serve in vLLM: {result.get('error')}"
    assert result["architecture"] == "DeciLMForCausalLM"  # vLLM's own class, not its transformers backend
    assert list(result["kv_heads"].values()) == list(SERVED_HEADS)
    model = AutoModelForCausalLM.from_pretrained(folders[case], dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
            expected.append(out[0, len(prompt) :].tolist())
    assert result["tokens"] == expected
    assert len({t for row in expected for t in row}) > 3  # not one token repeated
    # The cache, in whole blocks, is what the per-layer arithmetic gives: float32 K and V of
    # each layer's own heads (4 + 1 of 32 dims), not the largest layer's in every layer.
    block = result["block_size"]
    per_block = block * 2 * sum(SERVED_HEADS) * 32 * 4
    assert result["kv_tokens"] == KV_SPACE_GIB * 2**30 // per_block * block


def pooled(llama: LlamaForCausalLM, kv_heads: tuple[int, ...]) -> DeciLMForCausalLM:
    """`llama` with layer l's K/V heads mean-pooled in contiguous groups of h / kv_heads[l], in
    uptrain's per-layer modeling (`per_layer_counterpart`): the in-memory reference of a
    per-layer conversion."""
    model_class, config = per_layer_counterpart(llama, kv_heads)
    model = model_class(config).eval()
    state = llama.state_dict()
    heads, hidden = llama.config.num_attention_heads, llama.config.hidden_size
    for layer, kv in enumerate(kv_heads):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            state[key] = state[key].view(kv, heads // kv, -1, hidden).mean(dim=1).reshape(-1, hidden)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("kv_heads", ALLOCATIONS.values(), ids=ALLOCATIONS)
def test_heads_equal_within_each_layers_groups_pool_losslessly(kv_heads):
    """A Llama whose layer l has K/V heads identical within groups of h / kv_l is its own
    per-layer pooling at that allocation, and not at another."""
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config()).eval()
    with torch.no_grad():
        for parameter in llama.parameters():
            parameter.normal_(0, 0.3)
        for layer, kv in enumerate(kv_heads):
            attention = llama.model.layers[layer].self_attn
            for projection in (attention.k_proj, attention.v_proj):
                rows = projection.weight.view(kv, 4 // kv, 16, 64)
                rows.copy_(rows[:, :1].expand_as(rows))  # each group's heads: its first head
        expected = llama(token_ids()).logits
        model = pooled(llama, kv_heads)
        assert type(model) is DeciLMForCausalLM
        assert [layer.self_attn.k_proj.out_features // 16 for layer in model.model.layers] == list(kv_heads)
        assert torch.equal(model(token_ids()).logits, expected)
        other = (1,) * len(kv_heads)  # a coarser allocation merges heads that differ
        assert not torch.allclose(pooled(llama, other)(token_ids()).logits, expected, atol=1e-3)


def test_uptrain_convert_writes_the_layout_that_loads_as_the_pooled_model(tmp_path, capsys):
    """`uptrain convert --kv-heads-per-layer 4,2` of a Llama writes the DeciLM layout with its
    modeling beside the weights: it loads with the Auto class as the Llama whose layer l has its
    K/V heads mean-pooled to kv_l (`pooled`), and as what `convert_model` gives in memory; pooled
    again to one G it is transformers' Llama again."""
    from uptrain.cli import main
    from uptrain.convert import convert_model

    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config()).eval()
    with torch.no_grad():
        for parameter in llama.parameters():
            parameter.normal_(0, 0.3)
    llama.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--kv-heads-per-layer", "4,2"]) == 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "nemotron-nas" and saved["num_key_value_heads_per_layer"] == [4, 2]
    assert [b["attention"]["n_heads_in_group"] for b in saved["block_configs"]] == [1, 2]
    assert (tmp_path / "out" / "modeling_decilm.py").read_bytes() == Path(modeling_decilm.__file__).read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is DeciLMForCausalLM
    in_memory = convert_model(llama, kv_heads_per_layer=[4, 2])
    assert type(in_memory) is DeciLMForCausalLM
    with torch.no_grad():
        expected = pooled(llama, (4, 2))(token_ids()).logits
        assert torch.equal(loaded(token_ids()).logits, expected)
        assert torch.equal(in_memory(token_ids()).logits, expected)

    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "g1"), "-g", "1"]) == 0
    again = json.loads((tmp_path / "g1" / "config.json").read_text())
    assert again["model_type"] == "llama" and again["architectures"] == ["LlamaForCausalLM"]
    assert not {"block_configs", "num_key_value_heads_per_layer", "auto_map"} & set(again)
    assert not list((tmp_path / "g1").glob("*.py"))
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "g1")) is LlamaForCausalLM
    assert type(convert_model(in_memory, 1)) is LlamaForCausalLM
