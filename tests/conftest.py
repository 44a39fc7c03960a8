import os
import shutil
import tempfile

import pytest
import torch


#: The session's cache directory, made by the process that runs pytest and read by its xdist workers
SESSION_CACHE_ENV_VAR = "HIERREMAT_TEST_SESSION_CACHE_DIR"


def pytest_configure(config):
    # Solved block options go to a fresh cache directory, never to the user's ~/.cache/hierremat. The process that
    # runs pytest makes it (and removes it when it ends); its xdist workers, started after this, share it, so a
    # block's menu is solved once per run, not once per worker (the cache's writes are atomic: hierremat.store.cache).
    # Tests that need a cold or a particular cache pass their own (cache=str(tmp_path), cache=False).
    shared = os.environ.get(SESSION_CACHE_ENV_VAR) if os.environ.get("PYTEST_XDIST_WORKER") else None
    if shared is None:
        config._hierremat_cache_dir = shared = tempfile.mkdtemp(prefix="hierremat-test-cache-")
        os.environ[SESSION_CACHE_ENV_VAR] = shared
    os.environ["HIERREMAT_CACHE_DIR"] = shared
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The cores shared among xdist's workers: each with torch's default (a thread per core) oversubscribes
        # them (two workers on two cores: tests/test_shapes.py, test_mixed_precision.py and test_residents.py
        # 298 s -> 233 s with a thread each).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_hierremat_cache_dir", ""), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("HIERREMAT_RUN_SLOW") or "slow" in (config.getoption("markexpr") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with HIERREMAT_RUN_SLOW=1 or -m slow")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(scope="session")
def _interpreted_triton_module():
    pytest.importorskip("triton")
    import importlib.util

    from hierremat import ops

    source = os.path.join(os.path.dirname(ops.__file__), "triton_kernels.py")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("hierremat.ops.triton_kernels_interpreted", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module


@pytest.fixture
def interpreted_triton_kernels(_interpreted_triton_module, monkeypatch):
    """hierremat.ops.triton_kernels built by Triton's interpreter, so that its launchers run
    on CPU tensors (a copy of the module: the one the library imports is untouched).
    ``TRITON_INTERPRET=1`` is set while the kernels are decorated and during the test, when
    the interpreter reads it again."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _interpreted_triton_module
