"""The optimizer's side of a unit: its master and optimizer shard, the step's views of them and
the pieces a checkpoint saves (`optimizer_shard`), and a whole-matrix optimizer's compute layout
(`compute_layout`: each matrix gathered on one owner, in windows).

Imports `sharding.shards`, `sharding.tiers` and the core; nothing above.
"""
