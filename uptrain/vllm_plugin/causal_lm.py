"""What the plugin's classes built of vLLM's layers share (MPT, GPT-Neo, which have no vLLM class
to extend): a pipeline stage's pass through its blocks, and the causal-LM wrapper (the model
under `transformer`, the head tied to its `wte` unless the config unties them, weights loaded
by their transformers names)."""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors


def stage_forward(model: nn.Module, embed, blocks: nn.ModuleList, norm: nn.Module, intermediate_tensors):
    """This pipeline stage's blocks of `model` (its `start_layer` to `end_layer`) over the
    embeddings (`embed()`, the first stage) or the previous stage's states; the final `norm`
    after the last stage's."""
    hidden_states = embed() if get_pp_group().is_first_rank else intermediate_tensors["hidden_states"]
    for block in blocks[model.start_layer : model.end_layer]:
        hidden_states = block(hidden_states)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states})
    return norm(hidden_states)


class CausalLM(nn.Module):
    """A causal LM of `model_class` (set by each subclass); `hf_to_vllm_mapper` renames weights
    where the model's names differ from the checkpoint's (None: they do not)."""

    model_class: type[nn.Module]
    hf_to_vllm_mapper = None

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.transformer = self.model_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "transformer"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.transformer.wte)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.transformer.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.transformer(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights):
        """The checkpoint's tensors, by their transformers names (through `hf_to_vllm_mapper`)."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
