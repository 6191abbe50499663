"""Module transforms: what the engine changes of what a model's modules compute, beside the
sharding mechanism. The one ordered seam (`seam`: two phases, a transform's target, the loop's
hooks) and the table of which transforms an engine applies (`table`); its entries: no key/value
cache in training (`no_cache`), Ulysses sequence parallelism (`ulysses`, and its loop's calls:
`sequence_loop`), the loss and the MLPs in tiles (`tiled_loss`, `tiled_mlp`), each unit
recomputed or compiled (`unit_forwards`, with its kept inputs on the host: `offloaded_inputs`).
A new transform is one module here and one row in the table.

Imports `comm` and, of `sharding/`, the call rows alone (`sharding.gathering.agreement`);
nothing in `sharding/` imports it.
"""
