"""Stage times observed in the training steps (time samples from the steps themselves).

A chain runner with a StepTimes records, in the steps it runs on CPU op by op, the seconds of each stage's own
no-grad forward, its forward with grad under autograd and its backward, only for steps that ran through their
backward; a schedule that keeps everything still simply calls the stages (autograd's own backward: retain_graph,
create_graph and torch.autograd.grad work as without hierremat) and records their forwards. Gradients bitwise
equal to plain autograd's either way. The medians give the shape's stage times, what was not timed taken from
the plan's.
"""

from dataclasses import replace

import pytest
import torch

from hierremat.plans.schedule import Backward, ChainSchedule, FAll, FCk, FNone, Loss
from hierremat.runtime.executor import ChainRunner
from hierremat.runtime.step_times import StepTimes


def _chain(n: int = 4, width: int = 32):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(n)])


def _schedule(ops) -> ChainSchedule:
    return ChainSchedule(tuple(ops), 4, predicted_time=0.0, predicted_peak_bytes=0, budget_bytes=0, memory_unit_bytes=1)


KEEP_ALL = (FAll(0), FAll(1), FAll(2), FAll(3), Loss(), Backward(3), Backward(2), Backward(1), Backward(0))
# stage 0 and 1 run without grad in the forward sweep, then again with it for their backward (recomputed)
RECOMPUTING = (FCk(0), FNone(1), FAll(2), FAll(3), Loss(), Backward(3), Backward(2), FCk(0), FAll(1), Backward(1),
               FAll(0), Backward(0))


def _grads(chain, run, x):
    for p in chain.parameters():
        p.grad = None
    xr = x.detach().requires_grad_()
    run(xr).sum().backward()
    return [p.grad.clone() for p in chain.parameters()] + [xr.grad.clone()]


@pytest.mark.parametrize("ops", [KEEP_ALL, RECOMPUTING], ids=["keeps-everything", "recomputing"])
def test_a_timed_step_records_each_stages_ops_and_trains_bitwise(ops):
    chain, x = _chain(), torch.randn(64, 32)
    expected = _grads(chain, chain, x)
    runner = ChainRunner(list(chain), _schedule(ops), [()] * 4)
    runner.step_times = times = StepTimes(4, steps=2)
    assert runner.times_step(x)
    for step in range(3):  # (the third is not recorded: two were asked for)
        assert all(torch.equal(a, b) for a, b in zip(_grads(chain, runner.run, x), expected)), step
        assert times.steps == min(step + 1, 2)
    assert not times.recording and not runner.times_step(x)
    seconds = times._seconds
    kinds = {"forward"} if ops is KEEP_ALL else {"nograd", "forward", "backward"}
    assert {k for k, _ in seconds} == kinds
    for i in range(4):  # each stage's forward with grad (and backward, op by op) once a step; its no-grad forwards
        assert len(seconds["forward", i]) == 2 and len(seconds.get(("backward", i), ())) == (2 if ops is RECOMPUTING
                                                                                              else 0)
        assert len(seconds.get(("nograd", i), ())) == 2 * sum(isinstance(op, (FCk, FNone)) and op.stage == i
                                                               for op in ops)
        assert all(s > 0 for values in seconds.values() for s in values)
    stage_times = times.stage_times([(1.0, 2.0, 4.0)] * 4)
    assert len(stage_times) == 4 and all(min(t) > 0 for t in stage_times)
    if ops is KEEP_ALL:  # (no stage ran without grad, no backward timed: the plan's shares of the forward timed)
        assert all(t[0] == pytest.approx(0.5 * t[1]) and t[2] == pytest.approx(2 * t[1]) for t in stage_times)


def test_a_kept_everything_chain_keeps_autograds_own_backward_while_timed():
    """torch.autograd.grad and a second backward (retain_graph), as without timing, in a step that is timed."""
    chain, x = _chain(), torch.randn(8, 32)
    runner = ChainRunner(list(chain), _schedule(KEEP_ALL), [()] * 4)
    runner.step_times = StepTimes(4, steps=3)
    out = runner.run(x).square().sum()
    grads = torch.autograd.grad(out, list(chain.parameters()), retain_graph=True)
    expected = torch.autograd.grad(chain(x).square().sum(), list(chain.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected)) and all(p.grad is None for p in chain.parameters())
    out.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), expected)) and runner.step_times.steps == 1


def test_a_step_without_its_backward_is_not_recorded_nor_is_one_without_grad():
    """Op by op (a schedule that recomputes), a step is recorded once its backward has run."""
    chain, x = _chain(), torch.randn(8, 32)
    runner = ChainRunner(list(chain), _schedule(RECOMPUTING), [()] * 4)
    runner.step_times = times = StepTimes(4, steps=3)
    runner.run(x.requires_grad_())  # (its output dropped: no backward)
    with torch.no_grad():
        runner.run(x)
    assert times.steps == 0 and times.stage_times([(1.0, 1.0, 1.0)] * 4) is None
    runner.run(x).sum().backward()
    assert times.steps == 1


def test_step_times_medians_and_what_they_cannot_say():
    times = StepTimes(2, steps=3)
    times.record({("forward", 0): [1.0], ("backward", 0): [2.0], ("forward", 1): [3.0], ("backward", 1): [4.0],
                  ("nograd", 1): [0.5, 0.7]})
    times.record({("forward", 0): [3.0], ("backward", 0): [2.0], ("forward", 1): [5.0], ("backward", 1): [6.0]})
    planned = [(1.0, 4.0, 8.0), (9.0, 9.0, 9.0)]  # (the plan's: stage 0's no-grad forward a quarter of its forward)
    assert times.stage_times(planned) == ((0.5, 2.0, 2.0), (0.6, 4.0, 5.0))
    partial = StepTimes(2, steps=1)
    partial.record({("forward", 0): [1.0], ("backward", 0): [2.0], ("nograd", 1): [1.0]})  # (stage 1: a block option)
    assert partial.stage_times(planned) == ((0.25, 1.0, 2.0), (9.0, 9.0, 9.0))  # (stage 1 as planned)
    partial.record({("forward", 1): [1.0], ("backward", 1): [2.0]})  # (beyond the steps asked for: not kept)
    assert partial.steps == 1 and partial.stage_times(planned)[1] == (9.0, 9.0, 9.0)
    assert StepTimes(2, steps=1).stage_times(planned) is None  # (nothing recorded)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        StepTimes(2, steps=0)


def test_step_times_scale_the_block_options_with_option_0_so_the_dp_prices_them_as_the_profile_did():
    """A host that runs the steps k times slower than the profile ran: option 0's times observed k times the
    profile's, every other time of the stage scaled with them (ChainCosts.with_step_times). The DP then picks
    a schedule as fast as the one it picked from the profile, at k times its time; replacing option 0's times
    alone (with_autograd_times) made block options look cheaper, and on some chains picked a schedule slower than
    that."""
    import numpy as np

    from chains import random_chain
    from hierremat.dp import solve_chain
    from hierremat.errors import InfeasibleBudgetError
    from hierremat.plans.costs import ChainCosts, OptionCosts, StageCosts
    from hierremat.plans.simulate import simulate

    rng = np.random.default_rng(5)
    k = 1.7
    compared = slower = 0
    for _ in range(150):
        costs = random_chain(rng, int(rng.integers(2, 6)), 3)
        observed = [(k * st.nograd_fwd_time, k * st.options[0].fwd_time, k * st.options[0].bwd_time)
                    for st in costs.stages]
        try:
            floor = solve_chain(costs, 10**6).schedule.predicted_peak_bytes
            budget = int(floor * rng.uniform(0.3, 1.0))
            base = solve_chain(costs, budget, slots=400)
        except InfeasibleBudgetError:
            continue
        consistent = costs.with_step_times(observed)
        scaled = solve_chain(consistent, budget, slots=400)
        assert scaled.schedule.predicted_time == pytest.approx(k * base.schedule.predicted_time, rel=1e-9)
        assert simulate(costs, scaled.schedule).time == pytest.approx(base.schedule.predicted_time, rel=1e-9)
        alone = solve_chain(costs.with_autograd_times(observed), budget, slots=400)
        slower += simulate(consistent, alone.schedule).time > scaled.schedule.predicted_time * (1 + 1e-9)
        compared += 1
    assert compared > 50 and slower > 0, (compared, slower)
    # the other no-grad forms scale with the no-grad forward, byte counts stay
    option = OptionCosts(fwd_time=1.0, bwd_time=2.0, kept_bytes=8, fwd_overhead_bytes=12, bwd_overhead_bytes=4)
    stage = StageCosts(0.5, 9, (option, replace(option, fwd_time=3.0, bwd_time=5.0, kept_bytes=2)),
                       nograd_form="generated", autograd_nograd=(1.0, 7), leaner_nograd=("compiled", 2.0, 5))
    (got,) = ChainCosts((4, 4), (stage,)).with_step_times([(1.0, 3.0, 3.0)]).stages
    assert (got.nograd_fwd_time, got.options[0].fwd_time, got.options[0].bwd_time) == (1.0, 3.0, 3.0)
    assert (got.options[1].fwd_time, got.options[1].bwd_time, got.options[1].kept_bytes) == (9.0, 7.5, 2)
    assert got.autograd_nograd == (2.0, 7) and got.leaner_nograd == ("compiled", 4.0, 5)
