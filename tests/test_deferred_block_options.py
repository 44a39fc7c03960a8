"""Block options built once they pay (hierremat.remat's ``defer_block_options``: "re-solve a menu only
where that pays, in the background or lazily").

Building a block's menu traces, profiles and runs the block again and solves its ILP: on a fresh cache that cost
more than the capture and profile of the first shape (4-layer GPT-2: 5.6 s against 4.2 s). remat plans the first
shape without them where they could save less per step than building them is taken to cost (what capturing and
profiling the shape took), and builds them once the grad steps of every shape have lost that much (rent or buy);
at once where the budget needs them, or where the cache built them for this shape before. Gradients equal plain
autograd's before and after, and the measured peak stays within the budget.
"""

import contextlib
import copy
import logging

import pytest
import torch

import hierremat as hr
from hierremat.api import shape_planning
from hierremat.device.memory import CpuAllocatorMeter, profiler_active
from hierremat.errors import InfeasibleBudgetError
from hierremat.planning import menus

from harness import model_loss, train_step
from models import tiny_gpt2

VOCAB = 512


def _batch(length: int, batch: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _model_and_budget():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3, n_embd=64, vocab_size=VOCAB)
    plain = hr.plan(model, (), _batch(64), budget="64GiB",
                    settings=hr.Settings(strategy="none", cache=False)).predicted_peak_bytes
    return model, int(0.45 * plain)  # (a plan that recomputes: block options could save some of it)


def _step(module, reference, model, batch: dict, seed: int) -> None:
    """One step of each (``.grad`` None at its start, PyTorch's default), gradients compared bitwise."""
    for m in (module, reference):
        train_step(m, (), model_loss, seed=seed, grads_allocated=False, kwargs=batch, meters="none")
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


def _peaks(module, batch: dict) -> tuple[int, int]:
    """The peak of a step of ``module`` (planned before), by the live-tensor tracker and the CPU allocator meter."""
    return tuple(getattr(train_step(module, (), model_loss, grads_allocated=False, kwargs=batch, meters=meter),
                         f"{meter}_peak") for meter in ("tracker", "allocator"))


def test_block_options_are_built_once_the_steps_without_them_have_lost_what_building_them_costs(
        monkeypatch, caplog, fresh_session):  # (no menu an earlier test solved to re-cost, cache=False)
    """The first shape is planned without block options (no stage traced) and says so; a second length is
    fitted (its memory and times from shorter lengths measured for it, timed from one run each: no block menu built to
    fit, and no length profiled for times alone, the training steps time them); once the steps have lost
    what building them was taken to cost, the shape then called is planned with them, solved by the ILP. Bitwise
    gradients at every step and the peak within the budget, before and after."""
    traced = []
    trace_joint = menus.trace_joint
    monkeypatch.setattr(menus, "trace_joint", lambda *a, **k: traced.append(1) or trace_joint(*a, **k))
    monkeypatch.setattr(shape_planning, "NOISE_MARGIN", 0.0)  # (the decision under test, not this machine's noise)
    caplog.set_level(logging.INFO, logger="hierremat")
    model, budget = _model_and_budget()
    reference = copy.deepcopy(model)
    module = hr.remat(model, (), _batch(64), budget=budget, settings=hr.Settings(cache=False))
    first = module.plans[-1]
    assert not traced and not first.menus and first.options_solves == 0
    assert first.times.startswith("measured (times of one run each, until its training steps time it); block options "
                                  "not built yet (they could save at most")
    assert "block options not built yet" in first.summary()
    deferred = next(iter(module._planned.values()))
    assert deferred.build_estimate > 0 and module._building.recost_seconds == deferred.build_estimate
    assert deferred.block_gain > 0
    assert all(peak <= budget for peak in _peaks(module, _batch(64)))
    module._building.recost_seconds = 1e6  # (a build as dear as a million steps' gain: none while the second length comes)
    for step, length in enumerate((64, 56)):
        _step(module, reference, model, _batch(length), step)
    samples = next(iter(module._families.samples.values()))
    assert all(s.times_measured and s.profile.repeats == 1 for s in samples)  # (64 and the shorter: one run each)
    assert "times from 4 shapes timed" in module.plans[-1].times  # (the shorter lengths' times in the fit)
    assert all(t is None for s in samples for t in s.node_times)
    assert not traced and not module._building.built and "block options not re-costed" in module.plans[-1].times
    assert all(peak <= budget for peak in _peaks(module, _batch(56)))
    # then as dear as 2.5 steps' gain at 64 (as solved again from its three steps timed: its gain with it): the steps
    # from now on lose that by the third run outside a profiler
    module._retimer.retime(deferred)
    assert "times from its first 3 training steps" in deferred.plan.times
    module._building.recost_seconds, module._building.lost_without = 2.5 * deferred.block_gain, 0.0
    # the third step under the caller's torch.profiler: building them measures the CPU allocator with a session of
    # its own, which would end the caller's (its events lost): put off until the session ends, the caller's kept
    for step in range(4):
        with torch.profiler.profile() if step == 2 else contextlib.nullcontext() as profile:
            _step(module, reference, model, _batch(64), 10 + step)
        if step == 2:
            assert profile.key_averages() and "a torch.profiler session runs: block options are not" in caplog.text
        assert bool(traced) == (step == 3) and module._building.built == (step == 3), step
    assert "block options built at this shape after steps without them lost" in caplog.text
    built = [p for p in module.plans if p.menus]
    assert len(built) == 1 and built[0].options_solves > 0 and "block options not built" not in built[0].times
    # built and solved: what re-costing them at a fitted shape takes is learnt again (as after a first shape planned
    # with them), so 56, planned without them before, re-costs them at its next call and sets it
    assert module._building.recost_seconds is None
    _step(module, reference, model, _batch(56), 20)
    assert any(m.get("recosted") for m in module.plans[-1].menus.values())
    assert module._building.recost_seconds == module.plans[-1].options_seconds > 0
    for length in (64, 56):
        assert all(peak <= budget for peak in _peaks(module, _batch(length))), length


@pytest.mark.parametrize("scheduled", [False, True], ids=["recording", "scheduled"])
def test_block_options_to_be_built_at_once_are_put_off_while_the_caller_profiles(monkeypatch, scheduled, fresh_session):
    """remat(..., defer_block_options=False) called and trained inside the caller's torch.profiler session: the
    shape is planned without block options (building them measures the CPU allocator with a session of its own,
    which would end the caller's), the caller's events kept, and they are built at the first step after it; bitwise
    gradients and the budget throughout. hr.plan there raises (docs/errors.md). ``scheduled``: a profiler with a
    schedule, remat called in its warm-up step (Kineto prepared, not recording: a session of ours started there ended
    the caller's, and the process crashed when it stopped) and the step trained in its recording one."""
    traced = []
    trace_joint = menus.trace_joint
    monkeypatch.setattr(menus, "trace_joint", lambda *a, **k: traced.append(1) or trace_joint(*a, **k))
    model, budget = _model_and_budget()
    reference = copy.deepcopy(model)
    traces = []
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1) if scheduled else None
    with torch.profiler.profile(schedule=schedule, on_trace_ready=traces.append) as profile:
        module = hr.remat(model, (), _batch(64), budget=budget,
                          settings=hr.Settings(cache=False, defer_block_options=False))
        profile.step()  # (scheduled: from warm-up to recording)
        _step(module, reference, model, _batch(64), 0)
        profile.step()
    assert not traced and not module.plans[-1].menus and not profiler_active()
    assert any(e.name.startswith("aten::") for e in (traces[0] if scheduled else profile).events())
    assert "block options not built yet" in module.plans[-1].times
    _step(module, reference, model, _batch(64), 1)
    assert traced and module.plans[-1].menus and module.plans[-1].options_solves > 0
    assert all(peak <= budget for peak in _peaks(module, _batch(64)))


def test_a_session_of_ours_is_refused_in_a_scheduled_profilers_warm_up_step_alone():
    """A torch.profiler.profile counts as open (profiler_active: block options wait) from its construction to its
    exit; the CPU allocator meter, a session of its own, is refused while the caller's records and in its warm-up
    steps (Kineto prepared: a session of ours there crashed the process when the caller's stopped), and runs in its
    wait steps (the caller's trace comes out whole, the caller's profile still counted open after it) and after a
    profile stopped by hand."""
    traces: list = []
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(schedule=schedule, on_trace_ready=traces.append) as profile:
        for phase in ("wait", "warm-up", "recording"):
            assert profiler_active(), phase
            if phase == "wait":
                with CpuAllocatorMeter() as meter:
                    torch.ones(1024)
                assert meter.peak_bytes >= 4096
            else:
                with pytest.raises(RuntimeError, match="warm-up"):
                    CpuAllocatorMeter().__enter__()
            torch.ones(8) @ torch.ones(8)
            profile.step()
    assert not profiler_active() and traces and any(e.name.startswith("aten::") for e in traces[0].events())
    by_hand = torch.profiler.profile()
    by_hand.start()
    by_hand.stop()
    assert profiler_active()  # (until its __exit__: torch keeps its step count)
    with CpuAllocatorMeter() as meter:
        torch.ones(1024)
    assert meter.peak_bytes >= 4096
    by_hand.__exit__(None, None, None)
    assert not profiler_active()


@pytest.mark.slow
def test_block_options_are_built_at_once_where_the_cache_has_them_or_the_budget_needs_them(tmp_path):
    """A cache that built this shape's menus before: remat uses them at construction (a lookup, no ILP solve),
    and the shorter lengths it measures at the second shape, whose menus that cache lacks, are measured without
    them; gradients bitwise, peaks within the budget. A budget only block options fit: built at once, and at the
    shorter lengths too. ``defer_block_options=False``: built at once, as
    hierremat.plan does."""
    model, budget = _model_and_budget()
    eager = hr.remat(model, (), _batch(64), budget=budget,
                     settings=hr.Settings(cache=str(tmp_path), defer_block_options=False))
    assert eager.plans[-1].menus and eager.plans[-1].options_solves > 0
    warm_model = copy.deepcopy(model)
    warm = hr.remat(warm_model, (), _batch(64), budget=budget, settings=hr.Settings(cache=str(tmp_path)))
    assert warm.plans[-1].menus and warm.plans[-1].options_solves == 0
    assert warm.plans[-1].times == "measured"
    # a second length near the first (fitted from 42 and 16, measured now): the cache has no menus at those, so
    # their samples measure no node times (a run whose cache an earlier one filled traces no block for fits alone)
    _step(warm, copy.deepcopy(model), warm_model, _batch(56), 3)
    samples = next(iter(warm._families.samples.values()))
    shorter = [s for s in samples if s.times_measured and dict(s.bindings) and max(dict(s.bindings).values()) < 56]
    assert len(shorter) == 2 and all(t is None for s in shorter for t in s.node_times)
    assert [t is not None for t in next(s for s in samples if 64 in dict(s.bindings).values()).node_times].count(True)
    tracker, allocator = _peaks(warm, _batch(56))
    assert max(tracker, allocator) <= budget

    explored = {kind: hr.explore(model, (), _batch(64), settings=hr.Settings(block_options=kind, cache=False))
                for kind in ("ilp", "autograd")}
    low, high = explored["ilp"].smallest_feasible(), explored["autograd"].smallest_feasible()
    assert low < high  # (block options lower this model's floor)
    tight = (low + high) // 2
    with pytest.raises(InfeasibleBudgetError):
        hr.remat(copy.deepcopy(model), (), _batch(64), budget=tight,
                 settings=hr.Settings(cache=False, block_options="autograd"))
    tight_model = copy.deepcopy(model)
    module = hr.remat(tight_model, (), _batch(64), budget=tight, settings=hr.Settings(cache=False))
    assert module.plans[-1].menus and module.plans[-1].predicted_peak_bytes <= tight
    # built because the budget needs them: the shorter lengths measured at the second shape build them too (the
    # shapes fitted later re-cost them from node times fitted over those), the cache or not
    _step(module, copy.deepcopy(model), tight_model, _batch(56), 4)
    shorter = [s for s in next(iter(module._families.samples.values()))
               if s.times_measured and max(dict(s.bindings).values()) < 56]
    assert len(shorter) == 2 and all(any(t is not None for t in s.node_times) for s in shorter)
    assert max(_peaks(module, _batch(56))) <= tight
    # the same with a first batch whose mask pads a row (lengths said to vary): a shorter length measured at the first
    # shape to fit from with the steps' times (timed from one run, no menu) counts for memory alone once the
    # second shape profiles the family for times (block options built by then), which then measures two in full
    said_model, padded = copy.deepcopy(model), _batch(64)
    padded["attention_mask"][1, -3:] = 0
    module = hr.remat(said_model, (), padded, budget=tight, settings=hr.Settings(cache=False))
    assert [(max(dict(s.bindings).values()), s.times_measured, s.cut)
            for s in next(iter(module._families.samples.values()))] == [(64, True, False), (16, True, True)]
    _step(module, copy.deepcopy(model), said_model, _batch(56), 5)
    shorter = [s for s in next(iter(module._families.samples.values()))
               if s.times_measured and max(dict(s.bindings).values()) < 56]
    assert len(shorter) == 2 and all(any(t is not None for t in s.node_times) for s in shorter)
    assert max(_peaks(module, _batch(56))) <= tight


def test_defer_block_options_must_be_a_bool():
    model, budget = _model_and_budget()
    with pytest.raises(ValueError, match="defer_block_options must be True"):
        hr.remat(model, (), _batch(64), budget=budget, settings=hr.Settings(cache=False, defer_block_options="yes"))
