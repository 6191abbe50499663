"""Stage 3's gathering: the hooks and passes around forward and backward (`gatherer`), who holds
each gathered unit and why (`holds`), gathers started ahead (`prefetch`), parameters read
outside the modules that gather them (`param_access`), the root's own methods (`root_methods`),
and the one order of collectives every rank derives from the rows they exchange (`agreement`,
`calls`).

Imports `sharding.shards` to `sharding.reduction` and the core; nothing above.
"""
