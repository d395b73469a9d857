"""setup's data: the run's training blocks (or examples) and this process's eval batches, read,
tokenized and checked before anything is written (too little data is refused here)."""

from __future__ import annotations

import itertools

from uptrain import UptrainError
from uptrain.data.batches import MicroBatches, StreamedTrainBlocks, TrainBlocks, eval_batches
from uptrain.data.objective_batches import ObjectiveBatches
from uptrain.data.pairs import load_pairs
from uptrain.data.text import TextStream, head_blocks, load_blocks
from uptrain.train.config import TrainConfig


def load_run_data(
    config: TrainConfig,
    accelerator,
    tokenizer,
    global_batch: int,
    objective: ObjectiveBatches,
    model_path: str,
    model_config: dict,
):
    """Tokenized, packed training blocks (or examples) and this process's eval batches; refuses data too short."""
    if objective.objective.reads_examples:
        return _load_pair_data(config, accelerator, tokenizer, global_batch, objective, model_path, model_config)
    world, rank = accelerator.num_processes, accelerator.process_index
    # Rank 0 tokenizes first so that the others read datasets' cache instead of redoing the work.
    with accelerator.main_process_first():
        common = dict(
            tokenizer=tokenizer,
            # The raw block that gives the model seq_len input tokens (span corruption drops tokens).
            seq_len=objective.objective.block_length(config.seq_len),
            text_field=config.text_field,
            sample_by=config.sample_by,
            streaming=config.streaming,
            workers=config.data_workers,
        )
        train_data, train_source = load_blocks(
            config.train_data, "train_data", split=config.train_split, dataset_config=config.dataset_config, **common
        )
        eval_data, eval_source = load_blocks(
            config.eval_data,
            "eval_data",
            split=config.eval_split,
            dataset_config=config.eval_dataset_config or config.dataset_config,
            **common,
        )
    train_blocks: MicroBatches
    if isinstance(train_data, TextStream):
        # The head of the whole stream (as every process sees it): the same decision everywhere.
        available = sum(1 for _ in itertools.islice(iter(train_data), global_batch))
        train_blocks = StreamedTrainBlocks(
            train_data, config.seed, config.batch_size, config.grad_accum, world, rank, config.data_workers or 1
        )
    else:
        available = len(train_data)
        train_blocks = TrainBlocks(train_data, config.seed, config.batch_size, config.grad_accum, world)
    if available < global_batch:
        raise UptrainError(
            f"train_data {train_source.label} gives {available} blocks of {config.seq_len} tokens; one optimizer "
            f"step needs {global_batch}: give more text or a smaller seq_len / batch (global batch: batch_size "
            f"{config.batch_size} × grad_accum {config.grad_accum} × processes {world})"
        )
    evaluated = head_blocks(eval_data, config.eval_blocks)
    eval_set = [
        (objective.eval_batch(rows), counted)
        for rows, counted in eval_batches(evaluated, config.eval_blocks, config.batch_size, rank, world)
    ]
    if not eval_set:
        raise UptrainError(
            f"eval_data {eval_source.label} gives no block of {config.seq_len} tokens: give more "
            "text or a smaller seq_len"
        )
    return train_blocks, eval_set


def _load_pair_data(config: TrainConfig, accelerator, tokenizer, global_batch, objective, model_path, model_config):
    """`pairs` / `speech_pairs`: every example of train_data and eval_data read and checked."""
    world, rank = accelerator.num_processes, accelerator.process_index
    common = dict(
        objective=objective.objective,
        tokenizer=tokenizer,
        model_path=model_path,
        model_config=model_config,
        seq_len=config.seq_len,
        target_len=config.target_len or config.seq_len,
        framing=objective.framing,
    )
    train = load_pairs(config.train_data, "train_data", **common)
    evaluation = load_pairs(config.eval_data, "eval_data", **common)
    if len(train) < global_batch:
        raise UptrainError(
            f"train_data gives {len(train)} examples; one optimizer step needs {global_batch} (batch_size "
            f"{config.batch_size} × grad_accum {config.grad_accum} × processes {world}): give more examples"
        )
    train_blocks = TrainBlocks(train, config.seed, config.batch_size, config.grad_accum, world)
    return train_blocks, eval_batches(evaluation, config.eval_blocks, config.batch_size, rank, world)
