import os

import pytest
import torch

# Tests must never reach the network; any attempt should fail fast and loudly.
os.environ.setdefault("CAPSNET_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
