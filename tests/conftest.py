"""Shared fixtures: offline environment and tiny real transformers checkpoints."""

from __future__ import annotations

import os
import tempfile

# Before transformers/datasets/wandb are imported anywhere: no network, no prompts, no
# writes to the user's caches.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="uptrain-test-hf-")
os.environ.setdefault("OMP_NUM_THREADS", "2")
