"""``compile=True``: block options that also run compiled, chosen with their compiled costs.

With compile on, every stage with a menu of n options offers the chain DP 2n + 1 options:
0 (the stage under autograd), 1..n (the menu's options as generated eager code,
hierremat.runtime.block_exec) and n+1..2n (the same options compiled by Inductor,
hierremat.runtime.compiled_option). Eager and compiled forms differ in time and, since
Inductor orders and fuses work its own way, in memory, so the DP picks by budget: compile
never raises the smallest feasible budget.

Compiling every option of every menu would take minutes per block on a CPU, and most are
never used. So (:func:`plan_compiled`):

1. each distinct stage signature gets its fastest option compiled and measured, which
   tells how much faster the signature's options run compiled (ChainMenus.compiled_scale);
2. the chain DP plans with every compiled option at its measured costs, and the compiled
   forms not compiled yet at the ILP's memory and that compiled speed;
3. compiled forms the plan uses that are not compiled yet are compiled and measured, and
   the chain is planned again, until the plan uses measured forms only (at most
   ``MAX_ROUNDS`` rounds).

The plan is always safe in memory: a compiled option has its measured peaks, and a
compiled form still unmeasured after the last round runs as generated eager code, whose
memory the ILP modelled. Only its time was a guess. Option 0 is never compiled.

Each signature's forward without grad (F_none / F_ck) is compiled too (:func:`compile_forwards`)
and measured; a stage runs it so where it is the fastest form that peaks no higher than the
stage called without grad (ChainMenus.extend).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..plans import clock
from ..runtime.compiled_option import CompiledForward, CompiledForwardExecutor, CompiledOptionExecutor, CompiledProgram
from ..runtime.profile import ChainProfile, no_side_effects, scratch_grads
from ..plans.schedule import FAll
from .chain_menus import ChainMenus
from .stage_calls import stage_arguments

log = logging.getLogger(__name__)

#: Plan-compile-measure rounds before the plan is kept as it is (see the module docstring).
MAX_ROUNDS = 4


def options_used(schedule) -> set[tuple[int, int]]:
    """(stage, option) of every block option (k >= 1) a ChainSchedule runs."""
    return {(op.stage, op.option) for op in schedule.ops if isinstance(op, FAll) and op.option > 0}


def offer_compiled(menus: ChainMenus) -> None:
    """Give every stage with a menu its compiled forms n+1..2n (running eagerly until compiled)."""
    menus.compile = True
    for i, row in enumerate(menus.executors):
        n = menus.menu_size(i)
        if n and len(row) == n + 1 and menus.compilable(i):
            row += row[1:]


def _past(deadline: float | None, what: str) -> bool:
    """Whether planning's deadline has passed (then nothing more is compiled; logged)."""
    if not clock.passed(deadline):
        return False
    log.info("planning time limit reached: %s not compiled (it runs as generated eager code)", what)
    return True


def compile_options(
    menus: ChainMenus, wanted: set[tuple[int, int]], stages: Sequence, x0: torch.Tensor, shared: tuple,
    cache_dir: Path | None, measure: bool = True, deadline: float | None = None,
) -> int:
    """Compile (and measure) the compiled forms ``wanted`` as (stage, option) that are not compiled
    yet, once per (signature, option), none after ``deadline``; bind every stage's executor of a
    compiled form to it. Returns the number of options tried (compiled, or failing to)."""
    todo: dict[tuple[str, str], tuple[int, int]] = {}
    tried = 0
    for i, k in sorted(wanted):
        if not menus.is_compiled_index(i, k):
            continue
        key = menus.option_key(i, k)
        if not _tried(menus, key) and key not in todo:
            todo[key] = (i, k)
    if todo:
        xs, shareds = stage_arguments(stages, x0, shared, menus.residents)
        for key, (i, k) in todo.items():
            if _past(deadline, f"option {key[1]} of {key[0]}"):
                break
            joint = menus.executors[i][k].joint
            started = time.perf_counter()
            tried += 1
            try:
                with no_side_effects(stages, x0):
                    program = CompiledProgram(joint, menus.option(i, k), xs[i], shareds[i], cache_dir)
                    costs = None
                    if measure:
                        with scratch_grads(stages[i]):
                            costs = CompiledOptionExecutor(joint, program).measure(xs[i], shareds[i])
            except Exception as err:  # noqa: BLE001 - Inductor's errors are many; the eager form always works
                log.warning(
                    "stage signature %s: option %s could not be compiled (%s: %s); it runs as generated eager code",
                    key[0], key[1], type(err).__name__, str(err).splitlines()[0] if str(err) else "",
                )
                menus.compile_failed.add(key)
                menus.compile_seconds += time.perf_counter() - started
                continue
            menus.compiled[key] = (program, costs)
            menus.compile_seconds += program.compile_seconds
            log.info(
                "stage signature %s: option %s compiled in %.1f s%s", key[0], key[1], program.compile_seconds,
                f" ({(costs.fwd_time + costs.bwd_time) * 1e3:.2f} ms)" if costs is not None else "",
            )
        del xs, shareds
    for i, row in enumerate(menus.executors):
        for k in range(len(row)):
            if not menus.is_compiled_index(i, k):
                continue
            entry = menus.compiled.get(menus.option_key(i, k))
            if entry is not None and not isinstance(row[k], CompiledOptionExecutor):
                row[k] = CompiledOptionExecutor(row[k].joint, entry[0], row[k].binding)
    return tried


def compile_forwards(
    menus: ChainMenus, stages: Sequence, x0: torch.Tensor, shared: tuple, cache_dir: Path | None,
    wanted: set[int] | None = None, measure: bool = True, deadline: float | None = None,
) -> None:
    """Compile (and measure) the no-grad forward of every stage signature with a menu (of the
    stages ``wanted``, default all) not compiled yet. One that Inductor fails to compile is
    left out with a warning: those stages run it as generated code or as autograd does."""
    todo = {}
    for i, executor in enumerate(menus.forward_executors):
        signature = menus.signatures[i]
        if executor is not None and (wanted is None or i in wanted) and signature not in menus.compiled_forwards:
            todo.setdefault(signature, i)
    if not todo:
        return
    xs, shareds = stage_arguments(stages, x0, shared, menus.residents)
    for signature, i in todo.items():
        if _past(deadline, f"the forward without grad of {signature}"):
            break
        started = time.perf_counter()
        try:
            with no_side_effects(stages, x0):
                compiled = CompiledForward(
                    menus.forward_executors[i].generated.joint, menus.forwards[signature], xs[i], shareds[i], cache_dir
                )
                forward = CompiledForwardExecutor(compiled, menus.forward_executors[i].binding)
                costs = forward.measure(xs[i], shareds[i]) if measure else None
        except Exception as err:  # noqa: BLE001 - as in compile_options
            log.warning(
                "stage signature %s: the forward without grad could not be compiled (%s: %s)", signature,
                type(err).__name__, str(err).splitlines()[0] if str(err) else "",
            )
            menus.compile_seconds += time.perf_counter() - started
            continue
        menus.compiled_forwards[signature] = (compiled, costs)
        menus.compile_seconds += compiled.compile_seconds
        log.info("stage signature %s: forward without grad compiled in %.1f s", signature, compiled.compile_seconds)
    del xs, shareds


def _tried(menus: ChainMenus, key: tuple[str, str]) -> bool:
    """Whether the option was compiled, or failed to compile."""
    return key in menus.compiled or key in menus.compile_failed


def plan_compiled(
    menus: ChainMenus, profile: ChainProfile, solve: Callable[[ChainProfile], object], stages: Sequence,
    x0: torch.Tensor, shared: tuple, cache_dir: Path | None, deadline: float | None = None,
):
    """The plan (``solve(profile)``'s result, with ``.schedule``) with compiled block options on
    offer; nothing is compiled after ``deadline`` (a ``hierremat.plans.clock.now()`` value)."""
    started = time.perf_counter()
    offer_compiled(menus)
    fastest = set()
    for i in range(len(menus.executors)):
        n = menus.menu_size(i)
        if n and menus.compilable(i):
            fastest.add((i, n + 1 + min(range(n), key=lambda j: menus.option(i, j + 1).total_time)))
    compile_options(menus, fastest, stages, x0, shared, cache_dir, deadline=deadline)
    compile_forwards(menus, stages, x0, shared, cache_dir, deadline=deadline)
    plan = solve(menus.extend(profile))
    for _ in range(MAX_ROUNDS):
        if not compile_options(menus, options_used(plan.schedule), stages, x0, shared, cache_dir, deadline=deadline):
            break
        plan = solve(menus.extend(profile))
    unmeasured = [
        (i, k) for i, k in options_used(plan.schedule) if menus.is_compiled_index(i, k) and not _tried(menus, menus.option_key(i, k))
    ]
    if unmeasured:
        log.info("after %d rounds, options %s run as generated eager code", MAX_ROUNDS, sorted(unmeasured))
    log.info("compiled block options: %.1f s in all, %.1f s compiling", time.perf_counter() - started, menus.compile_seconds)
    return plan
