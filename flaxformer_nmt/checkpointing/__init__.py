"""Orbax checkpoints, averaging, the best checkpoint and the workdir."""
