"""The planner session (hierremat.session): the one owner of what a process keeps between plans. Its memos are
bounded, a fresh session shares nothing with the process's, closing it closes the tiers it opened, an id-keyed map
holds no tensor alive, and no module of hierremat keeps a growing container of its own."""

import ast
import gc
import os
import pathlib
import weakref

import pytest
import torch

import hierremat as hr
from hierremat.api import sequential
from hierremat.ilp import solve_count
from hierremat.ops.grad_in_place import added_gradient
from hierremat.runtime.offload import second_tier
from hierremat.session import LruMemo

PACKAGE = pathlib.Path(hr.__file__).parent
#: The one module-level container that may grow: the stack of open sessions.
OWNER = ("session.py", "_SESSIONS")


def test_a_memo_keeps_its_capacity_and_forgets_the_least_recently_used():
    memo = LruMemo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # ("b" is now the least recently used)
    memo.put("c", 3)
    assert len(memo) == 2 and memo.get("b") is None and memo.get("a") == 1 and memo.get("c") == 3
    with pytest.raises(ValueError, match="capacity"):
        LruMemo(0)


def test_a_fresh_session_shares_nothing_and_is_closed_after_its_block():
    outer = hr.current_session()
    outer.ilp_solves += 1  # (a solve of the process's session)
    with hr.planner_session() as inner:
        assert hr.current_session() is inner is not outer
        assert solve_count() == 0 and len(inner.solved_menus) == 0
        assert inner.first_time("message") and not inner.first_time("message")
        assert sequential.plan_cache is not outer.opened("checkpoint_sequential plans", sequential.PlanCache)
    assert hr.current_session() is outer and outer.first_time("message") and solve_count() == outer.ilp_solves
    assert inner.closed
    with pytest.raises(RuntimeError, match="closed"):
        inner.opened("anything", dict)


def test_a_tier_opened_in_a_session_is_shared_there_and_closed_with_it(tmp_path):
    with hr.planner_session():
        offloading = second_tier(str(tmp_path), "1MiB", "cpu", None)
        assert second_tier(str(tmp_path), 2**20, "cpu", None) is offloading  # (one tier for one directory, limit)
        directory = offloading._tier.directory
        assert os.path.isdir(directory)
    assert not os.path.exists(directory)


def test_the_stand_in_gradients_map_holds_no_weight_alive():
    with hr.planner_session():
        weight = torch.nn.Parameter(torch.randn(4, 4))
        weight.grad = torch.zeros(4, 4)
        with torch.no_grad():
            assert added_gradient(weight) is not None
        freed = weakref.ref(weight)
        del weight
        gc.collect()
        assert freed() is None


def test_checkpoint_sequentials_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(sequential, "PLANS_KEPT", 2)
    cache = sequential.PlanCache()
    for key in "abc":
        cache.put(key, key)
    assert cache.get("a") is None and cache.get("b") == "b" and cache.get("c") == "c"


def _growing_containers(path: pathlib.Path):
    """(name, line) of the module-level assignments of an empty container in ``path`` (a cache or registry)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            empty = (isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(value, "keys", getattr(
                value, "elts", None))) or (isinstance(value, ast.Call) and not value.args and ast.unparse(value.func)
                                           in ("dict", "list", "set", "OrderedDict", "collections.OrderedDict",
                                               "defaultdict", "collections.deque", "deque"))
            if empty:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                yield from ((ast.unparse(t), node.lineno) for t in targets)


def test_no_module_keeps_a_cache_of_its_own():
    found = [f"{path.relative_to(PACKAGE)}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for name, line in _growing_containers(path) if (str(path.relative_to(PACKAGE)), name) != OWNER]
    assert not found, f"module-level caches outside hierremat.session: {found}"
