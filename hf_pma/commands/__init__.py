"""Sub-commands of the ``hf-pma`` CLI (see :mod:`hf_pma.cli`)."""
