"""A unit's storage: the shard arithmetic (`layout`), where the optimizer's side lives
(`placement`, `host_gradient`), the master and optimizer shard of each unit
(`optimizer_shard`), and how values travel in gathers and reductions (`codec`: exact or
quantized).

The bottom of `sharding/`: imports nothing else of it (only `comm`, `devices`, `offload`,
`quantize`).
"""
