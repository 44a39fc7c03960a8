import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    # Solved block options go to a fresh cache directory, never to the user's ~/.cache/hierremat.
    os.environ["HIERREMAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="hierremat-test-cache-")


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("HIERREMAT_RUN_SLOW") or "slow" in (config.getoption("markexpr") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with HIERREMAT_RUN_SLOW=1 or -m slow")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
