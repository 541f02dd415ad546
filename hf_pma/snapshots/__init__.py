"""Taking snapshots during training: gathering weights, writing them, the ``PMACallback``."""
