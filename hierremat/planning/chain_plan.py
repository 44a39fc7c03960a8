"""Plans of a chain: the fastest schedule that fits a budget, from the chain's measured costs,
and a chain bound to its plan that re-plans when the caller uses its output otherwise than
assumed (:class:`PlannedChain`). Used by ``checkpoint_sequential`` and ``remat``
(hierremat.api)."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
import torch.fx

from ..device.autocast import AutocastState
from ..device.rng import CPU_RNG_STATE_BYTES
from ..dp import load_kernel, min_peak_schedule, solve_chain
from ..dp.baselines import keep_all_schedule, uniform_segments_schedule
from ..errors import InfeasibleBudgetError
from ..plans.costs import ChainCosts
from ..plans.schedule import ChainSchedule
from ..plans.sequential_plan import SequentialPlan
from ..plans.transfers import transfer_plan
from ..runtime.executor import ChainRunner, OutputUse, stage_buffers
from ..runtime.offload import Offloading
from ..runtime.profile import ChainProfile, profile_chain
from ..runtime.step_grads import StepGrads
from ..runtime.step_times import StepTimes

log = logging.getLogger(__name__)


def _replay_reserve(stages: Sequence[Callable], profile: ChainProfile, device: torch.device) -> tuple[list[int], int]:
    """Bytes the runtime holds for each stage if it is recomputed (RNG state, buffer snapshots),
    and once if any stage is: the caller's RNG state, kept through the backward and restored
    after the replays (runtime.executor). RNG states are CPU tensors: they count on CPU only."""
    rng = CPU_RNG_STATE_BYTES if device.type == "cpu" else 0
    per_stage = [
        rng + 2 * sum(b.untyped_storage().nbytes() for b in stage_buffers(stage, names))
        for stage, names in zip(stages, profile.mutated_buffers)
    ]
    return per_stage, rng


#: Default bound on planning, seconds (capture, profiling, block ILPs, compiling).
PLAN_TIME_LIMIT = 300.0

STRATEGIES = "'optimal' (the DP), 'none' (no checkpointing) or 'segments=K' (torch's uniform segments)"

#: 'ilp': each distinct block also offers the optimal options of its ILP menu beside autograd's;
#: 'autograd': only what autograd keeps (and the chain DP's keep-input choice): Rotor on blocks.
BLOCK_OPTIONS = ("ilp", "autograd")


def check_block_options(block_options: str) -> None:
    if block_options not in BLOCK_OPTIONS:
        raise ValueError(f"block_options={block_options!r} is not one of {BLOCK_OPTIONS}")


#: Floating dtypes Inductor computes in differently from eager: eager rounds each op's result to the dtype, a fused
#: Inductor kernel keeps fp32 between the ops it fuses.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def resolve_compile(compile, device: torch.device, stages: Sequence = (), x0: torch.Tensor | None = None) -> bool:
    """The ``compile=`` argument: True, False, or "auto": True on CUDA where the stages compute in fp32, else False.

    Not where they compute in bf16 or fp16 (:func:`computes_in_low_precision`; ``x0``: the chain's input): there a
    compiled option's gradients were 1e-4 from eager's (tiny GPT-2 and Llama under bf16 autocast on an H200,
    ``benchmarks/bits_by_op.py``, where every eager op gave plain autograd's bits); in fp32 they were within
    1e-8."""
    if compile == "auto":
        return device.type == "cuda" and not computes_in_low_precision(stages, device, x0)
    if isinstance(compile, bool):
        return compile
    raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")


def computes_in_low_precision(stages: Sequence, device: torch.device, x0: torch.Tensor | None = None) -> bool:
    """Whether the chain computes in bf16 or fp16: autocast to one on for ``device``, its input ``x0`` in one, a
    floating parameter of a stage held in one, or a value of a stage's captured graph in one (``graph_module``'s
    node values: a cast inside the model's forward). A plain callable's own casts are not seen."""
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) in LOW_PRECISION:
        return True
    if x0 is not None and x0.dtype in LOW_PRECISION:
        return True
    for stage in stages:
        if isinstance(stage, torch.nn.Module) and any(p.dtype in LOW_PRECISION for p in stage.parameters()):
            return True
        graph = getattr(stage, "graph_module", None)
        if isinstance(graph, torch.fx.GraphModule) and any(
                isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION
                for value in (node.meta.get("val") for node in graph.graph.nodes)):
            return True
    return False


def fixed_schedule(costs, strategy: str):
    """The schedule of a baseline strategy ('none' or 'segments=K')."""
    if strategy == "none":
        return keep_all_schedule(costs)
    if strategy.startswith("segments="):
        try:
            segments = int(strategy.split("=", 1)[1])
        except ValueError:
            raise ValueError(f"strategy={strategy!r}: K in 'segments=K' must be an integer") from None
        return uniform_segments_schedule(costs, segments)
    raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")


def _fastest_fitting(
    costs: ChainCosts, budget_bytes: int, reserve_bytes: int, reserved: Callable, slots: int,
) -> tuple[ChainCosts, ChainSchedule]:
    """The fastest schedule whose peak plus its replay reserve fits, and the costs it was planned
    with: ``costs``, or ``costs`` with the stages' leaner no-grad forwards (ChainCosts.
    with_leaner_forwards) where that plan is faster or the only one that fits. The smallest
    budget reported is the leaner costs' least peak plus ``reserve_bytes`` (what the runtime
    holds for replays if every stage is recomputed), which measured times do not move."""
    keep_all = keep_all_schedule(costs)
    fastest = all(st.options[0].fwd_time + st.options[0].bwd_time <= min(o.fwd_time + o.bwd_time for o in st.options)
                  for st in costs.stages)
    if fastest and keep_all.predicted_peak_bytes <= budget_bytes:
        load_kernel()  # (not needed here: loaded now, the first plan that needs it does not pay for it)
        return costs, keep_all  # no recomputation at all; it runs as plain autograd
    lean = costs.with_leaner_forwards()
    found = []
    for planned in dict.fromkeys((costs, lean)):
        for dp_budget in dict.fromkeys((budget_bytes, budget_bytes - reserve_bytes)):
            if dp_budget <= 0:
                continue
            try:
                candidate = solve_chain(planned, dp_budget, slots=slots).schedule
            except InfeasibleBudgetError:
                continue
            if candidate.predicted_peak_bytes + reserved(candidate) <= budget_bytes:
                found.append((candidate.predicted_time, planned, candidate))
                break
    if found:
        _, planned, schedule = min(found, key=lambda f: f[0])
        return planned, _as_run(planned, schedule)
    schedule = _as_run(lean, min_peak_schedule(lean))
    if schedule.predicted_peak_bytes + reserved(schedule) > budget_bytes:
        # The budget reported works whatever schedule of least peak a later plan picks: which
        # one (hence which stages hold a replay reserve) depends on measured times, and a plan
        # at peak + every stage's reserve finds one through the DP at ``budget - reserve_bytes``.
        raise InfeasibleBudgetError(budget_bytes, schedule.predicted_peak_bytes + reserve_bytes)
    return lean, schedule


def _as_run(costs: ChainCosts, schedule: ChainSchedule) -> ChainSchedule:
    """``schedule`` priced as the runtime runs it. The DP prices every schedule with the chain's output
    gradient held to the end of the backward (the chain Function holds it); a schedule that keeps
    everything runs as plain autograd instead, which frees that gradient after its last use
    (keep_all_schedule), so its peak can be lower than the DP's figure."""
    return keep_all_schedule(costs) if schedule.keeps_everything else schedule


def plan_from_profile(
    stages: Sequence[Callable],
    profile: ChainProfile,
    budget_bytes: int,
    device: torch.device,
    *,
    slots: int,
    profile_seconds: float = 0.0,
    strategy: str = "optimal",
    output_held: bool | int | None = None,
    step_grads: tuple[int, ...] | None = None,
    offloading: Offloading | None = None,
) -> SequentialPlan:
    """Solve the chain so that the schedule's peak plus the runtime's replay reserve fits.

    The reserve (RNG states and buffer snapshots) is only held for recomputed stages,
    which the plan decides: try the whole budget first and keep that plan if its own
    reserve still fits; else plan with the reserve of every stage set aside; else the
    schedule of least peak. Baseline strategies (see STRATEGIES) use a fixed schedule.

    output_held: whether the caller keeps the chain output alive through the backward
    (True), releases it once the loss is computed (False), or holds that many bytes of it
    (an int, as observed by the runtime). None (default) plans as if it is held, unless
    only a plan that assumes it released fits the budget; the runtime checks the
    assumption on every backward (PlannedChain).

    step_grads: per stage, bytes of the parameter gradients the step allocates in its backward
    (ChainCosts.step_grad_bytes; () for none); None (default): those the stages' parameters
    would get now (hierremat.runtime.step_grads: ``.grad`` None). The runtime checks it on every
    call (PlannedChain).

    offloading: the second tier the chain may offload checkpoints to (hierremat.runtime.offload), or
    None. Where the fastest plan would hold more there at once than its ``offload_limit``, the chain is
    planned without offloading instead (logged).
    """
    kwargs = dict(slots=slots, profile_seconds=profile_seconds, strategy=strategy, output_held=output_held,
                  step_grads=step_grads)
    tier = None if offloading is None else offloading.bandwidth
    plan = _plan_from_profile(stages, profile, budget_bytes, device, tier=tier, **kwargs)
    if offloading is not None:
        held = offloading.needed_bytes(transfer_plan(plan.costs, plan.schedule))
        if held > offloading.limit_bytes:
            log.warning("the plan would hold %d B in the %s tier at once, over offload_limit=%d B: planned without "
                        "offloading (raise offload_limit to offload)", held, offloading.kind, offloading.limit_bytes)
            plan = _plan_from_profile(stages, profile, budget_bytes, device, tier=None, **kwargs)
    return plan


def _plan_from_profile(
    stages: Sequence[Callable], profile: ChainProfile, budget_bytes: int, device: torch.device, *, slots: int,
    profile_seconds: float, strategy: str, output_held: bool | int | None, step_grads: tuple[int, ...] | None, tier,
) -> SequentialPlan:
    """plan_from_profile with the second tier's bandwidths ``tier`` (plans.costs.TierBandwidth, or None)."""
    reserve, caller_rng = _replay_reserve(stages, profile, device)
    if step_grads is None:
        step_grads = StepGrads(stages).bytes()

    def reserved(schedule) -> int:
        counts = schedule.forward_counts()
        replays = any(c > 1 for c in counts)
        return sum(r for r, c in zip(reserve, counts) if c > 1) + (caller_rng if replays else 0)

    def solve(costs):
        if strategy == "optimal":
            return _fastest_fitting(costs, budget_bytes, sum(reserve) + caller_rng, reserved, slots)
        schedule = fixed_schedule(costs, strategy)
        needed = schedule.predicted_peak_bytes + reserved(schedule)
        if needed > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, needed, what=f"budget for strategy={strategy!r}")
        return costs, schedule

    started = time.perf_counter()
    costs = replace(
        profile.costs, output_held_bytes=held_bytes(output_held, profile.costs), step_grad_bytes=tuple(step_grads),
        tier=tier,
    )
    try:
        costs, schedule = solve(costs)
    except InfeasibleBudgetError as held:
        if output_held is not None:
            raise _with_grads_kept(held, costs, sum(reserve) + caller_rng, strategy) from None
        costs = replace(costs, output_held_bytes=least_held_bytes(profile))
        try:
            costs, schedule = solve(costs)
        except InfeasibleBudgetError as released:
            raise _with_grads_kept(InfeasibleBudgetError(
                budget_bytes, released.min_budget_bytes, released.what, min_budget_bytes_output_held=held.min_budget_bytes,
            ), costs, sum(reserve) + caller_rng, strategy) from None
        log.info(
            "budget %d B fits only if the caller releases the chain output before backward (e.g. `loss = "
            "model(x).loss`); planned so. Each backward checks it and warns if the output was held.", budget_bytes,
        )
    schedule = replace(schedule, budget_bytes=budget_bytes)
    return SequentialPlan(
        costs, schedule, profile.mutated_buffers, reserved(schedule), profile_seconds, time.perf_counter() - started,
        profile.output_grad_mask, AutocastState.capture((device.type,)).describe(),
    )


def _with_grads_kept(err: InfeasibleBudgetError, costs: ChainCosts, reserve_bytes: int, strategy: str
                     ) -> InfeasibleBudgetError:
    """``err``, saying too the smallest budget with ``.grad`` kept allocated where the step allocates
    parameter gradients (as _fastest_fitting reports a minimum: least peak of the leaner forwards
    plus every stage's replay reserve)."""
    if not costs.step_grad_bytes or strategy != "optimal":
        return err
    kept = min_peak_schedule(replace(costs, step_grad_bytes=()).with_leaner_forwards()).predicted_peak_bytes
    return InfeasibleBudgetError(
        err.budget_bytes, err.min_budget_bytes, err.what, err.min_budget_bytes_output_held, kept + reserve_bytes,
    )


def held_bytes(output_held: bool | int | None, costs) -> int | None:
    """ChainCosts.output_held_bytes for an ``output_held`` argument (None and True: all of it)."""
    if output_held is None or output_held is True:
        return None
    if output_held is False:
        return 0
    return min(int(output_held), costs.activation_bytes[-1])


def least_held_bytes(profile: ChainProfile) -> int:
    """What a caller that releases the output still holds: the scalar losses it calls backward on
    (``loss = model(x).loss; loss.backward()`` keeps the loss), and of several outputs those that
    get a gradient; nothing else."""
    mask = profile.output_grad_mask
    partial = profile.costs.output_grad if len(mask) > 1 and not all(mask) else 0
    return min(max(partial, profile.loss_bytes), profile.costs.activation_bytes[-1])


class PlannedChain:
    """A chain of stages bound to its plan, which it adapts to how the caller uses the output.

    Every backward of the chain records how the caller used its output (held or released,
    which outputs got a gradient: hierremat.runtime.executor.OutputUse). When that differs
    from what the plan assumed, the next call re-plans: with the output held when the caller
    held it (warning: that step may have exceeded the budget by the output's bytes), released
    when it was released (a faster plan), and with the stages re-profiled when other outputs
    received gradients than expected.

    Every call also looks at which parameter gradients the step will allocate (``.grad`` None:
    hierremat.runtime.step_grads) and runs the plan made for that case, planned on first need
    (the chain DP alone) and kept: PyTorch's default ``zero_grad(set_to_none=True)``, gradients
    kept allocated, and the micro-batches of a gradient accumulation (the first allocates, the
    others add) each run their own plan.
    """

    def __init__(
        self, stages: Sequence[Callable], plan: SequentialPlan, *, slots: int, strategy: str = "optimal",
        signatures: Sequence[str] | None = None, menus=None, residents=None, offloading: Offloading | None = None,
    ):
        """menus: the stages' block-option menus (hierremat.planning.chain_menus.ChainMenus), if any;
        residents: the values carried beside the activation (hierremat.plans.stage_info.ResidentLayout);
        offloading: the second tier re-plans may offload to and plans that offload run with."""
        self.stages = list(stages)
        self.slots = slots
        self.strategy = strategy
        self.signatures = signatures
        self.menus = menus
        self.residents = residents
        self.offloading = offloading
        self.sharded = None
        self.agree = None
        self.step_grads = StepGrads(self.stages)
        self._by_step_grads: dict[tuple[int, ...], SequentialPlan] = {}
        #: where set (time_steps), its steps on CPU record their stages' times (hierremat.runtime.step_times)
        self.step_times: StepTimes | None = None
        self._bind(plan)

    def time_steps(self, steps: int, earlier: StepTimes | None = None) -> StepTimes:
        """Record the stages' times in this chain's next ``steps`` steps on CPU, whichever plan runs them (re-plans
        included); the recorder, kept where already set. ``earlier``: the recorder of a plan this one replaces, of
        the same shape, goes on where it timed a chain of these stages (their signatures)."""
        if self.step_times is None:
            chain = tuple(self.signatures or ())
            same = earlier is not None and earlier.stages == len(self.stages) and earlier.chain == chain
            self.step_times = earlier if same else StepTimes(len(self.stages), steps, chain)
            self.runner.step_times = self.step_times
        return self.step_times

    def retime(self, stage_times: Sequence[tuple[float, float, float]], device: torch.device) -> None:
        """Solve the plan again (the chain DP alone) with each stage's times under autograd replaced by
        ``stage_times`` (as the training steps measured them: hierremat.runtime.step_times) and its block options'
        scaled with them (ChainCosts.with_step_times), for the budget, output use and step gradients planned; the
        plans kept per step-gradient case are solved again when next needed."""
        costs = self.plan.costs.with_step_times(stage_times)
        profile = ChainProfile(costs, self.plan.mutated_buffers, self.plan.output_grad_mask)
        plan = self._solve_agreed(profile, device, self.plan.profile_seconds, costs.held_output, costs.step_grad_bytes)
        before = self.runner
        self._by_step_grads = {}
        self._bind(plan)
        # (what the steps so far observed of the caller holds under the plan solved again too)
        self.runner.observed_output_use = before.observed_output_use
        self.runner.observed_backward_autocast = before.observed_backward_autocast

    def _bind(self, plan: SequentialPlan) -> None:
        self.plan = plan
        executors = forwards = None
        if self.menus is not None:
            executors = self.menus.executors
            forwards = [self.menus.forward_executor(i, st.nograd_form) for i, st in enumerate(plan.costs.stages)]
        elif any(st.nograd_form != "autograd" for st in plan.costs.stages):
            raise ValueError("the plan runs generated forwards, but the chain has no block menus: plan it again")
        transfers = transfer_plan(plan.costs, plan.schedule)
        tier = None
        if transfers.moves_anything:
            if self.offloading is None:
                raise ValueError("the plan offloads checkpoints to a second tier: run it with offload=True (or a "
                                 "directory)")
            # (at most one storage per value an offloaded tape keeps, as its generated program says, and its input)
            kept_values = sum(len(executors[i][k].program.kept_slots) + sent for i, k, sent in transfers.kept_offloaded)
            self.offloading.check(transfers, kept_values)  # (a saved plan, or rank 0's under FSDP2: another limit)
            tier = functools.partial(self.offloading.tier_for, transfers, kept_values)
        self.runner = ChainRunner(
            self.stages, plan.schedule, plan.mutated_buffers, executors, self.sharded, forwards, self.residents,
            tier, transfers,
        )
        self.runner.step_times = self.step_times

    def shard(self, sharded, plan: SequentialPlan, agree: Callable) -> None:
        """Run the stages through their FSDP2 modules (hierremat.runtime.fsdp.ShardedChain) under
        ``plan``, which uses option 0 of every stage (block options are not used under FSDP2).

        agree: maps this rank's re-planning outcome (a plan, or an InfeasibleBudgetError) to
        rank 0's, so that every rank keeps running the same schedule."""
        self.sharded = sharded
        self.agree = agree
        self.menus = None
        self.step_grads = StepGrads(self.stages, sharded.model)
        self._by_step_grads = {}
        self._bind(plan)

    def use_stages(self, stages: Sequence[Callable]) -> None:
        """Run ``stages`` from now on, the same programs as the stages planned (hierremat.blocks.generic: one copy
        that runs at every shape of the symbolic capture)."""
        self.stages = list(stages)
        if self.menus is not None:
            self.menus.use_stages(self.stages)
        self.reread_tensors()

    def reread_tensors(self) -> None:
        """Read the stages' parameters and buffers again (a model planned on meta and materialized since:
        hierremat.runtime.lent_weights): the gradients each backward makes, and the buffers replays restore."""
        self.step_grads = StepGrads(self.stages, self.sharded.model if self.sharded is not None else None)
        self._bind(self.plan)

    @property
    def assumed_output_use(self) -> OutputUse:
        return OutputUse(self.plan.costs.held_output, self.plan.output_grad_mask)

    def run(self, x: torch.Tensor, shared: tuple = ()):
        seen = self.runner.observed_output_use
        if seen is not None and seen != self.assumed_output_use:
            self._replan(seen, x, shared)
        step_grads = self.step_grads.bytes() if torch.is_grad_enabled() else self.plan.costs.step_grad_bytes
        if step_grads != self.plan.costs.step_grad_bytes:  # (without grad no backward allocates them)
            self._plan_for_step_grads(step_grads, x.device)
        if self.sharded is not None:
            return self.sharded.run(lambda x, *shared: self.runner.run(x, shared), x, *shared)
        return self.runner.run(x, shared)

    def _plan_for_step_grads(self, step_grads: tuple[int, ...], device: torch.device) -> None:
        """Run the plan for the parameter gradients this step allocates (ChainCosts.step_grad_bytes),
        solving it from the current plan's costs the first time that case is met."""
        self._by_step_grads[self.plan.costs.step_grad_bytes] = self.plan
        plan = self._by_step_grads.get(step_grads)
        if plan is None:
            log.info(
                "the step allocates %d B of parameter gradients (.grad None at its start: zero_grad(set_to_none=True)), "
                "the plan assumed %d B: planning for it", sum(step_grads), sum(self.plan.costs.step_grad_bytes),
            )
            profile = ChainProfile(self.plan.costs, self.plan.mutated_buffers, self.plan.output_grad_mask)
            plan = self._solve_agreed(profile, device, self.plan.profile_seconds, self.plan.costs.held_output, step_grads)
            self._by_step_grads[step_grads] = plan
        self._bind(plan)

    def _replan(self, seen: OutputUse, x: torch.Tensor, shared: tuple) -> None:
        assumed = self.assumed_output_use
        out_bytes = self.plan.costs.activation_bytes[-1]
        if seen.held_bytes > assumed.held_bytes:
            log.warning(
                "the caller held %d B of the chain output (%d B) through the backward, where the plan assumed %d B: "
                "that step may have exceeded the budget by up to the difference. Re-planning with it held; release "
                "the output before backward (e.g. `loss = model(x).loss`) to keep the faster plan.",
                seen.held_bytes, out_bytes, assumed.held_bytes,
            )
        unexpected = [i for i, (s, a) in enumerate(zip(seen.grad_mask, assumed.grad_mask)) if s and not a]
        if unexpected:
            log.warning(
                "gradients arrived for chain outputs %s, which the plan expected none for: that step may have "
                "exceeded the budget by their bytes. Re-profiling and re-planning.", unexpected,
            )
        log.info("re-planning for how the caller used the chain's output: %s (planned: %s)", seen.describe(),
                 assumed.describe())
        profile = ChainProfile(self.plan.costs, self.plan.mutated_buffers, self.plan.output_grad_mask)
        profile_seconds = self.plan.profile_seconds
        if seen.grad_mask != assumed.grad_mask and self.sharded is not None:
            log.warning("under FSDP2 the stages are not profiled again: re-planning with the costs measured before")
        elif seen.grad_mask != assumed.grad_mask:
            started = time.perf_counter()
            profile = profile_chain(
                self.stages, x, shared=shared, signatures=self.signatures, output_grad_mask=seen.grad_mask,
                residents=self.residents,
            )
            if self.menus is not None:
                profile = self.menus.extend(profile)
            profile_seconds = time.perf_counter() - started
        outcome = self._solve_agreed(profile, x.device, profile_seconds, seen.held_bytes, self.step_grads.bytes())
        self._by_step_grads = {}  # planned for another use of the output
        self._bind(outcome)

    def _solve_agreed(self, profile: ChainProfile, device: torch.device, profile_seconds: float, output_held: int,
                      step_grads: tuple[int, ...]) -> SequentialPlan:
        """plan_from_profile at this chain's budget, every rank on rank 0's outcome (``agree``);
        raises InfeasibleBudgetError where it is infeasible."""
        try:
            outcome = plan_from_profile(
                self.stages, profile, self.plan.budget_bytes, device, slots=self.slots,
                profile_seconds=profile_seconds, strategy=self.strategy, output_held=output_held,
                step_grads=step_grads, offloading=self.offloading,
            )
        except InfeasibleBudgetError as err:
            outcome = err
        if self.agree is not None:
            outcome = self.agree(outcome)
        if isinstance(outcome, InfeasibleBudgetError):
            raise outcome
        return outcome
