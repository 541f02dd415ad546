"""Show hf-pma's log records the way transformers shows its own.

hf-pma's modules log to loggers named ``hf_pma.*`` (through ``transformers.utils.logging``), which
are not children of the ``transformers`` logger, so ``transformers.logging.set_verbosity_info()``
alone does not show them. The CLI, the scripts and :class:`hf_pma.PMATrainer` call
:func:`enable_logging`; a library user can too, or configure the ``hf_pma`` logger themselves.
"""

from __future__ import annotations

import logging
import sys

from transformers.utils import logging as hf_logging

__all__ = ["enable_logging"]

_HANDLER_NAME = "hf_pma_default_handler"


def enable_logging(level: int | None = None) -> None:
    """Send ``hf_pma`` log records to stderr at ``level`` (default: transformers' verbosity).

    Adds one handler, once, unless handlers are already configured (on ``hf_pma`` or the root
    logger); records still propagate, so ``logging`` setups and test captures see them.
    """
    logger = logging.getLogger("hf_pma")
    logger.setLevel(hf_logging.get_verbosity() if level is None else level)
    if logger.handlers or logging.getLogger().handlers:
        return  # the user configured logging: records propagate to their handlers
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(asctime)s >> %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
