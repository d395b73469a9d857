"""uptrain's vLLM plugin (`vllm.general_plugins` entry point `uptrain`, installed with
`uptrain[vllm]`): vLLM model classes for the converted checkpoints vLLM's transformers backend
cannot serve, each built on vLLM's own class of its family with the KV heads read from the
converted config, tensor-parallel as vLLM's is. One module a family:

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

Importing this package imports nothing of vLLM: `register` names each class by its module, and
vLLM imports a module (which imports vLLM) only when it serves that architecture.
"""

from __future__ import annotations

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

    for architecture, cls in CLASSES.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, cls)
