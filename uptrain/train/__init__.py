"""Uptraining: the Accelerate loop (setup, step, optimizer, report), metrics, checkpoint/resume.
Its data (blocks, batches, objectives' inputs) come from `uptrain.data`."""
