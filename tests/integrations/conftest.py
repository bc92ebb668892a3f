"""Shared by the engine-glue tests: a small random surrogate and the forward-mode stand-in (glue_shapes.py)."""

import pytest
import torch

from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
from tests.integrations.glue_shapes import HIDDEN, KV_HEADS, LAYERS


@pytest.fixture(scope="module")
def surrogate():
    torch.manual_seed(3)
    return Surrogate(SurrogateConfig(HIDDEN, KV_HEADS, LAYERS, None)).eval()
