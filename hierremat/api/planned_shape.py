"""One input shape's plan, made runnable: what a RematModule keeps per shape.

``ChainModule`` runs the chain of stages by its schedule (hierremat.planning.chain_plan.PlannedChain);
``PlannedShape`` holds it with the model's captured graph (its own, or its family's size-generic one:
hierremat.blocks.generic), the plan (hierremat.plans.model_plan.ModelPlan),
the sample its profile gives shape fits (hierremat.planning.shape_fit) and, under FSDP2, its sharded chain.
Made by hierremat.api.shape_planning.plan_shape.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import torch
from torch import nn

from ..blocks.generic import GenericChain
from ..blocks.segment import CHAIN_ATTRIBUTE, ChainGraph
from ..budget import format_bytes
from ..errors import InfeasibleBudgetError, UnsupportedModelError
from ..plans.model_plan import ModelPlan
from ..runtime.executor import as_tuple
from ..runtime.fsdp import ShardedChain, reserve_bytes, with_gathered
from ..runtime.lent_weights import bind_to_model, has_abstract_weights
from ..runtime.profile import ChainProfile
from ..runtime.step_grads import StepGrads
from ..planning.chain_plan import PlannedChain, plan_from_profile
from ..planning.shape_fit import ShapeSample
from .ranks import rank0s

log = logging.getLogger(__name__)

#: How a plan's ``times`` says that a measured shape's times are of one timed run each (ProfiledChain.one_run)
ONE_RUN_NOTE = " (times of one run each, until its training steps time it)"


class ChainModule(nn.Module):
    """Runs the stages of a captured model as the plan's schedule (the orchestrator's chain).

    Under ``torch.compile`` its call is an explicit graph break (``torch.compiler.disable``):
    the runner executes the schedule with Python state (RNG states, tapes, the output's
    use) that Dynamo cannot trace, while the orchestrator's code around it (masks,
    positions, the output's assembly) is compiled.
    """

    def __init__(self, stages: list[nn.Module], planned: PlannedChain):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.planned = planned

    @torch.compiler.disable(reason="hierremat's chain runner: its schedule keeps Python state Dynamo cannot trace")
    def forward(self, x: torch.Tensor, *shared) -> tuple:
        for value in shared:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise UnsupportedModelError(
                    "a value shared by all stages requires grad; hierremat's chain supports only shared inputs "
                    "without gradient (masks, ids). Pass such tensors with requires_grad=False."
                )
        return as_tuple(self.planned.run(x, tuple(shared)))


class ChainDispatch(nn.Module):
    """The chain a size-generic orchestrator calls (hierremat.blocks.generic.GenericChain): the ChainModule of the
    shape being called, set before each call by :meth:`use`, per thread (not a submodule: the shapes' plans are
    RematModule's)."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "_current", threading.local())

    def use(self, chain: nn.Module) -> None:
        self._current.chain = chain

    @torch.compiler.disable(reason="hierremat's chain runner: its schedule keeps Python state Dynamo cannot trace")
    def forward(self, x: torch.Tensor, *shared) -> tuple:
        return self._current.chain(x, *shared)

    def __deepcopy__(self, memo) -> "ChainDispatch":
        copied = ChainDispatch()  # (set again before the copy's next call: PlannedShape.orchestrator)
        memo[id(self)] = copied
        return copied


class _ChainInputs(Exception):
    def __init__(self, x, shared):
        super().__init__("chain inputs probed")
        self.x, self.shared = x, shared


class _Probe(nn.Module):
    def forward(self, x, *shared):
        raise _ChainInputs(x, shared)


def chain_inputs(chain: ChainGraph, args: tuple, kwargs: dict):
    """Run the orchestrator's precompute part only, returning the chain's input and shared values."""
    setattr(chain.orchestrator, CHAIN_ATTRIBUTE, _Probe())
    try:
        with torch.no_grad():
            chain.orchestrator(*args, **kwargs)
    except _ChainInputs as probe:
        return probe.x, probe.shared
    raise AssertionError("the orchestrator did not reach the chain")


class PlannedShape:
    """A captured model bound to its plan; ``plan`` follows the chain's re-plans (PlannedChain)."""

    def __init__(self, chain: ChainGraph, plan: ModelPlan, chain_module: "ChainModule"):
        self.chain = chain
        self._plan = plan
        self.chain_module = chain_module
        self.family: tuple = ()  # the inputs' family_key (hierremat.api.shape_families), set by RematModule
        self.sample: ShapeSample | None = None  # its measured costs (None: fitted, or run from a saved plan)
        #: where its times were fitted, its block graphs' node times and speeds measured here (ShapeSample.nodes_of)
        self.node_sample: ShapeSample | None = None
        self.bindings: dict | None = None  # its sizes by symbol in the symbolic capture it was planned with
        self.skeleton: tuple = ((), {})  # its inputs as meta tensors (their shapes)
        self.sources: list[str] = []  # fx's sources of the graphs traced to plan it (hierremat.blocks.sources)
        self.lent = False  # planned on meta with lent weights: bound to the model's own when it has them
        self.unsharded: ModelPlan | None = None  # the plan before shard() re-made it (what each re-shard starts from)
        self.least_held: int | None = None  # bytes of the output a caller that releases it still holds (its losses)
        self.saved = False  # run from a saved plan (remat(..., plan=)): never planned again here
        self.block_gain = 0.0  # ProfiledChain.block_gain: seconds a step block options not re-costed could save
        self.build_estimate: float | None = None  # ProfiledChain.build_estimate: planned before any were built
        self.menus_from_cache = False  # ProfiledChain.menus_from_cache: block options built only as the cache had them
        self.steps_without = 1  # steps run without block options not re-costed (block_gain), the first included
        self.reduced_fit = False  # its times fitted from fewer shapes timed than the monomials (ShapeFit.reduced)
        self.family_timed = 0  # its family's shapes timed when it was planned (StepRetimer.timed_count)
        self.one_run = False  # measured from one timed run each (ProfiledChain.one_run): also after its first step
        self.retimed_steps = 0  # its steps whose times it was last solved from (StepRetimer.retime)
        self.steps_sampled = 0  # its steps whose times are in its family's step samples (StepRetimer.step_samples_of)
        self.recipe_warned = False  # a saved plan run under the other autocast recipe: warned once
        self.copies_warned = False  # a saved plan run by a caller that copies the outputs to fp32: warned once
        self.dispatch: nn.Module | None = None  # running its family's size-generic graphs: their ChainDispatch

    def run_generic(self, generic: GenericChain) -> None:
        """Run ``generic``'s stages and orchestrator (the same programs as its own, checked: GenericChain.holds_for)
        instead of its own specialized graphs, which it then no longer holds."""
        half = self.chain.half_outputs_in_fp32_bytes  # (read from its own graphs' metadata: its sizes)
        self.chain = replace(self.chain, stages=list(generic.stages), orchestrator=generic.orchestrator)
        self.chain.__dict__["half_outputs_in_fp32_bytes"] = half
        self.chain_module.stages = nn.ModuleList(generic.stages)
        self.chain_module.planned.use_stages(generic.stages)
        self.dispatch = generic.dispatch

    @property
    def holds_graphs(self) -> bool:
        """Whether it holds graphs of its own: its own captured graphs (not its family's size-generic ones), or block
        options' generated code traced at its shape (not its family's: hierremat.planning.family_programs)."""
        menus = self.chain_module.planned.menus
        return self.dispatch is None or (menus is not None and menus.runs_code_of_its_own)

    @property
    def holds_menus(self) -> bool:
        """Whether it holds block options costed at its shape (their StageMenus: block graphs and options; 0.2 MiB of
        Python allocations for a 4-layer GPT-2, whose programs its family shares:
        hierremat.planning.family_programs)."""
        menus = self.chain_module.planned.menus
        return menus is not None and bool(menus.menus)

    def orchestrator(self) -> nn.Module:
        """The captured model to call at this shape: its own, or its family's size-generic one, set to run its chain."""
        if self.dispatch is not None:
            self.dispatch.use(self.chain_module)
        return self.chain.orchestrator

    def released_output(self) -> tuple[bool, ...] | None:
        """Where the caller released the chain output before the backward at this shape's last step (held no
        more of it than its losses: hierremat.planning.chain_plan.least_held_bytes), the outputs that got a
        gradient then; else None (not seen yet, or held)."""
        seen = self.chain_module.planned.runner.observed_output_use
        if seen is None or self.least_held is None or seen.held_bytes > self.least_held:
            return None
        return seen.grad_mask

    def graphs(self) -> list[nn.Module]:
        """Every graph that reads the model's tensors: the orchestrator, the stages and their other forms."""
        forms = [self.chain.orchestrator, *self.chain.stages]
        menus = self.chain_module.planned.menus
        if menus is not None:
            forms += [e.stage for executors in menus.executors for e in executors if hasattr(e, "stage")]
        return forms

    def bind_to(self, model: nn.Module) -> None:
        """Compute with ``model``'s own parameters and buffers (a model planned on meta, materialized
        since with ``to_empty`` and initialized); raises where it still has none."""
        if has_abstract_weights(model):
            raise UnsupportedModelError(
                f"{type(model).__name__} was planned without its weights and still has meta (or fake) parameters or "
                "buffers: materialize it before training (model.to_empty(device=...), then initialize its weights; "
                "a model built under FakeTensorMode: load_state_dict(..., assign=True), and set its buffers outside "
                "the state dict)"
            )
        bind_to_model(self.graphs(), model)
        self.chain_module.planned.reread_tensors()
        self.lent = False

    @property
    def times_note(self) -> str:
        """What its plan's ``times`` says of how its times are known besides the fit (ONE_RUN_NOTE, or the training
        steps it was solved again from: StepRetimer.retime), or nothing."""
        if self.retimed_steps:
            return f"; times from its first {self.retimed_steps} training steps"
        return ONE_RUN_NOTE if self.one_run else ""

    def relabel_times(self, old: str, new: str) -> None:
        """Say in the plan's ``times`` how its times are now known (``old`` replaced by ``new``; none: ``new``
        added at the end)."""
        for name in ("_plan", "unsharded"):  # (sharded: what a re-shard starts from, its label too)
            plan = getattr(self, name)
            if plan is not None:
                setattr(self, name, replace(plan, times=plan.times.replace(old, new) if old else plan.times + new))

    @property
    def plan(self) -> ModelPlan:
        current = self.chain_module.planned.plan
        if self._plan.chain is not current:
            self._plan = replace(self._plan, chain=current)
        return self._plan

    def retime(self, stage_times) -> None:
        """Solve the plan again from the stage times its training steps observed (PlannedChain.retime: the chain DP
        alone); sharded, what each re-shard starts from takes them too (its stages as FSDP2 runs them, the stage
        itself for every forward: StageCosts.called_as_module; ChainCosts.with_step_times), so that a re-shard keeps
        them."""
        self.chain_module.planned.retime(stage_times, torch.device("cpu"))  # (steps are timed on CPU alone)
        if self.unsharded is not None:
            chain = self.unsharded.chain
            as_run = replace(chain.costs, stages=tuple(st.called_as_module() for st in chain.costs.stages))
            self.unsharded = replace(self.unsharded, chain=replace(chain, costs=as_run.with_step_times(stage_times)))

    @property
    def sharded(self) -> bool:
        return self.chain_module.planned.sharded is not None

    def count_copies(self, copies: int) -> None:
        """Count ``copies`` bytes of fp32 copies the caller makes of the outputs (ModelPlan.output_copies_bytes) in
        what the next :meth:`shard` starts from (the caller re-shards: RematModule._orchestrator)."""
        self.unsharded = replace(self.unsharded or self.plan, output_copies_bytes=copies)

    def shard(self, model: nn.Module, budget_bytes: int) -> None:
        """Re-plan for the FSDP2 modules ``fully_shard`` made of ``model`` (hierremat.runtime.fsdp):
        option 0 per stage, what FSDP2 gathers counted, rank 0's plan on every rank (a collective: every rank
        calls it together). Again after that, from the plan made before the first call (RematModule._orchestrator:
        where another rank plans a new shape, this rank re-plans with it)."""
        sharded = ShardedChain(model, self.chain.stages)
        gathered = sharded.gathered_bytes()
        planned = self.chain_module.planned
        if self.unsharded is None:
            self.unsharded = self.plan
        plan = self.unsharded
        costs = with_gathered(plan.chain.costs, gathered)
        reserve = reserve_bytes(gathered)
        profile = ChainProfile(costs, plan.chain.mutated_buffers, plan.chain.output_grad_mask)
        device = next(iter(model.parameters())).device
        try:
            outcome = plan_from_profile(
                planned.stages, profile, budget_bytes - plan.shared_bytes - plan.output_copies_bytes - reserve, device,
                slots=planned.slots, strategy=planned.strategy, output_held=costs.output_held_bytes,
                step_grads=StepGrads(planned.stages, model).bytes(), offloading=planned.offloading,
            )
        except InfeasibleBudgetError as err:
            outcome = err
        outcome = rank0s(outcome)
        if isinstance(outcome, InfeasibleBudgetError):
            raise outcome.plus(budget_bytes, plan.shared_bytes + plan.output_copies_bytes + reserve,
                               copies_note(plan.output_copies_bytes)) from None
        chain_plan = outcome
        log.info(
            "%s is sharded with FSDP2: re-planned with up to %d B gathered per stage and %d B held beside the chain",
            type(model).__name__, max(gathered.per_stage, default=0), reserve,
        )
        planned.shard(sharded, chain_plan, agree=rank0s)
        self._plan = replace(
            plan, chain=chain_plan, menus={}, gathered_stage_bytes=gathered.per_stage, sharded_reserve_bytes=reserve,
        )


def copies_note(output_copies_bytes: int) -> str:
    """What an InfeasibleBudgetError's minimums count of the caller's fp32 copies of the outputs (ModelPlan.output_copies_bytes)."""
    if not output_copies_bytes:
        return ""
    return (f"; each counts {format_bytes(output_copies_bytes)} of fp32 copies the caller makes of the model's fp16/bf16 "
            "outputs (accelerate's mixed precision, as the Trainer's bf16=True and fp16=True run it)")
