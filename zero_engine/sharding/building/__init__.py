"""Building the mechanism a stage needs from the unit plan (`build`: units, gatherer, reducer,
codecs), the settings a mixture of experts needs under the sequence split (`conditional`: its
block one unit, its reductions in one order), and materializing models built on the meta device
(`deferred_init`).

The top of `sharding/`: may import every sub-package below it.
"""
