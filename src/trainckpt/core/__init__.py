"""How ranks save and load a checkpoint together: process groups, staging, the commit protocol,
claims and locks, and the DCP glue."""
