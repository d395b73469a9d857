"""Uptraining: data packing, the Accelerate loop, metrics, checkpoint/resume."""
