"""A unit's values and how they are cut and travel: the shard arithmetic of flat units
(`layout`), a parameter shard and its kinds (`param_shard`: the device's, the host's, an int8
one), and how values cross in gathers and reductions (`codec`: a codec per wire form, exact or
quantized).

The bottom of `sharding/`: imports nothing else of it (only `comm`, `devices`, `offload`,
`quantize`).
"""
