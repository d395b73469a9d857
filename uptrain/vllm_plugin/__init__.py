"""uptrain's vLLM plugin (`vllm.general_plugins` entry point `uptrain`, installed with
`uptrain[vllm]`): vLLM model classes for the converted checkpoints vLLM's transformers backend
cannot serve, each built on vLLM's own class of its family (of vLLM's layers where vLLM has
none) with the KV heads read from the converted config, tensor-parallel as vLLM's is. One
module a family:

- `gpt2`: GPT-2 (`gpt2_gqa`), whose vLLM class assumes full multi-head attention;
- `bloom`: BLOOM (`bloom_gqa`), ALiBi (the transformers backend's attention takes no score bias);
- `falcon`: multi-head Falcon (`falcon_gqa`, ALiBi or rotary), whose vLLM class reads its KV
  heads from `multi_query` and `new_decoder_architecture` only;
- `gpt_neo`: GPT-Neo (`gpt_neo_gqa`), of vLLM's layers (vLLM 0.32 has no GPT-Neo class; the
  transformers backend's attention takes no mask, so local layers would lose their window);
- `mpt`: MPT (`mpt_gqa`), ALiBi, of vLLM's layers (vLLM 0.32 has no MPT class);
- `whisper`: Whisper (`whisper_gqa`), an encoder–decoder (the transformers backend serves
  decoder-only models), G KV heads in the encoder, the decoder's self-attention and its
  cross-attention, whose cache over the encoder's 1500 frames is where GQA saves most.

`attention` holds the fused-QKV attention over G KV heads that GPT-2, BLOOM, MPT and GPT-Neo
share, BLOOM's ALiBi slopes and the repacking of a fused QKV grouped per KV head (BLOOM's and
Falcon's); `causal_lm` a pipeline stage's blocks and the head on the model (every decoder-only
family's) and the causal-LM wrapper of the two built of vLLM's layers.

Importing this package imports nothing of vLLM; `register` (which vLLM calls in each of its
processes) imports the modules and registers their classes themselves: vLLM inspects a class
named only by its module in a fresh Python process, which imports vLLM again (15–25 s on a CPU,
for each class, whenever this package changes).
"""

from __future__ import annotations

import importlib

# Architecture name (config.json's `architectures`) → the module and class serving it.
CLASSES = {
    "GPT2GQAForCausalLM": f"{__name__}.gpt2:GPT2GQAForCausalLM",
    "BloomGQAForCausalLM": f"{__name__}.bloom:BloomGQAForCausalLM",
    "FalconGQAForCausalLM": f"{__name__}.falcon:FalconGQAForCausalLM",
    "GPTNeoGQAForCausalLM": f"{__name__}.gpt_neo:GPTNeoGQAForCausalLM",
    "MptGQAForCausalLM": f"{__name__}.mpt:MptGQAForCausalLM",
    "WhisperGQAForConditionalGeneration": f"{__name__}.whisper:WhisperGQAForConditionalGeneration",
}


def register() -> None:
    """vLLM's plugin hook: the GQA architectures' classes, by their config's `architectures` name."""
    from vllm import ModelRegistry

    for architecture, target in CLASSES.items():
        if architecture not in ModelRegistry.get_supported_archs():
            module, name = target.split(":")
            ModelRegistry.register_model(architecture, getattr(importlib.import_module(module), name))
