"""Show hf-pma's log records the way transformers shows its own.

hf-pma's modules log to loggers named ``hf_pma.*`` (through ``transformers.utils.logging``, or
:func:`get_logger` in the modules that must not import transformers: the same loggers), which
are not children of the ``transformers`` logger, so ``transformers.logging.set_verbosity_info()``
alone does not show them. The CLI, the scripts and :class:`hf_pma.PMATrainer` call
:func:`enable_logging`; a library user can too, or configure the ``hf_pma`` logger themselves.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["enable_logging", "get_logger"]

_HANDLER_NAME = "hf_pma_default_handler"


def enable_logging(level: int | None = None) -> None:
    """Send ``hf_pma`` log records to stderr at ``level`` (default: transformers' verbosity).

    Adds one handler, once, unless handlers are already configured (on ``hf_pma`` or the root
    logger); records still propagate, so ``logging`` setups and test captures see them.
    """
    if level is None:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
    logger = logging.getLogger("hf_pma")
    logger.setLevel(level)
    if logger.handlers or logging.getLogger().handlers:
        return  # the user configured logging: records propagate to their handlers
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(asctime)s >> %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` without importing transformers (the one
    ``transformers.utils.logging.get_logger(name)`` returns for an ``hf_pma.*`` name); for the
    modules of the torch-free merge path."""
    return logging.getLogger(name)
