"""Checkpoints on disk, shared by convert, train, inspect and tracking: safetensors reading and
writing, atomic output folders and locks, sources (local or Hub), provenance digests and
records, and the model card. Imports nothing from convert/, train/, compare/ or modeling/."""
