"""Shared fixtures. Nothing here touches the network (see ``tests/testing_utils.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.testing_utils import REPO_ROOT, train_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Scripts launched by the tests (torchrun, accelerate, python) import ``tests.*`` like the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A session-wide tiny byte-level BPE tokenizer (vocab 512)."""
    return train_tiny_tokenizer()


