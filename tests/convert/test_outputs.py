"""What a conversion writes besides the weights says what was done: Hub metadata the Hub and
huggingface_hub read (a `base_model` only where a Hub id is known), a card true for each
strategy and each layout, the source's licence files, and provenance that records the groups
actually merged and the Hub commit, naming no absolute path of the machine it ran on."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import load_file

from tests.convert.tiny_models import build_model, save
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.convert.pipeline import Calibration

LICENCE_FILES = {
    "LICENSE": "Apache License 2.0, the full text\n",
    "USE_POLICY.md": "# Acceptable use\n",
    "NOTICE": "Copyright the authors\n",
}
SOURCE_CARD = """---
license: other
license_name: tiny-community-license
license_link: LICENSE
language: [en]
---
# A tiny model
"""


def state(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Llama (8 heads, 2 layers) published with a card, a licence, a use policy and a notice."""
    folder = save(build_model("llama"), tmp_path_factory.mktemp("src") / "llama")
    (folder / "README.md").write_text(SOURCE_CARD)
    for name, text in LICENCE_FILES.items():
        (folder / name).write_text(text)
    return folder


def written(out) -> tuple[ModelCard, dict]:
    """The card (as huggingface_hub reads it) and the record of a converted checkpoint, after
    checking that neither names an absolute path of this machine (every test path is under
    pytest's base temporary folder) and that a `base_model`, where there is one, is a Hub id."""
    base = str(out).split("/pytest-")[0]  # /tmp: above pytest's own folders and every test's paths
    for name in ("README.md", "uptrain.json"):
        assert base not in (out / name).read_text(), name
    card, record = ModelCard.load(out / "README.md"), json.loads((out / "uptrain.json").read_text())
    assert card.data.base_model == record["base_model"]
    if record["base_model"] is not None:
        for repo_id in [record["base_model"]] if isinstance(record["base_model"], str) else record["base_model"]:
            validate_repo_id(repo_id)
    else:
        assert "base_model" not in (out / "README.md").read_text().split("---")[1]
    return card, record


def test_card_metadata_is_read_by_huggingface_hub_and_licence_files_are_carried(src, tmp_path):
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    card, record = written(out)  # a local file: no network
    # A folder with no Hub id: no base_model (the Hub refuses a path), named by its folder name.
    assert card.data.base_model is None and record["source"] == "llama"
    assert "Converted from the local folder `llama`" in card.text
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert (card.data.license, card.data.license_name, card.data.license_link) == (
        "other",
        "tiny-community-license",
        "LICENSE",
    )
    assert {"uptrain", "grouped-query-attention", "llama"} <= set(card.data.tags)
    for name in LICENCE_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_a_source_without_card_gives_a_card_without_licence(tmp_path):
    bare = save(build_model("qwen2"), tmp_path / "bare")
    out = convert_checkpoint(bare, tmp_path / "out", 4, progress=False)
    card, _ = written(out)
    assert card.data.base_model is None and card.data.license is None
    assert not list(out.glob("LICENSE*"))


def test_mean_card_says_q_and_o_are_unchanged_and_they_are(src, tmp_path):
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    text = (out / "README.md").read_text()
    assert "Each contiguous group of 4 source KV heads became one" in text
    assert "`q_proj`, `o_proj` and every other tensor are copied unchanged" in text
    before, after = state(src), state(out)
    for name in before:
        if "k_proj" not in name and "v_proj" not in name:
            assert torch.equal(before[name], after[name]), name


def test_calibrated_similarity_card_says_q_and_o_are_rewritten_and_they_are(src, tmp_path):
    # A positive definite second moment, as calibration would give (its origin does not matter here).
    torch.manual_seed(0)
    hidden = 64
    mix = torch.randn(hidden + 1, hidden + 1, dtype=torch.float64)
    moments = {layer: mix @ mix.T / hidden for layer in range(2)}
    data = f"{tmp_path / 'calibration.jsonl'}, {tmp_path / 'more' / 'text.txt'}"  # two files, as a label joins them
    out = convert_checkpoint(
        src,
        tmp_path / "out",
        2,
        pooling="calibrated",
        grouping="similarity",
        calibration=Calibration(moments, {"data": data, "tokens": 4096}),
        progress=False,
    )
    _, record = written(out)
    assert record["calibration"] == {"data": "calibration.jsonl, text.txt", "tokens": 4096}
    text = (out / "README.md").read_text()
    assert "contiguous" not in text and "`q_proj`, `o_proj` and every other tensor" not in text
    assert "`q_proj`, `k_proj` and `v_proj` (weights and biases) and the `o_proj` weights of every layer" in text
    assert "run over 4,096 tokens of `calibration.jsonl, text.txt`" in text and "renumbered" in text
    before, after = state(src), state(out)
    for layer in range(2):
        for proj in ("q_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert not torch.equal(before[name], after[name]), name
    untouched = [n for n in before if ".self_attn." not in n]
    assert untouched and all(torch.equal(before[n], after[n]) for n in untouched)


def test_kv_groups_are_the_groups_merged_under_similarity_grouping(src, tmp_path):
    """Mean pooling with similarity grouping: each new K head is the mean of exactly the source
    heads that `kv_groups` names for its layer."""
    out = convert_checkpoint(src, tmp_path / "out", 2, grouping="similarity", progress=False)
    record = json.loads((out / "uptrain.json").read_text())
    groups = record["kv_groups"]
    assert sorted(groups) == ["0", "1"]
    assert groups != {str(layer): [[0, 1, 2, 3], [4, 5, 6, 7]] for layer in range(2)}  # not the contiguous ones
    before, after = state(src), state(out)
    d = 8
    for layer, layer_groups in groups.items():
        assert sorted(h for g in layer_groups for h in g) == list(range(8))
        assert [h for g in layer_groups for h in g] == record["kv_head_order"][layer]
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            heads = before[name].view(8, d, -1)
            expected = torch.cat([heads[g].mean(dim=0) for g in layer_groups])
            torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7)


def test_contiguous_kv_groups_and_no_revision_for_a_local_folder(src, tmp_path):
    record = json.loads((convert_checkpoint(src, tmp_path / "out", 2, progress=False) / "uptrain.json").read_text())
    assert record["kv_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and record["grouping"] == "contiguous"
    assert record["source_revision"] is None and "kv_head_order" not in record


def test_hub_source_records_its_revision(src, tmp_path):
    """A Hub id found in the local cache (HF_HUB_OFFLINE): the snapshot's commit is recorded,
    in provenance and on the card."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(constants.HF_HUB_CACHE, "models--tiny-org--tiny-llama")
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    out = convert_checkpoint("tiny-org/tiny-llama", tmp_path / "out", 4, progress=False)
    card, record = written(out)
    assert record["source"] == "tiny-org/tiny-llama" and record["source_revision"] == commit
    assert card.data.base_model == "tiny-org/tiny-llama" and commit in card.text


def test_a_folder_in_the_hub_cache_is_named_by_its_hub_id_and_commit(src, tmp_path):
    """A snapshot folder of a Hugging Face cache given as a path: the path says which repository
    and commit the files are, so the record and card say so, as for the Hub id itself."""
    commit = "f" * 40
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commit
    shutil.copytree(src, snapshot)
    out = convert_checkpoint(snapshot, tmp_path / "out", 4, progress=False)
    card, record = written(out)
    assert card.data.base_model == record["source"] == "tiny-org/tiny-llama"
    assert (
        record["source_revision"] == commit
        and f"Converted from `tiny-org/tiny-llama` (revision `{commit}`)" in card.text
    )

    # Converted further as a local folder: its own provenance names the Hub model it came from.
    again = convert_checkpoint(out, tmp_path / "again", 2, progress=False)
    card, record = written(again)
    assert card.data.base_model == "tiny-org/tiny-llama" and record["source"] == "out"
    assert record["source_revision"] is None and "derived from `tiny-org/tiny-llama`" in card.text


@pytest.mark.parametrize(
    "named,base_model",
    [
        ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"),  # a fine-tune's card naming its base
        (["org/a", "org/b"], ["org/a", "org/b"]),  # a merge
        ("/home/someone/models/llama", None),  # a local path is no Hub id
        ("a/b/c", None),
    ],
)
def test_a_local_folder_whose_card_names_a_hub_base_model_keeps_it(named, base_model, tmp_path):
    folder = save(build_model("qwen2"), tmp_path / "finetune")
    (folder / "README.md").write_text("---\n" + json.dumps({"base_model": named}) + "\n---\n# a fine-tune\n")
    card, record = written(convert_checkpoint(folder, tmp_path / "out", 4, progress=False))
    assert record["base_model"] == card.data.base_model == base_model and record["source"] == "finetune"


def module_of(name: str) -> str:
    """`model.layers.0.self_attn.k_proj.weight` → `k_proj`."""
    return name.rsplit(".", 2)[-2]


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gpt2", "gpt_neox", "bloom", "opt"])
def test_the_card_names_the_tensors_the_layout_really_rewrites(model_type, tmp_path):
    """Compared with the tensors: each module whose values changed is named on the card, the
    card names no tensor the checkpoint lacks, and a tensor stored under another name is named."""
    from tests.modeling.classic_models import build

    model = build_model(model_type) if model_type in ("llama", "phi3") else build(model_type)
    before = state(save(model, tmp_path / "src"))
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False)
    after = state(out)
    text = ModelCard.load(out / "README.md").text
    changed = {
        module_of(n)
        for n in before
        if n in after and (before[n].shape != after[n].shape or not torch.equal(before[n], after[n]))
    }
    assert changed and all(f"`{m}`" in text for m in changed), (changed, text)
    modules = {module_of(n) for n in before} | {n.split(".")[0] for n in before}
    for named in (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "c_attn",
        "c_proj",
        "qkv_proj",
        "query_key_value",
        "out_proj",
        "dense",
    ):
        if f"`{named}`" in text:
            assert named in modules, (named, text)
    for name in before.keys() - after.keys():  # renamed on the way (NeoX's `embed_out` → `lm_head`)
        assert f"`{name.rsplit('.', 1)[0]}` is stored as" in text, name


def test_random_pooling_draws_with_the_layouts_own_init_key(tmp_path):
    """OPT's config calls the init std `init_std` (it has no `initializer_range`): random pooling
    draws the new K/V weights with it."""
    from tests.modeling.classic_models import build

    src = save(build("opt"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    assert "initializer_range" not in config
    (src / "config.json").write_text(json.dumps({**config, "init_std": 0.5}))
    out = convert_checkpoint(src, tmp_path / "out", 2, pooling="random", progress=False)
    after = state(out)
    for proj in ("k_proj", "v_proj"):
        weight = after[f"model.decoder.layers.0.self_attn.{proj}.weight"]  # 2 heads × 8 rows × 64: 1024 draws
        assert abs(weight.std().item() - 0.5) < 0.05, proj
    assert "normal(0, `init_std` of config.json)" in (out / "README.md").read_text()

    (src / "config.json").write_text(json.dumps({**config, "init_std": "small"}))
    with pytest.raises(UptrainError, match="init_std is 'small'; it must be a finite number"):
        convert_checkpoint(src, tmp_path / "refused", 2, pooling="random", progress=False)
    assert not (tmp_path / "refused").exists()
