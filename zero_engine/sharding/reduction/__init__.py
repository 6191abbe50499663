"""Gradients reduced during backward: per unit (`reducer`) and in buckets of several units
(`bucket_reducer`), over the mesh's groups, each rank keeping its shard.

Imports `sharding.shards` to `sharding.units` and the core; nothing above.
"""
