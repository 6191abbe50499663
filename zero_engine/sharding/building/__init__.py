"""Building the mechanism a stage needs from the unit plan (`build`: units, gatherer, reducer,
codecs) and materializing models built on the meta device (`deferred_init`).

The top of `sharding/`: may import every sub-package below it.
"""
