"""Pure logic and the on-disk contract: merge strategies, the snapshot schedule, the manifest."""
