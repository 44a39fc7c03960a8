"""``hr.Settings``: every planning option beside the model, its inputs, the budget and what the caller uses.

``hr.remat``, ``hr.plan`` and ``hr.explore`` take the model, the example inputs, ``budget=`` and a few
keywords (``outputs=``, ``device=``, remat's ``plan=``); everything else is one frozen value::

    m = hr.remat(model, (ids,), {"labels": ids}, budget="3GiB",
                 settings=hr.Settings(offload=True, time_limit=60))
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..dp.solve import DEFAULT_SLOTS
from ..planning.chain_plan import PLAN_TIME_LIMIT
from ..plans.model_plan import ModelPlan
from .shape_planning import PlanSettings

#: How many input shapes' plans a RematModule keeps (least recently used dropped first; a dropped shape plans again
#: when it comes back). A shape that runs its family's size-generic graphs (hierremat.blocks.generic) and no generated
#: code holds its schedule, costs and runner state alone: 36 KiB of Python allocations for a 2-layer GPT-2, 61 KiB for
#: a 12-layer one (benchmarks/bench_shapes.py --rss; 0.6 and 2.3 MiB with graphs of its own).
DEFAULT_MAX_SHAPES = 1024


@dataclass(frozen=True)
class Settings:
    """How hierremat plans and runs a model (each field's default is the one given; None where remat takes
    the value from its ``plan=``).

    slots: memory units of the chain DP's tables (more: finer plans, slower DP).
    strategy: 'optimal' (default), or a baseline on the same chain and runtime: 'none' (no checkpointing) or
        'segments=K' (torch's uniform checkpoint_sequential segments).
    output_held: whether the caller keeps the model's outputs alive through the backward (``out = model(...);
        out.loss.backward()``) or not (``model(...).loss.backward()``). None: assume held unless only a plan
        assuming release fits; the module checks at every backward and plans again if the caller does otherwise.
        Of several outputs, only scalar losses are expected to receive gradients (also checked).
    block_options: 'ilp': every distinct block also offers the optimal options of its per-block ILP
        (hierremat.planning.menus); 'autograd': only what autograd keeps (Rotor on blocks, a baseline).
    cache: where solved block options are cached: True (``$HIERREMAT_CACHE_DIR`` or ``~/.cache/hierremat``), a
        directory, or False (none).
    segmentation: 'blocks' (None's default): one stage per repeated block (decoder layer, ResNet block), each
        distinct block solved once; 'none': everything before the output stage solved as one block by one ILP
        (Checkmate on the whole graph): the optimality reference for small models, and a baseline.
    variants: whether operators may run as hierremat's memory-lean variants (hierremat.blocks.variants: a
        row-blocked cross-entropy, 1-bit dropout and ReLU masks, in-place kernels, embeddings and large linear
        weights that add into ``.grad``); True (None's default).
    compile: whether block options run compiled by Inductor (hierremat.planning.compiled): True, False, or
        "auto" (None's default: True on CUDA where the model computes in fp32). Compiled options are priced from
        their compiled form; their gradients agree with eager ones to the rounding of fused arithmetic.
    time_limit: seconds one plan may take from the start of its capture (None: no bound). Once they have passed,
        the stages measured next are timed from one run (their memory still in full), blocks get node costs
        modelled from FLOPs and bytes and the coarser heuristic menu (as does a block whose ILP would be too
        large), and nothing more is compiled; the summary says what was cut, and nothing cut is cached. Every
        solve has a limit of its own too.
    offload: False (None's default); True: checkpointed activations and a block option's kept values may go to
        a second tier where that is faster than recomputing them (the chain DP chooses per value, with the
        tier's bandwidths measured on this machine): pinned host memory on CUDA, a temporary directory on CPU;
        or a directory to offload to. The budget still counts the device's bytes only.
    offload_limit: the most the second tier holds at once (bytes or "8GiB"); default half of the available host
        memory, or of the directory's free space.
    backward_autocast: under autocast, whether the step's backward runs inside the autocast context (True) or
        after it closed (False: torch's AMP recipe, HF Trainer, accelerate). None: not known; remat learns it at
        the first backward, and a block whose backward autocast changes gets block options from then on.

    remat only:

    defer_block_options: True: block options are built once they pay (rent or buy): a shape is first planned
        without them where they could save less per step than building them costs, and they are built once
        the steps without them have lost that much, at once where the budget needs them or the cache has them.
        False: built at once, as hierremat.plan does.
    on_new_shape: "replan": a call with inputs of a new shape is planned for it, from the second shape on from
        one symbolic capture, its block menus re-costed (no ILP solve); "error": raise.
    max_shapes: how many shapes' plans are kept (least recently used dropped first, planned again when they
        come back); at most MAX_SHAPES_WITH_GRAPHS of them hold graphs of their own with the default.
    dynamic: which input sizes are captured symbolic at the first shape, as torch.compile's ``dynamic``. None:
        those the example inputs mark dynamic, and the length where a 2-D ``attention_mask`` pads a row; with
        none, the sizes that differ are made symbolic at the second shape. True: every size; False: none (each
        shape captured and measured on its own).
    """

    slots: int = DEFAULT_SLOTS
    strategy: str = "optimal"
    output_held: bool | None = None
    block_options: str = "ilp"
    cache: bool | str = True
    segmentation: str | None = None
    variants: bool | None = None
    compile: bool | str | None = None
    time_limit: float | None = PLAN_TIME_LIMIT
    offload: bool | str | None = None
    offload_limit: int | str | None = None
    backward_autocast: bool | None = None
    defer_block_options: bool = True
    on_new_shape: str = "replan"
    max_shapes: int = DEFAULT_MAX_SHAPES
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if self.on_new_shape not in ("replan", "error"):
            raise ValueError(f"on_new_shape must be 'replan' or 'error', got {self.on_new_shape!r}")
        if not (self.dynamic is None or isinstance(self.dynamic, bool)):
            raise ValueError(f"dynamic must be None (sizes marked dynamic or a padded attention_mask make them "
                             f"symbolic at the first shape, the sizes that vary at the second), True (every size "
                             f"symbolic at the first shape) or False (each shape captured on its own), "
                             f"got {self.dynamic!r}")
        if not isinstance(self.max_shapes, int) or isinstance(self.max_shapes, bool) or self.max_shapes < 1:
            raise ValueError(f"max_shapes must be a positive int (how many input shapes' plans are kept), "
                             f"got {self.max_shapes!r}")

    def planning(self, outputs, device, plan: ModelPlan | None = None, *, defer: bool = False) -> PlanSettings:
        """The settings one shape is planned with: outputs and device as given, the fields left None taken
        from ``plan`` where there is one, else their defaults; block options deferred only with ``defer``."""

        def chosen(given, planned, default):
            return given if given is not None else planned() if plan is not None else default

        return PlanSettings(
            self.slots, self.strategy, self.output_held, self.block_options, self.cache,
            chosen(self.segmentation, lambda: plan.segmentation, "blocks"),
            chosen(self.variants, lambda: plan.variants, True),
            chosen(self.compile, lambda: plan.compiled, "auto"),
            chosen(outputs, lambda: plan.outputs, None),
            self.time_limit, None if device is None else str(device),
            chosen(self.offload, lambda: plan.chain.offloads, False),
            self.offload_limit, self.backward_autocast, defer and self.defer_block_options,
        )


def settings_from(settings: Settings | None) -> Settings:
    """``settings``, or the defaults; a TypeError naming hr.Settings for anything else."""
    if settings is None:
        return Settings()
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a hierremat.Settings, got {type(settings).__name__}: "
                        f"hr.Settings({', '.join(f.name + '=...' for f in fields(Settings)[:3])}, ...)")
    return settings
