"""``hierremat.plan`` and ``hierremat.explore``: a whole model's plan at one budget, and the budgets it can take
(its smallest feasible one, a menu of plans from there to keeping everything) from one capture and profile."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..blocks.capture import uncompiled
from ..blocks.hf import call_kwargs
from ..budget import parse_budget
from ..dp.solve import DEFAULT_SLOTS
from ..errors import InfeasibleBudgetError
from ..plans.model_plan import ModelPlan
from ..device.autocast import AutocastState
from ..planning.chain_plan import PLAN_TIME_LIMIT
from .sequential import check_devices
from .shape_planning import PlanSettings, ProfiledChain, captured_chain, plan_shape, device_types


def plan(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    budget,
    slots: int = DEFAULT_SLOTS,
    strategy: str = "optimal",
    output_held: bool | None = None,
    block_options: str = "ilp",
    cache: bool | str = True,
    segmentation: str = "blocks",
    variants: bool = True,
    compile: bool | str = "auto",
    outputs: str | tuple[str, ...] | None = None,
    time_limit: float | None = PLAN_TIME_LIMIT,
    device: str | torch.device | None = None,
    offload: bool | str = False,
    offload_limit: int | str | None = None,
    backward_autocast: bool | None = None,
) -> ModelPlan:
    """Capture, segment, profile and solve ``model`` on example inputs under ``budget``.

    strategy: 'optimal' (default), or a baseline on the same chain and runtime: 'none'
    (no checkpointing) or 'segments=K' (torch's uniform checkpoint_sequential segments).
    block_options: 'ilp' (default): every distinct block also offers the optimal options
    of its per-block ILP (hierremat.planning.menus); 'autograd': only what autograd keeps
    (Rotor on blocks, a baseline).
    cache: where solved block options are cached: True (``$HIERREMAT_CACHE_DIR`` or
    ``~/.cache/hierremat``), a directory, or False (no cache).
    segmentation: 'blocks' (default): one stage per repeated block (decoder layer, ResNet
    block), each distinct block solved once; 'none': everything before the output stage
    solved as ONE block by one ILP (Checkmate on the full graph): the optimality reference
    for small models, and a baseline. Its ILP grows with the model: small models only.
    variants: whether operators may run as hierremat's memory-lean variants
    (hierremat.blocks.variants): a cross-entropy whose backward works on blocks of rows, dropout
    masks packed to bits (so a dropout's output can be recomputed from its input).
    Each computes bitwise what the operator computes; False runs the model's own operators.
    output_held: whether the caller keeps the model's outputs alive through the backward
    (``out = model(...); out.loss.backward()``) or not (``model(...).loss.backward()``).
    None (default): assume held unless only a plan assuming release fits; the module
    checks on every backward and re-plans if the caller does otherwise. Of several
    outputs, only scalar losses are expected to receive gradients (also checked).
    compile: whether block options run compiled by Inductor (hierremat.planning.compiled): True,
    False, or "auto" (default: True on CUDA where the model computes in fp32, else False:
    planning.chain_plan.resolve_compile). Compiled options are chosen with
    costs measured on their compiled form; the options the plan uses are compiled while
    planning (cached on disk by Inductor under ``cache``), and ``summary()`` shows the time
    that took. Gradients then agree with eager ones to within the rounding of fused
    arithmetic, as with ``torch.compile``; dropout stays bitwise.
    outputs: None (default): the model's outputs, all of them, exactly as it returns them.
    The names of the outputs the caller uses (e.g. ``"loss"`` for a Hugging Face language
    model trained with ``model(...).loss.backward()``): the other named outputs are returned
    as None and never computed for their own sake, so a language model's logits need not
    exist whole: its head may then run fused with the loss, tile by tile (an option the
    plan picks by budget; hierremat.planning.output_stage). A model that returns only its loss gets
    that option without ``outputs=``.
    time_limit: seconds planning may take (default 300; None: no bound). No block ILP solve
    and no compile runs past it: a block left without time gets the coarser heuristic menu
    (keep everything, recompute everything, keep what is costliest to recompute), as does a
    block whose ILP would be too large; the summary says which. Every solve also has a
    limit of its own; an option its limit stopped shows its MIP gap in the summary.
    device: where the model trains, for a model built without its weights (``torch.device("meta")``:
    parameters with shapes and no storage, or ``FakeTensorMode``; example inputs may be meta or fake too):
    it is captured without values and planned with real weights lent per distinct stage on ``device``
    (hierremat.runtime.lent_weights), so planning holds one block's weights, not the model's. The plan is
    then used once the model is materialized (``to_empty(device=...)`` and its initialization). None
    (default): where the model's parameters are (the device its fake tensors stand for); a model on meta
    needs it.
    offload: False (default); True: checkpointed activations may also be offloaded to a second tier, where
    that is faster than recomputing them (the chain DP chooses per value, with the tier's bandwidths measured
    on this machine; Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021): pinned host memory on CUDA, a
    temporary directory on CPU (the process's RAM is freed); or a directory to offload to (a disk tier, on
    either device). ``budget`` still counts the bytes on the device only. The summary says what is offloaded,
    the bytes moved per step and the predicted stall. offload_limit: the most the second tier holds at once
    (bytes or "8GiB"); default half of the available host memory, or of the directory's free space. A
    directory that cannot be written, or has less free space than the limit, raises OffloadError here.
    backward_autocast: under autocast, whether the training step runs its backward inside the autocast context
    (True: one context around forward and backward) or after it closed (False: torch's AMP recipe, Hugging
    Face's Trainer, accelerate). None (default): not known; a block whose backward autocast changes (on CPU,
    attention with dropout) then gets no block options (remat learns it at the first backward).
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    settings = PlanSettings(
        slots, strategy, output_held, block_options, cache, segmentation, variants, compile, outputs, time_limit,
        None if device is None else str(device), offload, offload_limit, backward_autocast,
    )
    kwargs = call_kwargs(uncompiled(model), example_kwargs or {})
    return plan_shape(model, args, kwargs, parse_budget(budget), None, settings).plan


class BudgetExplorer:
    """What each memory budget costs a model, from one capture and one profile (see hierremat.explore).

    smallest_feasible_bytes: the smallest feasible budget InfeasibleBudgetError reports (a plan
    exists there; it sets aside the replay reserve of every stage, so the exact minimum may be
    up to that reserve lower); keep_all_bytes: the predicted peak of keeping everything
    (plain autograd's schedule). Plans at any budget
    are solved from the same measured costs, so their predicted times compare exactly; with ``offload=``
    given to explore, ``plan(budget, offload=False)`` is the plan without the second tier, from the same costs.
    """

    def __init__(self, profiled: ProfiledChain, capture_seconds: float):
        self._profiled = profiled
        self._capture_seconds = capture_seconds
        self.keep_all_bytes = profiled.solve(2**62, strategy="none").predicted_peak_bytes + profiled.beside_chain_bytes
        self.smallest_feasible_bytes = self._smallest_feasible()
        self._without_offload: int | None = None

    def _smallest_feasible(self, offload: bool = True) -> int:
        budget = 1
        for _ in range(4):  # follow the reported minimum until a plan exists there
            try:
                self._profiled.solve(budget, offload=offload)
                return budget
            except InfeasibleBudgetError as err:
                if err.min_budget_bytes <= budget:
                    raise
                budget = err.min_budget_bytes
        raise AssertionError(f"no plan at the smallest feasible budget reported ({budget} B)")

    def smallest_feasible(self, offload: bool = True) -> int:
        """The smallest feasible budget (as smallest_feasible_bytes), with the second tier or, ``offload``
        False, without it."""
        if _check_offload_flag(offload):
            return self.smallest_feasible_bytes
        if self._without_offload is None:
            self._without_offload = self._smallest_feasible(offload=False)
        return self._without_offload

    def plan(self, budget, offload: bool = True) -> ModelPlan:
        """The plan within ``budget`` (bytes or "512MiB"); InfeasibleBudgetError below the smallest feasible one.
        offload: False plans without the second tier explore was given (the same costs: to compare)."""
        budget_bytes = parse_budget(budget)
        solved = self._profiled.solve(budget_bytes, offload=_check_offload_flag(offload))
        return self._profiled.model_plan(solved, self._capture_seconds)

    def menu(self, points: int = 6) -> tuple[ModelPlan, ...]:
        """Plans at ``points`` budgets spaced evenly from the smallest feasible one to keeping everything."""
        if points < 2:
            raise ValueError(f"points must be at least 2, got {points}")
        low, high = self.smallest_feasible_bytes, max(self.keep_all_bytes, self.smallest_feasible_bytes)
        budgets = sorted({low + (high - low) * i // (points - 1) for i in range(points)})
        return tuple(self._profiled.model_plan(self._profiled.solve(b), self._capture_seconds) for b in budgets)


def _check_offload_flag(offload) -> bool:
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True (with the second tier explore was given) or False (without it), got "
                        f"{offload!r}: the tier itself is chosen by explore(..., offload=)")
    return offload


def explore(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    slots: int = DEFAULT_SLOTS,
    output_held: bool | None = None,
    block_options: str = "ilp",
    cache: bool | str = True,
    segmentation: str = "blocks",
    variants: bool = True,
    outputs: str | tuple[str, ...] | None = None,
    time_limit: float | None = PLAN_TIME_LIMIT,
    offload: bool | str = False,
    offload_limit: int | str | None = None,
    backward_autocast: bool | None = None,
) -> BudgetExplorer:
    """Capture, profile and build the block menus of ``model`` once, to see what budgets cost.

    ``explore(model, args).menu()`` gives plans from the smallest feasible budget to keeping
    everything (``python -m hierremat`` prints them); ``.plan(budget)`` one plan, which
    ``remat(model, ..., plan=...)`` runs. Options as for hierremat.plan (block options run
    eagerly here: compiled forms are priced only when compiled, see ``compile=``; offload, offload_limit and
    backward_autocast as for hierremat.plan).
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    settings = PlanSettings(
        slots, "optimal", output_held, block_options, cache, segmentation, variants, False, outputs, time_limit,
        offload=offload, offload_limit=offload_limit, backward_autocast=backward_autocast,
    )
    model = uncompiled(model)
    kwargs = call_kwargs(model, example_kwargs or {})
    started = time.perf_counter()
    check_devices(device_types(args, kwargs), "the example inputs")
    autocast = AutocastState.capture(device_types(args, kwargs))
    chain, x0, shared, capture_seconds, _ = captured_chain(model, args, kwargs, settings, autocast, started)
    return BudgetExplorer(ProfiledChain.of(chain, x0, shared, settings, settings.deadline(started)), capture_seconds)
