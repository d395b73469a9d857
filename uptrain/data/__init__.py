"""The data: text → token blocks and the batches a run trains and evaluates on.

Shared by training and calibration (a conversion step), so it sits below both: `text` (local
files or a Hub dataset, tokenized and packed into `seq_len` blocks), `shards` (the folder
`uptrain tokenize` writes, memory-mapped) and `tokenize` (the engine that writes it), `corpus`
(the shipped corpus and tokenizer, package data in `uptrain/assets/`), `batches` (the order of
training blocks, streamed shares, evaluation batches), `objective_batches` (a run's objective and
the model inputs it makes of blocks), `pairs` (aligned text and speech examples) and
`document_mask` (packed documents kept apart).
"""
