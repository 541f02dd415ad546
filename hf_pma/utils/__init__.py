"""Helpers every other part uses: atomic file writes, distributed helpers, parsing, formatting, logging."""
