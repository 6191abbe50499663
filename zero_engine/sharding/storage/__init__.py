"""A unit's storage: the shard arithmetic (`layout`), where the optimizer's side lives
(`placement`, `host_gradient`), the master and optimizer shard of each unit
(`optimizer_shard`), and how values travel in gathers and reductions (`codec`: exact or
quantized); what the tiers open besides the units' state, registered with the build for the
loop to count, agree on and close without naming it (`held`: NVMe's swap spaces, `swap`).

The bottom of `sharding/`: imports nothing else of it (only `comm`, `devices`, `offload`,
`quantize`).
"""
