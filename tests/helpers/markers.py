"""``require_*`` markers for the optional extras. CI installs them all and fails on any skip
(``HF_PMA_FAIL_ON_SKIP=1``, see .ci/run and tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


require_peft = pytest.mark.skipif(_missing("peft"), reason="needs the peft extra (pip install hf-pma[peft])")
require_lm_eval = pytest.mark.skipif(
    _missing("lm_eval"), reason="needs the eval extra (pip install hf-pma[eval])"
)
require_matplotlib = pytest.mark.skipif(
    _missing("matplotlib"), reason="needs the plot extra (pip install hf-pma[plot])"
)
require_trl = pytest.mark.skipif(
    _missing("trl"), reason="needs the clients extra (pip install hf-pma[clients])"
)
require_deepspeed = pytest.mark.skipif(
    _missing("deepspeed"),
    reason="needs the deepspeed extra (pip install hf-pma[deepspeed]; runs on CPU with gloo)",
)
