"""Taking snapshots during training: gather (weights off DDP/FSDP/ZeRO-3), writer (files, manifest), sinks (what happens to a snapshot), callback."""
