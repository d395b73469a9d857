"""What the plugin's decoder-only classes share: a pipeline stage's blocks (`stage_blocks`) and
the head on the model (`attach_head`), for those extending vLLM's class of their family (GPT-2,
BLOOM, Falcon) and those built of vLLM's layers (MPT, GPT-Neo, which have no vLLM class to
extend); for the latter, the stage's pass through its blocks and the causal-LM wrapper (the model
under `transformer`, the head tied to its `wte` unless the config unties them, weights loaded by
their transformers names)."""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

# The dimension of each argument of a model's forward that varies with the batch's tokens, for
# its compile decorator (spelled out: these modules' annotations are strings, which the decorator
# does not read).
TOKEN_DIMS = {"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}


def stage_blocks(model: nn.Module, block_class: type[nn.Module], *, vllm_config, prefix: str) -> nn.ModuleList:
    """The config's `num_hidden_layers` blocks of `block_class` (built as `(config, cache_config,
    quant_config, prefix=…)`), this pipeline stage's of them real (make_layers): sets `model`'s
    `start_layer`, `end_layer` and `make_empty_intermediate_tensors` (the states a stage passes on)."""
    config = vllm_config.model_config.hf_config
    model.start_layer, model.end_layer, blocks = make_layers(
        config.num_hidden_layers,
        lambda prefix: block_class(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix),
        prefix=prefix,
    )
    model.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
        ["hidden_states"], config.hidden_size
    )
    return blocks


def attach_head(lm: nn.Module, model_class: type[nn.Module], *, vllm_config, prefix: str, embeddings: str, tied: bool):
    """Sets a causal LM's `config`, `quant_config`, its model of `model_class` under `transformer`,
    its head (tied to the model's `embeddings` where `tied`), `logits_processor` and
    `make_empty_intermediate_tensors` (the model's): what vLLM's causal-LM classes set."""
    config = vllm_config.model_config.hf_config
    lm.config, lm.quant_config = config, vllm_config.quant_config
    lm.transformer = model_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "transformer"))
    lm.lm_head = ParallelLMHead(
        config.vocab_size, config.hidden_size, quant_config=lm.quant_config, prefix=maybe_prefix(prefix, "lm_head")
    )
    if tied:
        lm.lm_head = lm.lm_head.tie_weights(getattr(lm.transformer, embeddings))
    lm.logits_processor = LogitsProcessor(config.vocab_size)
    lm.make_empty_intermediate_tensors = lm.transformer.make_empty_intermediate_tensors


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
        tied = vllm_config.model_config.hf_config.tie_word_embeddings
        attach_head(self, self.model_class, vllm_config=vllm_config, prefix=prefix, embeddings="wte", tied=tied)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.transformer(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights):
        """The checkpoint's tensors, by their transformers names (through `hf_to_vllm_mapper`)."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
