"""The `trainckpt` command: its subcommands, their output, inspect and export."""
