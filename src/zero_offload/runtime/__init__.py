"""The training runtime, one folder per axis: ``reduce/`` (gradients), ``stage3/`` (partitioned
params), ``update/`` (where the states live and the update per placement), ``engine/`` (the
assembly and the training loop). See docs/architecture.md for who may import what."""
