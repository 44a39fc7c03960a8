"""Faults: each is recovered with one clear warning and never gives a wrong result.

A solver that errors or is missing; an ILP solution the evaluation or the simulator rejects
(discarded, never executed, logged as a bug with the block signature); a cache directory
that is unwritable, full, unsearchable or a file; entries of another torch version; the
C++ extension failing to build.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.store import cache as cache_module
from hierremat.ilp import options as options_module
from hierremat.ilp import solve as solve_module
from hierremat.ilp import BlockIlp, simulate_option, solve_count, solve_menu
from hierremat.store.cache import OptionsCache
from hierremat.device import LiveTensorTracker
from hierremat.planning.menus import build_menus
from hierremat.ops import packed_bits

from test_ilp import small_graphs


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 24))
                           for _ in range(4)]).train()


def _train_checked(model: nn.Sequential, budget: str, x: torch.Tensor) -> hr.SequentialPlan:
    """checkpoint_sequential at ``budget``: gradients equal plain autograd's, peak within the budget."""
    reference = copy.deepcopy(model)
    torch.manual_seed(3)
    reference(x).sum().backward()
    plan = hr.plan_sequential(model, budget, x)
    hr.checkpoint_sequential(model, budget, x)  # plans outside the measured step
    torch.manual_seed(3)
    with LiveTensorTracker() as tracker:
        hr.checkpoint_sequential(model, budget, x).sum().backward()
    assert tracker.peak_bytes <= hr.parse_budget(budget)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    return plan


def _warnings(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(logger) and r.levelno >= logging.WARNING]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory for this test (nothing solved earlier in the session is found)."""
    monkeypatch.setenv("HIERREMAT_CACHE_DIR", str(tmp_path / "cache"))
    hr.plan_cache.clear()
    yield tmp_path / "cache"
    hr.plan_cache.clear()


# ------------------------------------------------------------------------------------ solvers


def test_gurobi_license_error_falls_back_to_highs_with_one_warning(monkeypatch, caplog, fresh_session):
    monkeypatch.setattr(solve_module, "_gurobi_available", lambda: True)
    calls = []

    def license_error(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Model too large for size-limited license; visit https://gurobi.com/unrestricted")

    monkeypatch.setattr(solve_module, "_solve_gurobi", license_error)
    caplog.set_level(logging.DEBUG, logger="hierremat")
    for graph in small_graphs(7, 3):
        highs = BlockIlp(graph).solve(backend="highs")
        auto = BlockIlp(graph).solve(backend="auto")
        assert auto.backend == "highs" and auto.status == highs.status == "optimal"
        assert auto.objective == pytest.approx(highs.objective, rel=1e-9)
    assert len(calls) == 1, "Gurobi is not tried again once it failed"
    warned = _warnings(caplog, "hierremat.ilp")
    assert len(warned) == 1 and "size-limited license" in warned[0] and "HiGHS" in warned[0]


def test_gurobipy_missing_uses_highs_silently(monkeypatch, caplog):
    monkeypatch.setattr(solve_module, "_gurobi_available", lambda: False)
    caplog.set_level(logging.DEBUG, logger="hierremat")
    (graph,) = small_graphs(8, 1)
    assert BlockIlp(graph).solve(backend="auto").backend == "highs"
    assert not _warnings(caplog, "hierremat")


def test_a_failing_solver_leaves_the_blocks_with_autograds_option(monkeypatch, caplog, fresh_cache, fresh_session):
    def broken(*args, **kwargs):
        raise RuntimeError("HiGHS failed on the block ILP: status 4, model error")

    monkeypatch.setattr(solve_module, "_solve_highs", broken)
    monkeypatch.setattr(solve_module, "_gurobi_available", lambda: False)
    caplog.set_level(logging.INFO, logger="hierremat")
    model, x = _mlp(), torch.randn(32, 24, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    plan = _train_checked(model, f"{err.value.min_budget_bytes}B", x)
    assert all(len(stage.options) == 1 for stage in plan.costs.stages)  # autograd's option only
    warned = _warnings(caplog, "hierremat")
    assert len(warned) == 1 and "status 4" in warned[0] and "autograd's option only" in warned[0]


def test_a_rejected_ilp_solution_is_discarded_and_logged_as_a_bug(monkeypatch, caplog):
    real_evaluate = solve_module.evaluate
    rejected = []

    def evaluate_some_invalid(st, d):
        ev = real_evaluate(st, d)
        if len(rejected) % 2 == 0:  # every other solution is "outside the family"
            rejected.append(d)
            return type(ev)(**{**ev.__dict__, "valid": False, "why": "node 3 recomputed before its input"})
        rejected.append(None)
        return ev

    monkeypatch.setattr(solve_module, "evaluate", evaluate_some_invalid)
    caplog.set_level(logging.INFO, logger="hierremat")
    (graph,) = small_graphs(9, 1)
    menu = solve_menu(graph, label="block-sig-1234")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all("block-sig-1234" in e and "bug" in e for e in errors)
    assert menu.options, "the menu goes on with what is valid (keep-all at least)"
    for option in menu.options:
        simulate_option(graph, option)  # every option offered replays


def test_an_option_whose_op_lists_do_not_replay_is_never_offered(monkeypatch, caplog):
    real_make_option = options_module.make_option

    def broken_op_lists(st, d, name, *args, **kwargs):
        if name.startswith("ilp_"):
            raise ValueError("backward op 4: add_1 reads ['mul'], not in memory")
        return real_make_option(st, d, name, *args, **kwargs)

    monkeypatch.setattr(options_module, "make_option", broken_op_lists)
    caplog.set_level(logging.INFO, logger="hierremat")
    (graph,) = small_graphs(10, 1)
    menu = solve_menu(graph, label="block-sig-5678")
    assert all(not o.name.startswith("ilp_") for o in menu.options)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "block-sig-5678" in errors[0] and "not in memory" in errors[0]


# ------------------------------------------------------------------------------------ cache


def test_a_full_disk_plans_anyway_with_one_warning(monkeypatch, caplog, fresh_cache):
    def no_space(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_module, "_atomic_write", no_space)
    caplog.set_level(logging.INFO, logger="hierremat")
    model, x = _mlp(1), torch.randn(32, 24, requires_grad=True)
    _train_checked(model, "64MiB", x)
    warned = _warnings(caplog, "hierremat")
    assert len(warned) == 1 and "No space left on device" in warned[0]


def test_a_cache_path_that_is_a_file_plans_anyway_with_one_warning(tmp_path, monkeypatch, caplog):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("not a directory")
    monkeypatch.setenv("HIERREMAT_CACHE_DIR", str(not_a_dir))
    hr.plan_cache.clear()
    caplog.set_level(logging.INFO, logger="hierremat")
    _train_checked(_mlp(2), "64MiB", torch.randn(32, 24, requires_grad=True))
    warned = _warnings(caplog, "hierremat")
    assert len(warned) == 1 and "could not write" in warned[0]
    assert not_a_dir.read_text() == "not a directory"


def test_an_unsearchable_cache_directory_is_a_miss_with_one_warning(tmp_path, monkeypatch, caplog):
    directory = tmp_path / "locked"
    cache = OptionsCache(directory)
    key = cache_module.CacheKey("sig", "cpu", "x", "float32", "v", "f")
    cache.put(key, {"a": 1})
    cache.forget_memory()
    real_exists = pathlib.Path.exists

    def exists(path, *args, **kwargs):
        if directory in path.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_exists(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "exists", exists)
    caplog.set_level(logging.INFO, logger="hierremat")
    assert cache.get(key) is None and cache.get(key) is None
    warned = _warnings(caplog, "hierremat")
    assert len(warned) == 1 and "Permission denied" in warned[0]


@pytest.mark.parametrize("field, skew", [("cost_model_version", "torch"), ("device_name", "device")])
def test_entries_of_another_torch_version_or_device_are_not_used(fresh_cache, field, skew):
    model, x = _mlp(4), torch.randn(32, 24, requires_grad=True)
    hr.plan_sequential(model, "64MiB", x)
    first = OptionsCache(fresh_cache)
    entries = [e for e in first.entries() if e["valid"]]
    assert entries and all(e["cost_model_version"].endswith(f"/torch-{torch.__version__}") for e in entries)
    # the same entries, as another torch version or device wrote them, in a new directory
    other_dir = fresh_cache.parent / f"other-{skew}"
    other = OptionsCache(other_dir)
    for e in entries:
        key = cache_module.CacheKey(**{k: e[k] for k in ("signature", "device_type", "device_name", "dtype",
                                                         "cost_model_version", "formulation_version")})
        payload = first.get(key)
        skewed_value = (key.cost_model_version.replace(f"torch-{torch.__version__}", "torch-1.13.0")
                        if field == "cost_model_version" else "NVIDIA H100 80GB HBM3")
        skewed = cache_module.CacheKey(**{**key.to_dict(), field: skewed_value})
        other.put(skewed, payload)
    hr.plan_cache.clear()
    before = solve_count()
    build_menus(list(_mlp(4).children()), x, (), None, cache=OptionsCache(other_dir))
    assert solve_count() > before, f"entries of another {skew} were used"


# ------------------------------------------------------------------------------------ C++ extension


def test_cpp_extension_failing_to_build_uses_the_torch_kernels(monkeypatch, caplog, tmp_path):
    """A build that fails (no compiler here: a fresh build directory, and CXX naming none) leaves the pure-torch
    kernels in use, with one warning that quotes the build's error."""
    monkeypatch.delenv("HIERREMAT_NO_EXTENSION", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    packed_bits.load_cpu_kernels.cache_clear()
    caplog.set_level(logging.INFO, logger="hierremat")
    try:
        assert packed_bits.load_cpu_kernels() is False
        assert packed_bits.load_cpu_kernels() is False
        warned = _warnings(caplog, "hierremat")
        assert len(warned) == 1 and "no-compiler: not found" in warned[0] and "pure-torch" in warned[0], warned
        # the reference kernels are bitwise native dropout's
        torch.manual_seed(0)
        x = torch.randn(1000)
        out, mask = torch.ops.aten.native_dropout(x, 0.3, True)
        bits = packed_bits.pack_mask_reference(mask)
        assert torch.equal(packed_bits.masked_scale_reference(x, bits, 1 / 0.7), out)
    finally:
        packed_bits.load_cpu_kernels.cache_clear()  # later tests load the real kernels again


def test_a_build_lock_left_by_a_killed_build_is_removed_with_one_warning(tmp_path, caplog):
    """torch waits for a build lock until it goes: one a killed build left would hang every later process."""
    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - packed_bits.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    caplog.set_level(logging.WARNING, logger="hierremat")
    for lock in (stale, fresh, tmp_path / "absent" / "lock"):
        packed_bits._remove_stale_lock(lock)
    assert not stale.exists() and fresh.exists()
    warned = _warnings(caplog, "hierremat")
    assert len(warned) == 1 and "build lock" in warned[0]


def test_a_library_a_killed_build_left_unfinished_is_built_again(tmp_path):
    """A library file that does not load (a build killed while linking) is removed and built again, in a process of
    its own (a fresh extensions directory: the real build, not the one the suite loaded)."""
    name = packed_bits.extension_name()
    (tmp_path / name).mkdir()
    library = tmp_path / name / f"{name}.so"
    library.write_bytes(b"\x7fELF unfinished")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("HIERREMAT_NO_EXTENSION", None)
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from hierremat.ops import packed_bits; "
                               "sys.exit(0 if packed_bits.load_cpu_kernels() else 1)"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert library.stat().st_size > 1000


def test_the_kernels_build_once_per_torch_release():
    assert packed_bits.extension_name().startswith("hierremat_packed_bits_")
    assert torch.__version__.split("+")[0].replace(".", "_") in packed_bits.extension_name()
