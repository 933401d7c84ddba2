"""Gradient reduction: backward hooks, buckets, collectives, and the rank's gradient shard."""
