"""What a checkpoint is, with nothing multi-rank: the folder layout, the records, the shard and
trainer-state file formats, the safe readers of hostile bytes, and the offline verify."""
