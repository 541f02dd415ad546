"""Reading checkpoints and merging them: sources, bounded-memory safetensors IO, the streaming engine, weight swaps."""
