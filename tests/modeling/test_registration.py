"""Importing `uptrain.modeling` registers gpt2_gqa, gpt_neox_gqa, … with transformers the way
transformers documents for custom models; nothing else does. Saves of a loaded model carry
the modeling code, so they load without uptrain as a converted checkpoint does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
    MODEL_MAPPING,
)

from tests.modeling.classic_models import ARCHITECTURES, build, token_ids
from uptrain.architecture import converted_architectures, modeling_of
from uptrain.architecture.converted import gqa_config, modeling_files
from uptrain.convert import convert_checkpoint
from uptrain.modeling import CLASSES, gqa_counterpart
from uptrain.modeling.modeling_gpt2_gqa import GPT2GQAConfig, GPT2GQAForCausalLM, GPT2GQAModel

GQA_TYPES = sorted(converted_architectures())
# The Auto class a table entry names → the mapping its `register` fills.
HEAD_MAPPINGS = {
    "AutoModelForCausalLM": MODEL_FOR_CAUSAL_LM_MAPPING,
    "AutoModelForSeq2SeqLM": MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    "AutoModelForSpeechSeq2Seq": MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
}


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
    )


def test_the_table_names_the_classes_the_package_registers():
    """The architecture registry (read by the converter) and the classes (registered here) agree:
    config.json's `auto_map` names the file and classes that `save_pretrained` writes."""
    assert sorted(CLASSES) == GQA_TYPES
    for model_type in GQA_TYPES:
        entry = modeling_of(model_type)
        config, model, head = CLASSES[model_type]
        assert (config.__name__, model.__name__, head.__name__) == (
            entry.config_class,
            entry.model_class,
            entry.head_class,
        )
        assert {c.__module__ for c in (config, model, head)} == {f"uptrain.modeling.{entry.module}"}
        # Bound in the file under their names (the BART family's are built by a helper): what
        # `auto_map` names is what `trust_remote_code` finds there.
        assert all(getattr(sys.modules[c.__module__], c.__name__) is c for c in (config, model, head))
        assert config.model_type == model_type
        assert CONFIG_MAPPING[model_type] is config
        auto_head = converted_architectures()[model_type].auto_class
        assert MODEL_MAPPING[config] is model and HEAD_MAPPINGS[auto_head][config] is head


def test_a_converted_checkpoint_loads_with_plain_auto_classes(tmp_path):
    source = build("gpt2")
    source.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 8, progress=False)  # G = h: lossless
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is GPT2GQAForCausalLM
    with torch.no_grad():
        assert torch.equal(model(token_ids()).logits, source(token_ids()).logits)


RELOAD_WITHOUT_UPTRAIN = """
import sys, torch
from transformers import AutoModelForCausalLM
for name, folder in {folders!r}.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__
    with torch.no_grad():
        torch.save(model(torch.tensor({ids!r})).logits, f'{{folder}}/logits.pt')
assert not [m for m in sys.modules if m.split('.')[0] == 'uptrain'], 'uptrain was imported'
"""


def test_save_pretrained_of_a_loaded_model_carries_its_code(tmp_path):
    """A converted checkpoint loaded through uptrain's registered classes and saved again (the
    usual fine-tune-and-save) carries the modeling file and attention.py and an `auto_map` that
    names them: a fresh process without uptrain loads it with trust_remote_code and computes
    the same logits."""
    resaved = {}
    expected = {}
    for model_type in ARCHITECTURES:
        build(model_type).save_pretrained(tmp_path / model_type / "src")
        converted = convert_checkpoint(
            tmp_path / model_type / "src", tmp_path / model_type / "converted", 2, progress=False
        )
        model = AutoModelForCausalLM.from_pretrained(converted).eval()
        assert not model.__module__.startswith("transformers_modules.")  # uptrain's class, not the file's
        model.save_pretrained(tmp_path / model_type / "resaved")
        resaved[model_type] = str(tmp_path / model_type / "resaved")
        with torch.no_grad():
            expected[model_type] = model(token_ids()).logits

        files = modeling_files(model_type)
        for name, path in files.items():
            assert (tmp_path / model_type / "resaved" / name).read_bytes() == path.read_bytes(), name
        config = json.loads((tmp_path / model_type / "resaved" / "config.json").read_text())
        assert config["auto_map"] == json.loads((converted / "config.json").read_text())["auto_map"]

    # A model made from a config of its own (no `auto_map` to inherit): both classes' markings
    # write theirs.
    def bare_config():
        return GPT2GQAConfig(n_embd=64, n_head=8, n_layer=1, num_key_value_heads=4, vocab_size=128)

    torch.manual_seed(0)
    bare = GPT2GQAForCausalLM(bare_config()).eval()
    bare.save_pretrained(tmp_path / "bare")
    resaved["bare"] = str(tmp_path / "bare")
    with torch.no_grad():
        expected["bare"] = bare(token_ids()).logits
    assert set(json.loads((tmp_path / "bare" / "config.json").read_text())["auto_map"]) == {
        "AutoConfig",
        "AutoModelForCausalLM",
    }
    GPT2GQAModel(bare_config()).save_pretrained(tmp_path / "bare_base")
    assert set(json.loads((tmp_path / "bare_base" / "config.json").read_text())["auto_map"]) == {
        "AutoConfig",
        "AutoModel",
    }

    script = RELOAD_WITHOUT_UPTRAIN.format(folders=resaved, ids=token_ids().tolist())
    result = run(script, HF_HOME=str(tmp_path / "hf"), PYTHONPATH="")
    assert result.returncode == 0, result.stderr[-3000:]
    for model_type, folder in resaved.items():
        assert torch.equal(torch.load(f"{folder}/logits.pt"), expected[model_type]), model_type


NOT_TOUCHED = """
import sys
from uptrain.cli import main
assert main(['convert', {src!r}, {out!r}, '-g', '2']) == 0
print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'transformers'}}),
      sorted(m for m in sys.modules if m.split('.')[:2] == ['uptrain', 'modeling']))
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
print(sorted(t for t in {types!r} if t in CONFIG_MAPPING))
"""


def test_uptrain_convert_neither_imports_transformers_nor_registers(tmp_path):
    """`uptrain convert` of a GPT-2 checkpoint (start-up sensitive: benchmarks) imports neither
    transformers nor uptrain's modeling, and a process that never imports `uptrain.modeling`
    finds transformers' Auto classes as transformers left them."""
    build("gpt2").save_pretrained(tmp_path / "src")
    result = run(NOT_TOUCHED.format(src=str(tmp_path / "src"), out=str(tmp_path / "out"), types=GQA_TYPES))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["[] []", "[]"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt2_gqa"


def test_gqa_config_edits_only_what_the_modeling_needs():
    source = {
        "model_type": "gpt2",
        "n_head": 8,
        "n_layer": 2,
        "n_embd": 64,
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 128,
    }
    config = gqa_config(source, 2)
    assert config == {
        **source,
        "model_type": "gpt2_gqa",
        "num_key_value_heads": 2,
        "architectures": ["GPT2GQAForCausalLM"],
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "auto_map": {
            "AutoConfig": "modeling_gpt2_gqa.GPT2GQAConfig",
            "AutoModel": "modeling_gpt2_gqa.GPT2GQAModel",
            "AutoModelForCausalLM": "modeling_gpt2_gqa.GPT2GQAForCausalLM",
        },
    }
    assert gqa_config(config, 1)["model_type"] == "gpt2_gqa"  # pooling a converted checkpoint further
    llama = {"model_type": "llama", "num_attention_heads": 8}
    assert gqa_config(llama, 2) == {**llama, "num_key_value_heads": 2}
    assert modeling_files("llama") == {}


# What a modeling file may import besides its siblings: a few of Python's own modules, torch, transformers.
STANDALONE_IMPORTS = {"__future__", "copy", "inspect", "math", "torch", "transformers"}


def test_modeling_files_import_only_torch_and_transformers():
    """What trust_remote_code executes must not need uptrain: only relative imports of the
    files saved beside it."""
    for model_type in GQA_TYPES:
        files = modeling_files(model_type)
        for name, path in files.items():
            for line in path.read_text().splitlines():
                if line.startswith(("import ", "from ")):
                    module = line.split()[1]
                    assert module.split(".")[0] in STANDALONE_IMPORTS or (
                        module.startswith(".") and f"{module[1:]}.py" in files
                    ), (name, line)


OLD_TRANSFORMERS = """
import importlib.util
import transformers
transformers.__version__ = "4.56.2"  # what an older install reports; the files' own check reads it
spec = importlib.util.spec_from_file_location("attention", {path!r})
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
except ImportError as error:
    print(error)
"""


def test_older_transformers_are_refused_in_one_line():
    """The files beside the weights refuse a transformers they were not tested with (their
    cache and mask conventions differ without an error) in one line naming the version needed."""
    result = run(OLD_TRANSFORMERS.format(path=str(modeling_files("gpt2")["attention.py"])), PYTHONPATH="")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        "uptrain's GQA modeling needs transformers >= 4.57 (found 4.56.2): pip install -U 'transformers>=4.57'"
    )


@pytest.mark.parametrize("model_type", ["gpt_neox", "opt", "gpt_neo", "falcon"])
def test_gqa_counterpart_of_a_model_in_memory(model_type):
    """The class and config an in-memory conversion builds: at G = h, the original's state dict
    loads into it and gives the same logits, bit for bit."""
    model = build(model_type)
    cls, config = gqa_counterpart(model, 8)
    assert cls.__name__.endswith("GQAForCausalLM") and config.model_type == f"{model_type}_gqa"
    copy = cls(config).eval()
    copy.set_attn_implementation(model.config._attn_implementation)  # GPT-Neo's: eager, its only one
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(copy(token_ids()).logits, model(token_ids()).logits)
    cls, config = gqa_counterpart(model, 2)
    assert cls(config).config.num_key_value_heads == 2
    llama_cls, llama_config = gqa_counterpart(build_llama(), 2)
    assert llama_cls.__name__ == "LlamaForCausalLM" and llama_config.num_key_value_heads == 2


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    )
