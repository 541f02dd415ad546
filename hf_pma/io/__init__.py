"""File formats, below both the snapshot writers and the merge: safetensors and the sharded layout."""
