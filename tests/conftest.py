import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    # Solved block options go to a fresh cache directory, never to the user's ~/.cache/hierremat.
    os.environ["HIERREMAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="hierremat-test-cache-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
