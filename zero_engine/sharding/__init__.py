"""The sharding mechanism: how parameters, gradients and optimizer state are split and moved.

Sub-packages by concern, each importing only those listed before it (and the core below
`sharding/`: `comm`, `devices`, `offload`, `quantize`, `stage`, `param_groups`, `errors`):

1. `shards`: a unit's values and how they are cut and travel (`layout`, `param_shard`, `codec`);
2. `tiers`: where its state lives off the device (`placement`, `host_gradient`, `nvme`,
   `nvme_gradient`, `swap`) and what the tiers hold, registered with the build (`held`);
3. `optimizer_side`: its master and optimizer shard (`optimizer_shard`) and a whole-matrix
   optimizer's compute layout (`compute_layout`);
4. `units`: the unit kinds (`unit`, `frozen_unit`, `quantized_frozen`), the training state they
   share (`lifecycle`) and the plan that decides them (`module_plan`, `unit_plan`);
5. `reduction`: gradients reduced during backward (`reducer`, `bucket_reducer`);
6. `gathering`: stage 3's gathers around forward and backward (`gatherer`, `holds`,
   `prefetch`, `param_access`, `root_methods`) and the agreement that orders them on every
   rank (`agreement`, `calls`);
7. `building`: the mechanism a stage needs, built from the plan (`build`), and models
   materialized from the meta device (`deferred_init`).

It uses `zero_engine.comm` for every collective and never imports `zero_engine.state`,
`zero_engine.transforms` (the module transforms, beside it) or the engine.
"""
