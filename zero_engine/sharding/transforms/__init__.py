"""Module transforms: the one ordered seam where the engine changes what a model's modules
compute (`seam`), and its entries: each unit recomputed in backward or compiled
(`unit_forwards`). A new transform (an attention wrapper over the mesh's groups) is one more
module here and one entry where the engine adds it.

Imports `comm` alone (the mesh); nothing of the rest of `sharding/`.
"""
