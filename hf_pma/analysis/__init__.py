"""Understanding a run's snapshots: merge sweeps and weight-space diagnostics."""
