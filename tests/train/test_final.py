"""`final/` is the starting checkpoint with its weights replaced: config and tokenizer files
byte for byte (so transformers 4.x reads it as it read the start), weights under the start's
names and dtypes, loading with the trained model's logits; provenance as a chain; a card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open

from tests.train.train_helpers import records
from uptrain.train.config import TrainConfig
from uptrain.train.final import uptrained_card, uptraining_record, write_final
from uptrain.train.loop import run_training

SOURCE_CARD = "---\nlicense: apache-2.0\n---\n# tiny\n"


def stored(folder: Path) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    return tensors


def v4_checkpoint(src: Path, dst: Path) -> Path:
    """`src` as transformers 4.x writes a Llama: rope_theta/rope_scaling and torch_dtype in
    config.json, a tokenizer_config.json naming PreTrainedTokenizerFast."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in ("rope_parameters", "dtype", "transformers_version"):
        config.pop(key, None)
    config.update(
        {"rope_theta": 500000.0, "rope_scaling": None, "torch_dtype": "float32", "transformers_version": "4.57.1"}
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer_config = json.loads((dst / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (dst / "LICENSE").write_text("Apache License\n")
    return dst


def test_final_of_a_transformers_4_checkpoint_keeps_its_files(base_config, assets, tmp_path):
    start = v4_checkpoint(assets["gqa"], tmp_path / "v4")
    config = TrainConfig(**{**base_config, "model": str(start), "max_steps": 2, "save_every": 10})
    final = run_training(config)
    carried = [
        p.name for p in start.iterdir() if p.suffix != ".safetensors" and p.name not in ("uptrain.json", "README.md")
    ]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE"} <= set(
        carried
    )
    for name in carried:
        assert (final / name).read_bytes() == (start / name).read_bytes(), name
    written = json.loads((final / "config.json").read_text())
    assert written["rope_theta"] == 500000.0 and "rope_parameters" not in written and "dtype" not in written

    before, after = stored(start), stored(final)
    assert list(after) == list(before)
    assert all(after[k].dtype == before[k].dtype and after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(after[k], before[k]) for k in before)  # trained

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    assert AutoTokenizer.from_pretrained(final).get_vocab() == AutoTokenizer.from_pretrained(start).get_vocab()
    record = json.loads((final / "uptrain.json").read_text())
    assert record["uptraining"]["eval_after"]["eval/loss"] == records(config.output_dir)[-1]["eval/loss"]


def train_a_little(model: torch.nn.Module, steps: int = 3) -> torch.nn.Module:
    """A few real optimizer steps, so that every weight moves away from the saved one."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def write_trained_final(start: Path, out: Path, model: torch.nn.Module, **kwargs) -> Path:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model)
    state = accelerator.get_state_dict(prepared)
    record = uptraining_record(
        start,
        {"train_data": "t", "eval_data": "e", "seq_len": 16, "lr": 1e-2, "warmup_steps": 0, "seed": 0},
        steps=3,
        tokens=96,
        num_processes=1,
        global_batch=2,
        eval_before=None,
        eval_after={},
    )
    return write_final(
        out, start, accelerator.unwrap_model(prepared), state, record, uptrained_card(record, start), **kwargs
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embeddings_are_written_once_and_the_model_loads_with_the_trained_logits(dtype, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    start = tmp_path / "start"
    LlamaForCausalLM(config).to(dtype).save_pretrained(start)
    assert "lm_head.weight" not in stored(start)  # what transformers writes for tied weights

    # Trained as the loop trains: fp32 master weights loaded from the checkpoint.
    model = train_a_little(AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32))
    final = write_trained_final(start, tmp_path / "final", model)
    written = stored(final)
    assert list(written) == list(stored(start)) and all(t.dtype == dtype for t in written.values())
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=dtype).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # The trained model in the checkpoint's dtype (loaded as transformers loads that dtype: a
    # plain `.to(bfloat16)` would also round the rotary frequencies, which loading does not).
    reference = AutoModelForCausalLM.from_pretrained(start, dtype=dtype).eval()
    reference.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    assert torch.equal(logits_of(loaded), logits_of(reference))
    assert not torch.equal(logits_of(loaded), logits_of(AutoModelForCausalLM.from_pretrained(start, dtype=dtype)))


def test_large_models_are_sharded_with_an_index(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    start = assets["gqa"]
    model = train_a_little(AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32))
    final = write_trained_final(start, tmp_path / "final", model, max_shard_bytes=40_000)
    index = json.loads((final / "model.safetensors.index.json").read_text())
    shards = sorted(final.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert not (final / "model.safetensors").exists()
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(final).eval()), logits_of(model))


def test_provenance_chain_and_card_from_source_to_final(base_config, assets, tmp_path):
    source = tmp_path / "mha"
    shutil.copytree(assets["mha"], source)
    (source / "README.md").write_text(SOURCE_CARD)
    (source / "LICENSE").write_text("Apache License\n")
    values = {
        **base_config,
        "source": str(source),
        "num_kv_heads": 2,
        "pooling": "first",
        "max_steps": None,
        "uptrain_fraction": 0.01,
        "pretrain_tokens": 25600,
        "save_every": 10,
    }
    del values["model"]
    config = TrainConfig(**values)
    final = run_training(config)
    converted = Path(config.output_dir) / "converted"

    record = json.loads((final / "uptrain.json").read_text())
    # Named portably, and with no base_model: the source is a local folder with no Hub id.
    assert record["started_from"] == {
        "name": "converted",
        "revision": None,
        "base_model": None,
        "provenance": json.loads((converted / "uptrain.json").read_text()),
    }
    assert record["started_from"]["provenance"]["pooling"] == "first"
    assert record["started_from"]["provenance"]["source"] == "mha"
    run = record["uptraining"]
    logged = records(config.output_dir)
    assert run["steps"] == 2 and run["tokens"] == 256 and run["num_processes"] == 1 and run["global_batch"] == 4
    assert run["eval_before"]["eval/loss"] == logged[0]["eval/loss"]
    assert run["eval_after"]["eval/loss"] == logged[-1]["eval/loss"]
    assert run["config"]["uptrain_fraction"] == 0.01 and record["uptrain_version"]
    assert (run["config"]["source"], run["config"]["train_data"], run["config"]["output_dir"]) == (
        "mha",
        Path(config.train_data).name,
        "run",
    )

    for folder in (converted, final):
        for name in ("README.md", "uptrain.json"):  # nothing names a path of this machine
            assert str(tmp_path) not in (folder / name).read_text() and "/tmp" not in (folder / name).read_text()
        card = ModelCard.load(folder / "README.md")
        assert card.data.base_model is None and "base_model" not in (folder / "README.md").read_text()
        assert card.data.license == "apache-2.0"
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
        assert (folder / "LICENSE").read_bytes() == (source / "LICENSE").read_bytes()
    text = (final / "README.md").read_text()
    assert "α = 0.01" in text and "256 tokens in 2 optimizer steps" in text and "`first` pooling" in text
    assert f"Eval loss before uptraining: {logged[0]['eval/loss']:.4f}" in text
    assert f"Eval loss after uptraining: {logged[-1]['eval/loss']:.4f}" in text


def test_a_hub_model_is_named_by_its_id_and_commit(base_config, assets):
    """A model given as a Hub id (found in the local cache, offline) and not converted by uptrain."""
    import os

    from huggingface_hub import constants

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = Path(constants.HF_HUB_CACHE) / "models--tiny-org--tiny-mha"
    shutil.copytree(assets["mha"], repo / "snapshots" / commit)
    (repo / "snapshots" / commit / "README.md").write_text(SOURCE_CARD)
    os.makedirs(repo / "refs", exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    config = TrainConfig(**{**base_config, "model": "tiny-org/tiny-mha", "max_steps": 1, "save_every": 10})
    final = run_training(config)
    started = json.loads((final / "uptrain.json").read_text())["started_from"]
    assert started == {
        "name": "tiny-org/tiny-mha",
        "revision": commit,
        "base_model": "tiny-org/tiny-mha",
        "provenance": None,
    }
    card = ModelCard.load(final / "README.md")
    assert card.data.base_model == "tiny-org/tiny-mha" and card.data.license == "apache-2.0"
    validate_repo_id(card.data.base_model)
    assert f"`tiny-org/tiny-mha` (revision `{commit}`) uptrained (it was not converted by uptrain)" in card.text


def test_a_local_conversion_of_a_hub_model_names_it_as_base_model(assets, tmp_path):
    """final/ of a local folder that uptrain converted from a Hub snapshot: its provenance names
    the Hub model, so final/'s card and record do too (the folder itself has no Hub id)."""
    from transformers import AutoModelForCausalLM

    from uptrain.convert import convert_checkpoint

    commit = "0123456789abcdef0123456789abcdef89abcdef"
    snapshot = tmp_path / "cache" / "models--tiny-org--tiny-mha" / "snapshots" / commit
    shutil.copytree(assets["mha"], snapshot)
    start = convert_checkpoint(snapshot, tmp_path / "gqa", 2, progress=False)
    model = train_a_little(AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32))
    final = write_trained_final(start, tmp_path / "final", model)
    record = json.loads((final / "uptrain.json").read_text())
    assert record["started_from"]["name"] == "gqa" and record["started_from"]["base_model"] == "tiny-org/tiny-mha"
    assert record["started_from"]["provenance"]["source_revision"] == commit
    card = ModelCard.load(final / "README.md")
    assert card.data.base_model == "tiny-org/tiny-mha" and "`tiny-org/tiny-mha` converted by uptrain" in card.text
    for name in ("README.md", "uptrain.json"):
        assert str(tmp_path) not in (final / name).read_text()


@pytest.mark.parametrize("started_from", [["a list"], "a string", {"provenance": ["a list"]}])
def test_a_model_whose_provenance_chain_is_malformed_is_refused_in_one_line(
    started_from, base_config, assets, tmp_path, capsys
):
    """`uptrain train` of a model whose uptrain.json has a `started_from` that is not a mapping:
    one line naming the file and the key, before anything is written (read as no provenance, the
    card and the wandb run would say the model was not converted by uptrain)."""
    from uptrain.cli import main

    model = tmp_path / "model"
    shutil.copytree(assets["gqa"], model)
    (model / "uptrain.json").write_text(json.dumps({"uptraining": {}, "started_from": started_from}))
    code = main(
        [
            "train",
            "--model",
            str(model),
            "--train-data",
            base_config["train_data"],
            "--eval-data",
            base_config["eval_data"],
            "--output-dir",
            base_config["output_dir"],
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--max-steps",
            "1",
            "--report-to",
            "jsonl",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    key = "`started_from`" if not isinstance(started_from, dict) else "`started_from.provenance`"
    assert f"{model / 'uptrain.json'}: {key} must be a mapping" in err and len(err.strip().splitlines()) == 1, err
    assert not Path(base_config["output_dir"]).exists()


def test_tensors_renamed_on_load_are_written_back_under_the_checkpoint_names(tmp_path):
    """transformers 5 fuses Mixtral's experts on load (`experts.0.w1` … → `experts.gate_up_proj`):
    final/ still holds the checkpoint's own names, as transformers writes them back."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=64,
    )
    start = tmp_path / "start"
    AutoModelForCausalLM.from_config(config).save_pretrained(start)
    model = train_a_little(AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32))
    assert set(model.state_dict()) != set(stored(start))  # the renaming this test is about
    final = write_trained_final(start, tmp_path / "final", model)
    assert sorted(stored(final)) == sorted(stored(start))
    assert (final / "config.json").read_bytes() == (start / "config.json").read_bytes()
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(final).eval()), logits_of(model))


# A tiny T5: attention width (heads × d_kv = 32) unlike d_model (16), two encoder and one decoder layer.
T5_SHAPE = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=4)
T5_IDS = dict(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def seq2seq_inputs(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(2, vocab, (2, 9), generator=g),
        "decoder_input_ids": torch.randint(2, vocab, (2, 5), generator=g),
    }


def seq2seq_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**seq2seq_inputs(model.config.vocab_size)).logits


def untied_t5_v1_1(folder: Path) -> Path:
    """A T5 v1.1 (gated-GELU, `lm_head` its own tensor) as transformers 4.x saves it: config
    `tie_word_embeddings: false` and `lm_head.weight` beside `shared.weight`. (transformers 5
    always ties a T5 it builds, and keeps a checkpoint's `lm_head` untied only when it differs.)"""
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(**T5_SHAPE, **T5_IDS, feed_forward_proj="gated-gelu")).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(T5_SHAPE["vocab_size"], T5_SHAPE["d_model"])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2) + "\n")
    return folder


def test_final_of_a_converted_t5_keeps_its_kv_heads_provenance_and_task(tmp_path):
    """final/ of a t5_gqa model (decoder self- and cross-attention pooled to 2 KV heads, tied
    lm_head as in T5 v1.0): config.json with each attention's KV heads and the modeling files
    byte for byte, the shared embedding written once, the trained logits on load, the conversion
    record embedded, and the card's Hub task the conversion's (text2text-generation)."""
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    import uptrain.modeling  # noqa: F401  registers t5_gqa with the Auto classes
    from uptrain.convert import convert_checkpoint

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(**T5_SHAPE, **T5_IDS)).save_pretrained(tmp_path / "t5")
    (tmp_path / "t5" / "README.md").write_text(SOURCE_CARD)
    start = convert_checkpoint(tmp_path / "t5", tmp_path / "gqa", 2, progress=False)
    model = train_a_little(AutoModelForSeq2SeqLM.from_pretrained(start, dtype=torch.float32))
    final = write_trained_final(start, tmp_path / "final", model)

    config = json.loads((final / "config.json").read_text())
    assert (final / "config.json").read_bytes() == (start / "config.json").read_bytes()
    assert config["model_type"] == "t5_gqa" and (
        config["encoder_num_key_value_heads"],
        config["decoder_num_key_value_heads"],
        config["cross_attention_num_key_value_heads"],
    ) == (4, 2, 2)
    for name in ("modeling_t5_gqa.py", "attention.py", "generation_config.json"):
        assert (final / name).read_bytes() == (start / name).read_bytes(), name
    before, after = stored(start), stored(final)
    assert list(after) == list(before) and "lm_head.weight" not in after  # tied: written as shared.weight only
    assert after["decoder.block.0.layer.1.EncDecAttention.k.weight"].shape == (2 * 8, 16)  # G = 2 heads of d_kv 8
    loaded = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    assert type(loaded).__name__ == "T5GQAForConditionalGeneration"
    assert loaded.lm_head.weight is loaded.shared.weight
    assert torch.equal(seq2seq_logits(loaded), seq2seq_logits(model))
    assert not torch.equal(seq2seq_logits(loaded), seq2seq_logits(AutoModelForSeq2SeqLM.from_pretrained(start)))

    provenance = json.loads((final / "uptrain.json").read_text())["started_from"]["provenance"]
    assert provenance == json.loads((start / "uptrain.json").read_text())
    assert provenance["attention"] == ["decoder-self", "cross"]
    assert provenance["attentions"]["cross"]["num_key_value_heads"] == 2
    card = ModelCard.load(final / "README.md")
    assert card.data.pipeline_tag == "text2text-generation" == ModelCard.load(start / "README.md").data.pipeline_tag
    assert "encoder-decoder" in card.data.tags and card.data.license == "apache-2.0"
    assert (
        "decoder self-attention 4 → 2 KV heads; cross-attention 4 → 2 KV heads; "
        "encoder self-attention unchanged; `mean` pooling"
    ) in card.text


def test_final_of_an_untied_t5_v1_1_writes_its_own_lm_head(tmp_path):
    """T5 v1.1 has an output projection of its own: final/ writes the trained `lm_head.weight`
    beside `shared.weight`, and it loads untied with the trained logits."""
    from transformers import AutoModelForSeq2SeqLM

    start = untied_t5_v1_1(tmp_path / "v1.1")
    model = AutoModelForSeq2SeqLM.from_pretrained(start, dtype=torch.float32)
    assert model.lm_head.weight is not model.shared.weight  # the case this test is about
    model = train_a_little(model)
    final = write_trained_final(start, tmp_path / "final", model)
    before, after = stored(start), stored(final)
    assert list(after) == list(before) and {"lm_head.weight", "shared.weight"} <= set(after)
    assert torch.equal(after["lm_head.weight"], model.lm_head.weight.detach())
    assert torch.equal(after["shared.weight"], model.shared.weight.detach())
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])  # trained
    loaded = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    assert loaded.lm_head.weight is not loaded.shared.weight
    assert torch.equal(seq2seq_logits(loaded), seq2seq_logits(model))
    card = ModelCard.load(final / "README.md")
    assert card.data.pipeline_tag == "text2text-generation" and "encoder-decoder" in card.data.tags
    assert "uptrained (it was not converted by uptrain)" in card.text


@pytest.mark.parametrize(
    "model_type, task",
    [
        ("bart", "text2text-generation"),
        ("marian", "translation"),
        ("whisper", "automatic-speech-recognition"),
        ("llama", "text-generation"),
    ],
)
def test_the_card_names_the_hub_task_of_the_model_family(model_type, task, tmp_path):
    from transformers import AutoConfig

    start = tmp_path / model_type
    AutoConfig.for_model(model_type).save_pretrained(start)
    record = uptraining_record(
        start,
        {
            "train_data": "t",
            "eval_data": "e",
            "seq_len": 16,
            "lr": 1e-2,
            "warmup_steps": 0,
            "seed": 0,
            "objective": "pairs",
        },
        steps=1,
        tokens=16,
        num_processes=1,
        global_batch=1,
        eval_before=None,
        eval_after={},
    )
    card = uptrained_card(record, start)
    (tmp_path / "README.md").write_text(card)
    data = ModelCard.load(tmp_path / "README.md").data
    assert data.pipeline_tag == task and ("encoder-decoder" in data.tags) == (model_type != "llama")
    assert "- Objective: `pairs`" in card


def test_the_uptrained_card_names_each_layers_kv_heads(tmp_path):
    """The card of `final/` says what the conversion it started from gave each layer."""
    from tests.modeling.classic_models import build as build_classic
    from uptrain.convert import convert_checkpoint
    from uptrain.train.final import uptrained_card

    build_classic("gpt2").save_pretrained(tmp_path / "src")
    start = convert_checkpoint(tmp_path / "src", tmp_path / "gqa", kv_heads_per_layer="4,1", progress=False)
    config = {"seq_len": 16, "train_data": "t", "eval_data": "e", "lr": 1e-3, "warmup_steps": 0, "seed": 0}
    run = {"config": config, "num_processes": 1, "tokens": 64, "steps": 2, "global_batch": 2}
    run |= {"eval_before": None, "eval_after": None}
    provenance = json.loads((start / "uptrain.json").read_text())
    started = {"name": "gqa", "revision": None, "base_model": None, "provenance": provenance}
    card = uptrained_card({"uptraining": run, "started_from": started, "uptrain_version": "0"}, start)
    assert "converted by uptrain to per-layer KV heads (4, 1) (from 8;" in card
