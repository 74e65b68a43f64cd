"""Which checkpoints to keep: save policies, the background remover, and prune."""
