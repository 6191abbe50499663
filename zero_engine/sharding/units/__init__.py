"""The unit kinds and their plan: flat units whose parameters are views (`unit`), stage 3's
frozen units (`frozen_unit`) and those kept in int8 (`quantized_frozen`), the training state
the hooks share (`lifecycle`), and the plan that decides every unit before any is built
(`module_plan` for stage 3's modules, `unit_plan`), with each planned parameter's placement
(`param_placement`: global shape, this rank's box, compute layout).

Imports `sharding.shards`, `sharding.tiers`, `sharding.optimizer_side` and the core (`comm`, `devices`, `stage`, `param_groups`,
`quantize`, `errors`); nothing above.
"""
