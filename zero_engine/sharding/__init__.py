"""The sharding mechanism: how parameters, gradients and optimizer state are split and moved.

Sub-packages by concern, each importing only those listed before it (and the core below
`sharding/`: `comm`, `devices`, `offload`, `quantize`, `stage`, `param_groups`, `errors`):

1. `storage`: a unit's storage: shard arithmetic (`layout`), where its optimizer side lives
   (`placement`, `host_gradient`), its master and optimizer shard (`optimizer_shard`), how its
   values travel in gathers and reductions (`codec`);
2. `units`: the unit kinds (`unit`, `frozen_unit`, `quantized_frozen`), the training state they
   share (`lifecycle`) and the plan that decides them (`module_plan`, `unit_plan`);
3. `reduction`: gradients reduced during backward (`reducer`, `bucket_reducer`);
4. `gathering`: stage 3's gathers around forward and backward (`gatherer`, `holds`,
   `prefetch`, `param_access`, `root_methods`) and the agreement that orders them on every
   rank (`agreement`, `calls`);
5. `building`: the mechanism a stage needs, built from the plan (`build`), and models
   materialized from the meta device (`deferred_init`).

It uses `zero_engine.comm` for every collective and never imports `zero_engine.state`,
`zero_engine.transforms` (the module transforms, beside it) or the engine.
"""
