"""Where a unit's state lives off the device, a tier per kind of state: the tier classes from
the plan (`placement`, which maps each `zero_engine.offload.Tier` to its class), the host's fp32
step gradient (`host_gradient`), NVMe's masters and parameter shards (`nvme`) and step gradient
(`nvme_gradient`) over its swap files (`swap`), and what the tiers open besides the units' state,
registered with the build for the loop to count, agree on and close without naming it (`held`).

Imports `sharding.shards` and the core; nothing above.
"""
