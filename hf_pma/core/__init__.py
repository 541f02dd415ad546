"""Pure logic and the on-disk contract: merge strategies, merge windows, the snapshot schedule, the manifest."""
