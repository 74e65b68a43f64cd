"""Adapters that plug trainckpt into other trainers. Each submodule imports its trainer only when
it is imported itself (`import trainckpt` never does): `trainckpt.integrations.torchtitan`."""
