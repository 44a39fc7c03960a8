import os
import shutil
import tempfile

import pytest
import torch


#: A directory for the whole test session, made by the process that runs pytest and shared by its xdist workers
#: (tests/test_distributed.py keeps its one-process reference runs there)
SESSION_DIR_ENV_VAR = "HIERREMAT_TEST_SESSION_DIR"


def pytest_configure(config):
    # Solved block options go to a fresh cache directory, never to the user's ~/.cache/hierremat.
    # Each process (the xdist controller and every worker) makes its own and removes it when it ends: shared by the
    # workers, a test's cache would follow what another worker was solving at that moment (a warm cache builds block
    # options at once where a cold one defers them, and FSDP2's first plan then reads other times).
    config._hierremat_dirs = [tempfile.mkdtemp(prefix="hierremat-test-cache-")]
    os.environ["HIERREMAT_CACHE_DIR"] = config._hierremat_dirs[0]
    if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(SESSION_DIR_ENV_VAR)):
        config._hierremat_dirs.append(tempfile.mkdtemp(prefix="hierremat-test-session-"))
        os.environ[SESSION_DIR_ENV_VAR] = config._hierremat_dirs[-1]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The cores shared among xdist's workers: each with torch's default (a thread per core) oversubscribes
        # them (two workers on two cores: tests/test_shapes.py, test_mixed_precision.py and test_residents.py
        # 298 s -> 233 s with a thread each).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config):
    for directory in getattr(config, "_hierremat_dirs", ()):
        shutil.rmtree(directory, ignore_errors=True)


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
def fresh_session():
    """A planner session of the test's own (hierremat.session): no menu, solver record or tier of an earlier test."""
    from hierremat.session import planner_session

    with planner_session() as session:
        yield session


#: Seconds a block ILP's solves and sweep get under ``unhurried_ilp``: enough for a small block on a loaded runner.
UNHURRIED_SECONDS = 600.0


@pytest.fixture
def unhurried_ilp(monkeypatch):
    """Block menus solved without their default wall-clock limits (MENU_TIME_LIMIT per solve, MENU_SWEEP_LIMIT per
    sweep): a test of what the solver finds, not of how fast a loaded machine finds it."""
    from hierremat.ilp import options
    from hierremat.planning import menus

    monkeypatch.setitem(options.solve_menu.__kwdefaults__, "sweep_limit", UNHURRIED_SECONDS)
    monkeypatch.setitem(menus.build_menus.__kwdefaults__, "time_limit", UNHURRIED_SECONDS)


@pytest.fixture
def interpreted_triton_kernels(_interpreted_triton_module, monkeypatch):
    """hierremat.ops.triton_kernels built by Triton's interpreter, so that its launchers run
    on CPU tensors (a copy of the module: the one the library imports is untouched).
    ``TRITON_INTERPRET=1`` is set while the kernels are decorated and during the test, when
    the interpreter reads it again."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _interpreted_triton_module
