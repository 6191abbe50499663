"""The sharding mechanism: how parameters, gradients and optimizer state are split and moved.

Shard arithmetic (`layout`), flat units (`unit`), the stage table (`stages`), building the
units a stage needs (`build`, `module_plan` for stage 3), gradient reduction during backward
(`reducer`), stage 3 gathering (`gatherer`) and meta-device materialization (`deferred_init`).
It uses `zero_engine.comm` for every collective and never imports `zero_engine.state` or the
engine.
"""
