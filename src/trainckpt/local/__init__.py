"""The node-local tier (docs/design.md §9, docs/local-tier.md): frequent saves to each node's own
disk, replicas on peers of other nodes, a two-phase commit and a coverage vote."""
