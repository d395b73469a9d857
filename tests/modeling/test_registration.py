"""`import uptrain` registers gpt2_gqa, gpt_neox_gqa, … with transformers' Auto classes when
those are first imported, without importing transformers itself. Each case runs in a fresh
process: registration is about import order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from uptrain.modeling import MODELING, gqa_config, modeling_files

GQA_TYPES = sorted({m.model_type for m in MODELING.values()})
CHECK = f"""
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
for model_type in {GQA_TYPES!r}:
    config_class = CONFIG_MAPPING[model_type]
    assert MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__name__.endswith('GQAForCausalLM'), model_type
print('registered')
"""


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_uptrain_imports_neither_torch_nor_transformers():
    result = run("import sys, uptrain; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("first", [
    "from transformers import AutoModelForCausalLM",
    # The auto classes are pulled in half-way through importing GPT-2's modeling, which our
    # modeling file imports: registration must wait until that import is complete.
    "from transformers import GPT2LMHeadModel",
    "import transformers.models.gpt_neox.modeling_gpt_neox",
    # Our own modeling file, imported directly, pulls in the auto classes half-way through itself.
    "from uptrain.modeling.gpt2 import GPT2GQAForCausalLM",
])
def test_registered_once_the_auto_classes_are_imported(first):
    result = run(f"import uptrain\n{first}\n{CHECK}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "registered"


def test_registered_when_transformers_came_first():
    result = run(f"from transformers import AutoModelForCausalLM\nimport uptrain\n{CHECK}")
    assert result.returncode == 0, result.stderr[-2000:]


def test_not_registered_without_uptrain():
    """The hook is what registers: without `import uptrain` the types are unknown (so the
    remote-code test in tests/convert/test_classic.py really loads the file beside the weights)."""
    result = run(CHECK)
    assert result.returncode != 0 and "KeyError" in result.stderr


def test_gqa_config_edits_only_what_the_modeling_needs():
    source = {"model_type": "gpt2", "n_head": 8, "n_layer": 2, "n_embd": 64, "architectures": ["GPT2LMHeadModel"],
              "vocab_size": 128}
    config = gqa_config(source, 2)
    assert config == {**source, "model_type": "gpt2_gqa", "num_key_value_heads": 2,
                      "architectures": ["GPT2GQAForCausalLM"], "num_attention_heads": 8, "num_hidden_layers": 2,
                      "hidden_size": 64, "auto_map": {
                          "AutoConfig": "modeling_gpt2_gqa.GPT2GQAConfig",
                          "AutoModel": "modeling_gpt2_gqa.GPT2GQAModel",
                          "AutoModelForCausalLM": "modeling_gpt2_gqa.GPT2GQAForCausalLM"}}
    assert gqa_config(config, 1)["model_type"] == "gpt2_gqa"  # pooling a converted checkpoint further
    llama = {"model_type": "llama", "num_attention_heads": 8}
    assert gqa_config(llama, 2) == {**llama, "num_key_value_heads": 2}
    assert modeling_files("llama") == {}


def test_modeling_files_import_only_torch_and_transformers():
    """What trust_remote_code executes must not need uptrain: only relative imports of the
    files saved beside it."""
    for model_type in GQA_TYPES:
        files = modeling_files(model_type)
        for name, path in files.items():
            for line in path.read_text().splitlines():
                if line.startswith(("import ", "from ")):
                    module = line.split()[1]
                    assert module.split(".")[0] in {"__future__", "torch", "transformers", "math"} or \
                        (module.startswith(".") and f"{module[1:]}.py" in files), (name, line)


@pytest.mark.parametrize("model_type", ["gpt_neox", "opt"])
def test_gqa_counterpart_of_a_model_in_memory(model_type):
    """The class and config an in-memory conversion builds: at G = h, the original's state dict
    loads into it and gives the same logits, bit for bit."""
    import torch

    from tests.modeling.classic_models import build, token_ids
    from uptrain.modeling import gqa_counterpart

    model = build(model_type)
    cls, config = gqa_counterpart(model, 8)
    assert cls.__name__.endswith("GQAForCausalLM") and config.model_type == f"{model_type}_gqa"
    copy = cls(config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(copy(token_ids()).logits, model(token_ids()).logits)
    cls, config = gqa_counterpart(model, 2)
    assert cls(config).config.num_key_value_heads == 2
    llama_cls, llama_config = gqa_counterpart(build_llama(), 2)
    assert llama_cls.__name__ == "LlamaForCausalLM" and llama_config.num_key_value_heads == 2


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4))
