"""Costs at a new input shape, fitted from the shapes measured before: every shape from one profile.

A model called at many shapes (dynamic padding) is measured in full at its first few shapes: each
distinct stage's times (hierremat.runtime.profile), each block graph's node times
(hierremat.runtime.node_profile) and the speed of each block's generated code. At a later shape
those times are fitted, each one on its own, by non-negative least squares over the monomials of the model's
symbolic sizes (hierremat.blocks.symbolic) that varied among the measured shapes (sizes equal at
every measured shape counted once):

    t(sizes) = c0 + c1 * n + sum_v c_v * n * v,    n = the product of the varying sizes,

linear terms in the tokens a shape holds, plus the quadratic term attention adds (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198:
activations and work per layer linear in the sequence length s plus a term in s^2). With one
varying size (the sequence length) that is a quadratic in it, fitted from three shapes or more.

Memory is fitted exactly, or measured. Each byte count of the chain profile is kept with the
candidates it is the largest of (hierremat.plans.memory_trace: a peak's live bytes after each
allocation, a size itself), each a sum of storage sizes and so a polynomial in the same monomials
(a storage of batch x seq x width bytes is linear in n, attention's batch x heads x seq x seq is
n x seq). Every candidate is fitted over the measured shapes, and the fit is used only where it
reproduces each of them to the byte at every measured shape (one shape more than the monomials);
then a figure at the new shape is its largest fitted candidate, with no run of the model (where candidates that
depend on the data, such as an embedding backward's buffers over the distinct tokens, rose above the exact ones
at a measured shape, by at most DATA_TOLERANCE of them at every one, the figure is raised by that share). Where a
sample has no trace (CUDA, whose allocator the budget is checked with, records none), a fit is not
exact, the shapes measured are only as many as the monomials (nothing checks a fit then) or the new
shape is farther than MEMORY_EXTRAPOLATION from them, the shape's memory is measured (the stage
profile's memory runs, single and untimed) and its times still fitted: times are fitted from as many
shapes as the monomials and up to EXTRAPOLATION outside them (a time only steers the plan; a byte
count is the budget's promise), or, where the training steps time the shapes and the memory is to be fitted,
however far outside them (scaled from the nearest shape timed). Where the training steps time the shapes, the
shorter lengths measured for memory fits are timed too, from one run each after the memory runs
(hierremat.api.shape_planning.sample_at's ``one_run``; a few milliseconds a stage at those lengths): the times are
then fitted over the whole range of lengths from the second shape on, where the steps' own lengths alone, at first
one or two near the longest, left the next lengths scaled from those by the tokens (bench_shapes --accuracy, 4-layer
GPT-2: 308 tokens fitted from 512 and 431 predicted at 1.14x its steps, 105 from 268 up at 0.85x; with 64, 96 and 128
tokens timed once, 1.00 and 1.01). Block options are re-costed on the shape's own
joint graph (exact), priced from node times profiled apart, and scaled as the training steps run option 0 over
the profile where the steps time the shapes (ShapeFit.step_ratios). Node times and code speeds are fitted from
the shapes that measured them: those profiled for times, and, where block options were built after those (deferred
until they pay), the shapes whose block graphs alone were measured since (ShapeSample.nodes_only), three of them for
one varying size.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from ..plans.costs import ChainCosts, step_time_ratios, timed_in_steps
from ..plans.memory_trace import is_scratch, with_memory
from ..runtime.profile import PROFILE_REPEATS, ChainProfile
from ..runtime.stage_cost_cache import ExecutorSpeeds

log = logging.getLogger(__name__)

#: Bump when what is fitted, or how, changes (part of a saved plan's hierremat.planning.menu_store.cost_model_version).
#: 3: times from the training steps, from fewer shapes than the monomials (ShapeFit.of); 4: two shapes timed nearer
#: than SPACING scale each time by the tokens, not a line through them; 5: times fitted with every term >= 0; 6: block
#: options scaled as the training steps run option 0 over the profile (ShapeFit.step_ratios); 7: a shape's profile
#: times, and the plan's times a steps' sample carries for stages the steps did not time, scaled by those ratios too
#: (ShapeFit._as_steps); 8: the shorter lengths measured for a family timed in its training steps are timed too, from
#: one run each (hierremat.api.shape_planning.sample_at's ``one_run``): its fits span them.
FIT_VERSION = "fit-8"
#: Shapes kept per model and input family to fit from (spread over the sizes measured: add_sample).
MAX_SAMPLES = 8
#: How far outside the measured sizes times are fitted (a factor on either side); a shape farther out is measured
#: (but in a family timed in its training steps, where its memory fits: ShapeFit.of's ``reduced``).
EXTRAPOLATION = 2.0
#: How far outside the measured sizes memory is fitted; farther out (or from fewer shapes than the
#: monomials and one more) it is measured, in single runs, while the times are fitted.
MEMORY_EXTRAPOLATION = 1.25
#: Timed shapes a fit over one varying size needs (its three monomials: ShapeFit.of), the first measured.
SAMPLED_SHAPES = 3
#: The ratio of sizes below which a new shape is too near a timed one to be the next timed shape (sizes_to_sample).
SPACING = 1.5
#: The smallest size sizes_to_sample measures at: below it allocations whose sizes depend on the data (an
#: embedding backward's buffers over the distinct tokens) outgrow the ones linear in the size at GPT-2 64
#: wide, and a memory fit over such a shape is not exact (then shapes' memory is measured).
MIN_SAMPLED_SIZE = 16
#: How far (a share of the figure) candidates that fit no polynomial may rise above the exact ones at a measured
#: shape and the figure still be fitted (ShapeFit._exact_figure): an embedding backward's buffers over the distinct
#: tokens, on top of the gradient of the hidden states at short lengths (0.5% at 44 tokens of 12-layer GPT-2).
DATA_TOLERANCE = 0.01


@dataclass(frozen=True)
class ShapeSample:
    """The costs measured at one input shape, by stage index.

    bindings: (size symbol, value) pairs of the shape (hierremat.blocks.symbolic). pattern: per
    stage, the index of the first stage with its signature (the chain's structure).
    profile: the chain profile measured there (its memory trace, where recorded, to fit memory from).
    stage_times: per stage, (no-grad forward, forward, backward) seconds of autograd's option.
    node_times: per stage, its block graph's node times by name (None without a menu).
    speeds: per stage, (scale, no-grad forward seconds) of its generated code (None without).
    times_measured: False for a shape whose memory alone was measured (its times fitted, or none: a sample
    measured for memory, hierremat.planning.shape_fit.memory_sizes_to_sample, in a family whose shapes are profiled
    for times; where the training steps time them, those are timed from one run each): a sample for memory fits
    only.
    option_nodes: per stage, the nodes each block option computes (its op lists' computes, in order, a node
    recomputed counted again; None without a menu): an option's time at any shape is theirs summed
    (hierremat.ilp.options.simulate_option), as ShapeFit.least_block_time bounds it.
    from_steps: the stage times were observed in the training steps at the shape (hierremat.runtime.step_times),
    not profiled: no profile, node times or speeds. A fit takes a shape's times from its steps where it has them
    (what the steps measure is what is predicted: a block's forward ran 10-15% slower in the 4-layer GPT-2's steps
    than profiled alone, its LM head 15% faster).
    cut: measured at inputs cut from a call's to fit other shapes from (hierremat.api.shape_planning.sample_at), not
    at a shape planned.
    nodes_only: only the block graphs' node times and generated code's speeds were measured at the shape, its stage
    times and memory fitted (:meth:`nodes_of`): a sample for ShapeFit's node-time and speed fits alone, kept apart
    from the others (hierremat.api.shape_families.ShapeFamilies.node_samples).
    """

    bindings: tuple[tuple[str, int], ...]
    pattern: tuple[int, ...]
    stage_times: tuple[tuple[float, float, float], ...]
    node_times: tuple[dict | None, ...]
    speeds: tuple[tuple[float, float] | None, ...]
    profile: ChainProfile | None = None
    times_measured: bool = True
    option_nodes: tuple[tuple[tuple[str, ...], ...] | None, ...] = ()
    from_steps: bool = False
    cut: bool = False
    nodes_only: bool = False

    @classmethod
    def from_step_times(cls, bindings: dict, pattern: tuple[int, ...],
                        stage_times: tuple[tuple[float, float, float], ...]) -> "ShapeSample":
        """A sample of the stage times observed in the training steps at the shape ``bindings``
        (hierremat.runtime.step_times.StepTimes.stage_times)."""
        none = (None,) * len(stage_times)
        return cls((), pattern, stage_times, none, none, from_steps=True).bound(bindings)

    @classmethod
    def of(cls, profile: ChainProfile, menus, signatures: Sequence[str], times_measured: bool = True) -> "ShapeSample":
        """A sample (bindings unset) from a shape's measured profile and its ChainMenus (or None)."""
        costs = profile.costs
        pattern = chain_pattern(signatures)
        stage_times = tuple(st.option_0_times for st in costs.stages)
        node_times, speeds, option_nodes = [], [], []
        computes: dict[str, tuple] = {}  # by signature: stages of one signature share their options' lists
        for i in range(len(costs.stages)):
            signature = menus.signatures[i] if menus is not None else None
            menu = menus.menus.get(signature) if menus is not None else None
            node_times.append({n.name: n.time for n in menu.graph.nodes} if menu is not None else None)
            speed = menus.speeds.get(signature) if menus is not None else None
            speeds.append((speed.scale, speed.forward_seconds) if speed is not None else None)
            if menu is not None and signature not in computes:
                computes[signature] = tuple(
                    tuple(name for kind, name in (*o.fwd_ops, *o.bwd_ops) if kind == "compute") for o in menu.options
                )
            option_nodes.append(computes.get(signature) if menu is not None else None)
        return cls((), pattern, stage_times, tuple(node_times), tuple(speeds), profile, times_measured,
                   tuple(option_nodes))

    @classmethod
    def nodes_of(cls, profile: ChainProfile, menus, signatures: Sequence[str]) -> "ShapeSample | None":
        """A ``nodes_only`` sample (bindings unset) of the stages whose menus' node costs and speeds were measured
        at this shape (ChainMenus.measured_here; the others' None), or None where no stage's were: at a shape whose
        times were fitted, so that the block options built after the shapes fitted from were measured are fitted from
        the shapes measured since (a loop whose lengths grow measures them a few times, not at every length)."""
        if menus is None or not any(menus.measured_here(s) for s in menus.signatures):
            return None
        full = cls.of(profile, menus, signatures, times_measured=False)
        here = [menus.measured_here(s) for s in menus.signatures]
        return replace(full, profile=None, nodes_only=True,
                       node_times=tuple(t if ok else None for t, ok in zip(full.node_times, here)),
                       speeds=tuple(p if ok else None for p, ok in zip(full.speeds, here)))

    def bound(self, bindings: dict) -> "ShapeSample":
        return replace(self, bindings=tuple(sorted((str(k), int(v)) for k, v in bindings.items())))


def add_sample(samples: list[ShapeSample], new: ShapeSample, limit: int = MAX_SAMPLES,
               keep: frozenset = frozenset()) -> None:
    """Add ``new`` to ``samples`` (in place), one per shape (a shape measured again replaces its sample,
    unless that one has measured times and the new one not), keeping at most ``limit``: beyond that
    the memory-only sample, else the sample, closest to another one (in log sizes) goes, so that the
    samples keep spanning every size measured; never one of the shapes ``keep`` (bindings: the steps' samples of
    the shapes also profiled, which ShapeFit.step_ratios compares with their profiles)."""
    same = [k for k, s in enumerate(samples) if s.bindings == new.bindings]
    if same:
        if samples[same[0]].times_measured and not new.times_measured:
            return
        del samples[same[0]]
    samples.append(new)
    while len(samples) > limit:
        logs = [np.log([max(v, 1) for _, v in s.bindings]) for s in samples]

        def crowding(i: int) -> float:
            return min(float(np.abs(logs[i] - logs[j]).sum()) for j in range(len(samples)) if j != i)

        older = [i for i in range(len(samples) - 1) if samples[i].bindings not in keep]  # never the one just measured
        if not older:
            break
        memory_only = [i for i in older if not samples[i].times_measured]
        samples.pop(min(memory_only or older, key=crowding))


def sizes_to_sample(samples: Sequence[ShapeSample], bindings: dict) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Where a new shape of a family comes (``bindings``: its sizes; the second, typically) and the shapes
    measured cannot fit its times yet, the sizes to measure at now, cut from this call's inputs
    (hierremat.blocks.symbolic SymbolicCapture.narrowed): (the sizes that differ from the samples', all
    equal: export may give one length several symbols; the sequence length, typically, or a batch size that
    differs alone; the values), so that with the shapes measured they make the SAMPLED_SHAPES timed shapes a fit
    needs, spread over the sizes seen and below (DESIGN.md: "profile each distinct block at a few sizes"):

    * a shape at least SPACING from every timed one is measured in full itself, and a quarter of it too;
    * a shape nearer one (a length near the first, as when a loop is planned at its longest batch) is not:
      it is fitted from two thirds and a quarter of the longest size seen, measured now (a half and a quarter of
      the shortest, where those are near a timed size; where too few sizes remain, it is measured in full after
      all). Three shapes that close (the shape and the first, and a quarter) fit the quadratic's curvature from
      two sizes a few percent apart, whose timing noise came out as a 12-19% error of the steps predicted
      between them; with a half instead of two thirds, a 12-layer GPT-2's LM head, whose time per row grows
      where its logits outgrow the cache, was 12-20% under-predicted between the half and the longest.

    Every later shape within EXTRAPOLATION of them has its times fitted (and, once four shapes have memory, its
    memory). None where sizes of different values differ, no size to cut is in [MIN_SAMPLED_SIZE, this shape's]
    and not measured already, or the samples already suffice."""
    timed = [dict(s.bindings) for s in samples if s.bindings and s.times_measured]
    needed = SAMPLED_SHAPES - len(timed)
    varying = _one_varying_size(samples, bindings) if needed > 0 else None
    if varying is None:
        return None
    differing, size = varying
    sizes = [k[differing[0]] for k in timed]

    def spaced(candidates: list[int]) -> tuple[int, ...]:
        values: list[int] = []
        for v in candidates:
            if len(values) < needed and MIN_SAMPLED_SIZE <= v <= size and all(
                    max(v, w) >= SPACING * min(v, w) for w in (*sizes, *values)):
                values.append(v)
        return tuple(values)

    if any(max(size, v) < SPACING * min(size, v) for v in sizes):  # near a timed shape: fitted, not measured
        longest, shortest = max([size, *sizes]), min([size, *sizes])
        values = max(spaced([longest * 2 // 3, longest // 4]), spaced([shortest // 2, shortest // 4]), key=len)
    else:  # measured in full (a timed shape itself), and a quarter of it
        needed -= 1
        values = spaced([size // 4])
    return (tuple(differing), values) if values else None


def _one_varying_size(samples: Sequence[ShapeSample], bindings: dict) -> tuple[tuple[str, ...], int] | None:
    """(the sizes in which the shape ``bindings`` differs from the samples', all of one value at every shape: export
    may give one length several symbols; that value at this shape), or None where the samples bind other sizes, the
    shape is one of theirs, or sizes of different values differ (sizes_to_sample, memory_sizes_to_sample)."""
    target = {str(k): int(v) for k, v in bindings.items()}
    known = [dict(s.bindings) for s in samples if s.bindings]
    if not known or any(set(k) != set(target) for k in known):
        return None
    differing = sorted({name for k in known for name in target if k[name] != target[name]})
    if not differing or len({tuple(k[name] for k in known) + (target[name],) for name in differing}) != 1:
        return None
    return tuple(differing), target[differing[0]]


def memory_sizes_to_sample(
    samples: Sequence[ShapeSample], bindings: dict, steps: Sequence[ShapeSample] | None = None,
) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Where a new shape of a family comes (``bindings``: its sizes) and, with the samples measured (those of
    sizes_to_sample among them), the shapes whose memory was measured will be as many as the monomials of one
    varying size, this one's own counted where its times cannot be fitted yet (it is then measured in full): the
    sizes to measure memory at (no timed runs but where the training steps time the shapes: one each, below), so
    that they are one more and a memory fit is checked (module
    docstring): half the shortest size measured, else between two sizes measured, shortest first (a run at a short
    size is the cheapest), each at least MIN_SAMPLED_SIZE and at most this shape's. Fitted memory at this shape (or
    the next) then costs one run at a short size, where measuring its own took single runs at its size: a
    4-layer GPT-2's second length, 431 tokens near its first, 512, measured its memory in 1.1-1.4 s here; at 64
    tokens the memory-only sample took 0.4 s. None where one size does not vary alone or no more are needed.

    steps: the shapes timed in the training steps, where the family's times are fitted from those
    (ShapeFit.of's ``reduced``): this shape's times are then fitted wherever it is within EXTRAPOLATION of a
    shape timed (else it is measured in full, unless its memory is to be fitted, from more shapes than this counts
    for: ShapeFit.of's ``beyond_timed``; its memory is beyond MEMORY_EXTRAPOLATION of those with memory: it
    counts then too), and the sizes measured for memory are a quarter, an eighth and
    three sixteenths of the shortest measured first (the second length needs three at once: 0.3-0.4 s each at those
    lengths of the 4-layer GPT-2, against 0.6 s at half of 512; at a sixteenth, 32 tokens, its embedding backward's
    buffers over the distinct tokens left stage 0's memory unfitted), then as above (between two sizes measured or
    chosen); the caller times those once each too (module docstring)."""
    if any(s.profile is None or s.profile.memory_trace is None for s in samples):
        return None  # (no memory to fit from: CUDA's allocator records no trace)
    varying = _one_varying_size(samples, bindings)
    if varying is None:
        return None
    differing, size = varying
    name = differing[0]
    timed = {dict(s.bindings)[name] for s in (*samples, *(steps or ())) if s.bindings and s.times_measured}
    measured = {dict(s.bindings)[name] for s in samples if s.bindings}
    if steps is None:
        fitted = len(timed) >= SAMPLED_SHAPES
    else:  # (and its memory is measured where beyond MEMORY_EXTRAPOLATION: it counts then)
        fitted = bool(timed) and min(timed) / EXTRAPOLATION <= size <= max(timed) * EXTRAPOLATION \
            and size <= max(measured) * MEMORY_EXTRAPOLATION
    sizes = sorted(measured | (set() if fitted else {size}))
    needed = SAMPLED_SHAPES + 1 - len(sizes)
    if needed <= 0 or size > max(sizes) * MEMORY_EXTRAPOLATION:
        return None
    shortest = _short_sizes(sizes[0]) if steps is not None else []
    values: list[int] = []
    while len(values) < needed:
        known = sorted({*sizes, *values})
        v = next((v for v in [*shortest, sizes[0] // 2, *((a + b) // 2 for a, b in zip(known, known[1:]))]
                  if MIN_SAMPLED_SIZE <= v <= size and v not in known), None)
        if v is None:
            break
        values.append(v)
    return (tuple(differing), tuple(values)) if values else None


def _short_sizes(size: int) -> list[int]:
    """A quarter, an eighth and three sixteenths of ``size``: where memory is measured for a fit (each timed from
    one run too: memory_sizes_to_sample with ``steps``, memory_sizes_ahead)."""
    return [size // 4, size // 8, size * 3 // 16]


def memory_sizes_ahead(samples: Sequence[ShapeSample], bindings: dict) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """At a family's first shape, captured with the sizes the caller said vary symbolic (marked dynamic, a padded
    attention mask, ``dynamic=True``), the sizes to measure memory at now (memory_sizes_to_sample's three
    shortest, each at least MIN_SAMPLED_SIZE): with the shape measured, the four shapes a memory fit over one
    varying size needs, so that the next shapes' memory is fitted with no run of the model (their times from the
    training steps' and the shapes measured, these timed once each by the caller).
    (the symbols, all of one value: export may give one length several;
    the values), or None where the symbols are of different values (two sizes vary: the second shape chooses), the
    samples have no memory trace (CUDA) or are not this shape's alone."""
    target = {str(k): int(v) for k, v in bindings.items()}
    if not target or len(set(target.values())) != 1 or len(samples) != 1 or dict(samples[0].bindings) != target:
        return None
    if samples[0].profile is None or samples[0].profile.memory_trace is None:
        return None
    size = next(iter(target.values()))
    values = tuple(dict.fromkeys(v for v in _short_sizes(size) if MIN_SAMPLED_SIZE <= v < size))
    return (tuple(sorted(target)), values) if values else None


def chain_pattern(signatures: Sequence[str]) -> tuple[int, ...]:
    """Per stage, the index of the first stage with its signature: equal for chains of one structure."""
    first: dict[str, int] = {}
    return tuple(first.setdefault(sig, i) for i, sig in enumerate(signatures))


class ShapeFit:
    """Fitted times at one shape (``bindings``) from samples measured at others (module docstring)."""

    def __init__(self, samples: Sequence[ShapeSample], bindings: dict, varying: tuple[str, ...],
                 node_samples: Sequence[ShapeSample] = ()):
        self.samples = tuple(samples)
        #: shapes where block graphs alone were measured (ShapeSample.nodes_only): node times and speeds fitted from
        self.node_samples = tuple(node_samples)
        #: memory is fitted from the shapes profiled (their memory traces)
        self.memory_samples = tuple(s for s in self.samples if not s.from_steps)
        #: the stage times from the shapes timed: each one's steps where it has them, else its profile
        stepped = {s.bindings: s for s in self.samples if s.from_steps}
        self.timed = tuple(s for s in self.memory_samples if s.times_measured and s.bindings not in stepped) + tuple(
            stepped.values())
        #: node times and generated code's speeds from the shapes profiled with their times
        self.profiled = tuple(s for s in self.memory_samples if s.times_measured)
        self.bindings = {str(k): int(v) for k, v in bindings.items()}
        self.varying = varying
        self._scale = scale = {v: max(dict(s.bindings)[v] for s in self.samples) for v in varying}
        self._rows = self._rows_of(self.memory_samples, scale)
        self._time_rows = self._rows_of(self.timed, scale)
        self._target = np.array(self._features(self.bindings, scale))
        monomials = len(self._target)
        #: the monomials the stage times are fitted over: all where the shapes timed are as many, else (one
        #: varying size, ShapeFit.of ``reduced``) the tokens alone from one shape (each time scaled by their ratio),
        #: a line in them from two at least SPACING apart; two nearer each other give the tokens alone too (least
        #: squares through both: a line through 512 and 431 tokens, each timed from a few noisy steps, put 308
        #: tokens' step at 1.58x the measured, extrapolating its slope's error)
        tokens = self._time_rows[:, 1] if len(self.timed) else np.ones(1)
        spread = float(tokens.max() / tokens.min()) >= SPACING
        self.time_columns = tuple(range(monomials)) if len(self.timed) >= monomials else \
            ((0, 1) if len(self.timed) == 2 and spread else (1,))
        self.unfitted_memory: frozenset[int] | None = None  # set by profile(): stages whose memory is measured
        #: whether memory may be fitted here (ShapeFit.of: one shape more than the monomials, to check a fit
        #: is exact, and the target near the shapes measured); else profile() leaves it measured
        self.memory_fits = True
        #: whether a size of the target is beyond EXTRAPOLATION of the shapes timed (ShapeFit.of: where the training
        #: steps time the family and the memory is to be fitted): its stage times then scaled from the nearest
        #: shape timed (_extrapolation_bounds' ``far``), not the fit's value
        self.beyond_timed = False
        self._least_block: dict[int, float | None] = {}  # least_block_time by the first stage of each structure

    def _rows_of(self, samples: Sequence[ShapeSample], scale: dict) -> np.ndarray:
        return np.array([self._features(dict(s.bindings), scale) for s in samples]).reshape(
            len(samples), len(self.varying) + 2)

    def _node_sources(self, stage: int) -> tuple[tuple[ShapeSample, ...], np.ndarray] | None:
        """The shapes stage ``stage``'s node times and generated code's speeds are fitted from, and their rows: those
        profiled with their times, and those whose block graphs alone were measured (``node_samples``), where each
        measured the stage's menu (a shape measured before block options were built has none there: hierremat.remat's
        ``defer_block_options``); None where they do not determine every monomial (the training steps time whole
        stages, not nodes)."""
        sources = tuple(s for s in (*self.profiled, *self.node_samples)
                        if s.node_times[stage] is not None and s.speeds[stage] is not None)
        rows = self._rows_of(sources, self._scale)
        if len(rows) < rows.shape[1] or np.linalg.matrix_rank(rows) < rows.shape[1]:
            return None
        return sources, rows

    @property
    def reduced(self) -> bool:
        """Whether the times are fitted over fewer monomials than the model's (from fewer shapes timed), at a shape
        not timed itself (one that is, its fit through its own times, gets them)."""
        timed = {tuple(sorted(dict(s.bindings).items())) for s in self.timed}
        return len(self.time_columns) < len(self._target) and tuple(sorted(self.bindings.items())) not in timed

    @classmethod
    def of(cls, samples: Sequence[ShapeSample], bindings: dict, pattern: tuple[int, ...],
           reduced: bool = False) -> "ShapeFit | None":
        """A fit at ``bindings`` where enough samples of the same chain structure (``pattern``) span
        it: as many as the monomials (memory: one more, and nearer, ``memory_fits``), every size that
        differs from theirs varied among them, within EXTRAPOLATION of them; else None (the shape is
        measured). reduced: with one varying size, times are fitted from fewer shapes timed, down to one
        (``time_columns``): a family whose times the training steps add to (hierremat.runtime.step_times), where the
        shorter lengths measured for its memory fits (timed once each) are not there to make the monomials' count (a
        capture that takes no shorter length), so that a length is planned without a shape profiled for times apart
        from the training; and, where
        the memory is to be fitted at ``bindings`` (``memory_fits``: a figure that then fits no polynomial is still
        measured), times fitted beyond EXTRAPOLATION of the shapes timed (``beyond_timed``)."""
        samples = [s for s in samples if s.pattern == pattern and s.bindings]
        node_samples = [s for s in samples if s.nodes_only]
        samples = [s for s in samples if not s.nodes_only]
        if not samples:
            return None
        target = {str(k): int(v) for k, v in bindings.items()}
        node_samples = [s for s in node_samples if set(dict(s.bindings)) == set(target)]
        values = [dict(s.bindings) for s in samples]
        if any(set(v) != set(target) for v in values):
            return None
        changing = sorted(k for k in target if len({v[k] for v in values}) > 1)
        if any(target[k] != values[0][k] for k in target if k not in changing):
            return None  # a size that never varied: nothing to fit it from
        # sizes equal at every measured shape are one size (export may give a sequence length two symbols)
        groups: dict[tuple, list[str]] = {}
        for k in changing:
            groups.setdefault(tuple(v[k] for v in values), []).append(k)
        if any(len({target[k] for k in members}) > 1 for members in groups.values()):
            return None
        varying = tuple(members[0] for members in groups.values())
        timed = [dict(b) for b in {s.bindings for s in samples if s.times_measured}]
        monomials = len(varying) + 2
        if not varying or len(timed) < (1 if reduced and len(varying) == 1 else monomials):
            return None

        def within(shapes: list[dict], factor: float) -> bool:
            return all(min(v[k] for v in shapes) / factor <= target[k] <= max(v[k] for v in shapes) * factor
                       for k in varying)

        fit = cls(samples, target, varying, node_samples)
        if np.linalg.matrix_rank(fit._time_rows[:, fit.time_columns]) < len(fit.time_columns):
            return None  # the timed shapes do not determine every coefficient (repeated sizes)
        memory = [dict(s.bindings) for s in fit.memory_samples]
        fit.memory_fits = (
            len({s.bindings for s in fit.memory_samples}) > monomials and np.linalg.matrix_rank(fit._rows) == monomials
            and within(memory, MEMORY_EXTRAPOLATION)
        )
        fit.beyond_timed = not within(timed, EXTRAPOLATION)
        if fit.beyond_timed and not (reduced and fit.memory_fits):
            return None  # far outside: measured (a sample more); but where the training steps time the family and
            # its memory is to be fitted here, its times are fitted however far (_extrapolation_bounds' ``far``): a
            # time only steers the plan, solved again from this shape's own steps after TIMED_STEPS of them, where
            # measuring it took a run of every stage (105 tokens, below half of every length timed: 0.4-0.6 s)
        return fit

    def _features(self, bindings: dict, scale: dict) -> list[float]:
        sizes = [bindings[v] / scale[v] for v in self.varying]
        n = math.prod(sizes)
        return [1.0, n, *(n * size for size in sizes)]

    def _predict(self, values: list[list[float]], times: bool = True, rows: np.ndarray | None = None) -> list[float]:
        """Each column of ``values`` (one row per timed sample; per shape of ``rows``, :meth:`_node_sources`'s, where
        given: fitted over every monomial) fitted and evaluated at the target, >= 0. The residuals are weighed relative to the values (a 1 ms node
        and a 100 ms stage both fitted to a share of themselves). ``times``: the columns are times, each a fixed
        cost, a term linear in the tokens and the quadratic terms (module docstring), none of them below 0: fitted
        by non-negative least squares (Lawson and Hanson 1974, "Solving Least Squares Problems", ch. 23;
        scipy.optimize.nnls), so that noise in a few steps cannot bend the fit below or above the sizes measured
        (a fixed cost below 0, a quadratic term that turns the fit down or up outside them), and bounded outside the
        sizes measured (:meth:`_extrapolation_bounds`). Over synthetic times of that form with 12% noise, 3 to 8 of
        bench_shapes.py's 12 lengths timed, 72% of the others are fitted within 10% of the truth, against 63%
        unconstrained (bounded: 63%), the 5th-95th percentile 0.84-1.23 of it, against 0.69-1.34
        (tests/test_shapes.py, ..._non_negative_miss_less_under_timing_noise)."""
        profiled = rows is not None
        rows = rows if profiled else self._time_rows
        columns = list(range(len(self._target))) if profiled else list(self.time_columns)
        values = np.array(values, dtype=float)
        nearest = self._nearest_outside(rows) if times else None
        # (beyond the shapes timed, stage times alone are scaled from the nearest: a node's fixed cost, its kernel's
        # overhead, is real where a stage's fitted through a few steps is noise)
        scaled_far = self.beyond_timed and not profiled
        out = []
        for column in values.T:
            weights = 1.0 / np.maximum(np.abs(column), max(float(np.abs(column).max()) * 1e-6, 1e-12))
            coefficients = np.zeros(len(self._target))
            coefficients[columns] = _least_squares(rows[:, columns] * weights[:, None], column * weights,
                                                   non_negative=times)
            fitted = float(self._target @ coefficients)
            if times:
                low, high, far = self._extrapolation_bounds(column, coefficients, rows, nearest)
                fitted = far if scaled_far and far is not None else min(max(fitted, low), high)
            out.append(max(0.0, fitted))
        return out

    def _extrapolation_bounds(self, column: np.ndarray, coefficients: np.ndarray, rows: np.ndarray,
                              nearest_outside: tuple[int, np.ndarray] | None) -> tuple[float, float, float | None]:
        """(lowest, highest, far) seconds a time may be fitted to at the target, from the measured time ``column``
        (at the shapes ``rows``; ``nearest_outside``: :meth:`_nearest_outside` of them): unbounded where every
        varying size is inside the sizes measured; outside, a time that is a sum of a fixed cost, a linear term in
        the tokens n and the quadratic terms n * v (module docstring), each at least 0, measured t at the sample
        nearest the target (in the logs of those monomials), r_n the tokens' ratio and r_v each quadratic term's
        (target over sample):

            t * ((1 - q) * min(1, r_n) + q * min_v r_v) <= fitted <= t * max(1, r_n, max_v r_v),

        q the fitted quadratic terms' share of t at that sample (in [0, 1]): a fixed cost does not shrink and a
        linear term shrinks by r_n, the quadratic terms by r_v; nothing grows by more than its own ratio. With the
        sequence length alone varying (r_v = r_n^2 = r^2): below the samples r * t * (1 - q + q * r) to t, above
        them t * (1 - q + q * r^2) to r^2 * t.

        A least-squares quadratic through noisy samples may otherwise bend a few tokens outside them, to a
        step predicted at 5% of the measured at a length half the shortest measured (bench_shapes, 4-layer
        GPT-2 at 64 tokens fitted from 128 up).

        The third figure: where the target's tokens are more than EXTRAPOLATION from that sample's, the time there
        scaled term by term as if it had no fixed cost, t * ((1 - q) * r_n + q * r_v) (the smallest r_v below the
        sample: the lowest bound; the largest above), else None; used for the stage times of a target beyond
        EXTRAPOLATION of the shapes timed (``beyond_timed``: a family timed in its training steps fits its times
        however far where its memory is to be fitted, ShapeFit.of), in place of the fit: a fixed cost the fit gives
        a few close lengths is their timing noise as often as not, and far below them it is the whole time (the
        4-layer GPT-2's 105 and 64 tokens, fitted from 268 tokens up, were predicted at 2.1-2.2x their steps; a step
        at 64 tokens took 0.074 of one at 512, the tokens 0.125)."""
        if nearest_outside is None:
            return -math.inf, math.inf, None
        nearest, ratios = nearest_outside
        measured = float(column[nearest])
        quadratic = float(rows[nearest, 2:] @ coefficients[2:])
        share = min(max(quadratic / measured, 0.0), 1.0) if measured > 0 else 0.0
        tokens, least, most = float(ratios[0]), float(ratios[1:].min()), float(ratios[1:].max())

        def scaled(linear_ratio: float, quadratic_ratio: float) -> float:  # (t, its two shares scaled apart)
            return measured * ((1 - share) * linear_ratio + share * quadratic_ratio)

        far = None
        if not 1 / EXTRAPOLATION <= tokens <= EXTRAPOLATION:
            far = scaled(tokens, least if tokens < 1 else most)
        return scaled(min(1.0, tokens), least), measured * max(1.0, float(ratios.max())), far

    def _nearest_outside(self, rows: np.ndarray) -> tuple[int, np.ndarray] | None:
        """For a target outside the sizes measured (``rows``: the shapes' monomials), (the sample nearest it, in
        the logs of the monomials n and n * v; the target's monomials over that sample's): what
        :meth:`_extrapolation_bounds` bounds every column from. None where every varying size is inside the sizes
        measured."""
        target = self._target
        sizes, wanted = rows[:, 2:] / rows[:, 1:2], target[2:] / target[1]  # each varying size (n * v / n)
        if ((sizes.min(axis=0) <= wanted) & (wanted <= sizes.max(axis=0))).all():
            return None
        nearest = int(np.argmin(np.abs(np.log(target[1:] / rows[:, 1:])).sum(axis=1)))
        return nearest, target[1:] / rows[nearest, 1:]

    def stage_costs(self, costs: ChainCosts) -> ChainCosts:
        """``costs`` (measured for memory) with each stage's autograd times fitted, from the steps' times where a
        shape has them, else from its profile's scaled by :attr:`step_ratios` (as the steps would run it: a shape
        measured whose steps are not recorded yet, among shapes timed in their steps)."""
        fitted = self._predict([[t for st in self._as_steps(s) for t in st] for s in self.timed])
        return costs.with_autograd_times([tuple(fitted[3 * i: 3 * i + 3]) for i in range(len(costs.stages))])

    @functools.cached_property
    def step_ratios(self) -> tuple[float, float, float] | None:
        """How much slower the training steps run option 0 than the profile did: (no-grad forward, forward,
        backward) ratios of the steps' seconds over the profile's at the shapes that have both (a shape measured,
        then timed in its steps), one per kind of time, the median over their stages (hierremat.plans.costs.
        step_time_ratios). None where no shape was measured and then timed in its steps (RematModule keeps the steps'
        samples of such shapes: add_sample's ``keep``): the times are then taken as they are. A shape measured whose
        steps are not recorded yet is fitted from its profile's times times these (:meth:`stage_costs`).

        :meth:`stage_costs` fits option 0 from the steps where a shape has them, while block options are priced from
        node times and generated code's speeds profiled apart (:meth:`node_costs`, :meth:`speeds`, or measured at
        the shape): hierremat.api.shape_planning.ProfiledChain prices them against option 0 as the profile would
        have timed it (these ratios undone) and scales the whole chain to the steps (ChainCosts.with_times_scaled),
        as a plan solved again from its own steps is (ChainCosts.with_step_times: on the 2-layer test model the
        steps ran option 0 about 1.4x its profile, and block options built at a fitted length looked that much
        cheaper against it)."""
        stepped = {s.bindings: s for s in self.samples if s.from_steps}
        both = [(stepped[s.bindings], s) for s in self.profiled if s.bindings in stepped]
        if not both:
            return None
        return step_time_ratios([t for steps, _ in both for t in steps.stage_times],
                                [t for _, profile in both for t in profile.stage_times])

    def _as_steps(self, sample: ShapeSample) -> tuple[tuple[float, float, float], ...]:
        """``sample``'s stage times as the training steps run them: as they are where no shape has both
        (:attr:`step_ratios` None); else a profile's times the ratios, and so a steps' sample's stages that the steps
        did not time (plans.costs.timed_in_steps: a block option ran them, their times the plan's, the profile's at
        a shape profiled)."""
        ratios = self.step_ratios
        if ratios is None:
            return sample.stage_times

        def scaled(times: tuple[float, float, float]) -> tuple[float, float, float]:
            return tuple(t * r for t, r in zip(times, ratios))

        if not sample.from_steps:
            return tuple(scaled(times) for times in sample.stage_times)
        profile = next((s for s in self.profiled if s.bindings == sample.bindings), None)
        if profile is None:
            return sample.stage_times
        return tuple(times if timed_in_steps(times, twin) else scaled(times)
                     for times, twin in zip(sample.stage_times, profile.stage_times))

    def profile(self) -> tuple[ChainProfile, frozenset[int]] | None:
        """This shape's chain profile with every byte count that fits exactly (module docstring; its times
        are the last sample's, for :meth:`stage_costs` to fit), and the stages whose memory does not (to
        measure: their figures in the profile are the last sample's); None where the chain's own sizes do
        not fit or a sample has no memory trace or another structure (which storages a stage's tape keeps,
        its weight casts, its buffer updates): then every stage is measured. Memory is fitted from the shapes
        profiled (``memory_samples``), not those timed in the training steps alone."""
        samples = self.memory_samples
        if not self.memory_fits or not samples or any(s.profile is None for s in samples):
            return None
        template = samples[-1].profile
        traces = [s.profile.memory_trace for s in samples]
        if any(t is None for t in traces) or any(_structure(s.profile) != _structure(template) for s in samples):
            return None
        keys = [key for key, _ in traces[0].figures]
        if any([key for key, _ in t.figures] != keys for t in traces[1:]):
            return None
        values, unfitted = template.memory_trace.values(), set()
        for k, key in enumerate(keys):
            if is_scratch(key):  # (not a sum of storages: the largest measured)
                values[key] = max(max(t.figures[k][1]) for t in traces)
                continue
            figure = self._exact_figure([t.figures[k][1] for t in traces])
            if figure is None:
                if not key.startswith("stage"):
                    log.debug("memory not fitted: %s is not a polynomial in %s", key, ", ".join(self.varying))
                    return None
                unfitted.add(int(key[len("stage"):key.index(".")]))
            else:
                values[key] = figure
        costs, loss_bytes = with_memory(template.costs, values)
        self.unfitted_memory = frozenset(unfitted)
        return replace(template, costs=costs, loss_bytes=loss_bytes, memory_trace=None), frozenset(unfitted)

    def _exact_figure(self, candidates: list[tuple[int, ...]]) -> int | None:
        """A figure at the target from its candidates at each sample: the largest of the candidates whose
        fit reproduces every sample to the byte, where the others (sizes that depend on the data, such as an
        embedding gradient's distinct rows), raised by their largest miss, stay below it at the target. Where
        at some sample the others rose above the exact ones, by at most DATA_TOLERANCE of them at every
        sample, the figure is raised by DATA_TOLERANCE too. Else None (a figure the data decides: measured)."""
        rows = self._rows
        counts = Counter(len(c) for c in candidates)
        if len(counts) > 1:
            # Allocations differ in number. A shape exported on its own (the first) allocates otherwise than
            # those specialized from the symbolic capture (the target's kind), as can a loop over chunks whose
            # count depends on the size: fit from the samples that allocate as most do, where they suffice
            # (one more than the monomials, as for any memory fit).
            (count, most), (_, second) = counts.most_common(2)
            keep = [i for i, c in enumerate(candidates) if len(c) == count]
            if most == second or most <= rows.shape[1] or np.linalg.matrix_rank(rows[keep]) < rows.shape[1]:
                return None
            rows, candidates = rows[keep], [candidates[i] for i in keep]
        measured = np.array(candidates, dtype=float)
        coefficients, *_ = np.linalg.lstsq(rows, measured, rcond=None)
        misses = np.abs(rows @ coefficients - measured).max(axis=0)
        exact = misses <= 0.5
        if not exact.any():
            return None
        exact_top, top = measured[:, exact].max(axis=1), measured.max(axis=1)
        if (top > exact_top * (1 + DATA_TOLERANCE)).any():
            return None
        at_target = self._target @ coefficients
        figure = float(np.rint(at_target[exact].max()))
        if (top > exact_top).any():  # the data rose above the exact candidates, within DATA_TOLERANCE
            figure = float(np.ceil(figure * (1 + DATA_TOLERANCE)))
        if (~exact).any() and (at_target[~exact] + misses[~exact]).max() > figure:
            return None
        return int(figure) if figure >= 0 else None

    def node_costs(self, stage: int, joint) -> dict | None:
        """Fitted (seconds, workspace 0) of every node of stage ``stage``'s block graph, by name; None
        where the shapes measured with its menu (:meth:`_node_sources`) are too few or have other node names than
        ``joint`` (then they are measured; ``joint`` None: the samples' names taken as they are)."""
        sources = self._node_sources(stage)
        if sources is None:
            return None
        per_sample = [s.node_times[stage] for s in sources[0]]
        names = {n.name for n in joint.compute_nodes()} if joint is not None else set(per_sample[0])
        if any(not set(t) <= names for t in per_sample):
            return None
        keys = sorted(per_sample[0])
        if any(sorted(t) != keys for t in per_sample):
            return None
        fitted = self._predict([[t[k] for k in keys] for t in per_sample], rows=sources[1])
        return {k: (seconds, 0) for k, seconds in zip(keys, fitted)}

    def had_menu(self, stage: int) -> bool:
        """Whether stage ``stage`` had block options at enough of the shapes measured to fit their times from
        (:meth:`_node_sources`)."""
        return self._node_sources(stage) is not None

    def least_block_time(self, stage: int) -> float | None:
        """A lower bound (seconds) on one forward and backward of stage ``stage`` under any of its block options
        at this shape, without tracing it here: the fastest option of the last measured shape's menu (the options
        re-costed at a new shape are those, hierremat.ilp.options.recost_options), each priced as the menus price
        it (hierremat.planning.menus: its nodes' times summed, times its generated code's speed scale), with
        every node's time and the scale fitted, and as the training steps run the stage where they time it
        (:attr:`step_ratios`: the lesser of the forward's and the backward's). None where a measured shape had no
        menu or speeds there."""
        first = self.samples[-1].pattern[stage]  # (stages of one structure: one bound)
        if first not in self._least_block:
            self._least_block[first] = self._least_block_time(first)
        least, ratios = self._least_block[first], self.step_ratios
        return least if least is None or ratios is None else least * min(ratios[1:])  # (a bound: the lesser)

    def _least_block_time(self, stage: int) -> float | None:
        sources = self._node_sources(stage)
        last = sources[0][-1] if sources is not None else None
        options = last.option_nodes[stage] if last is not None and last.option_nodes else None
        speeds = self.speeds(stage)
        node_times = self.node_costs(stage, None)
        if options is None or speeds is None or node_times is None or any(
                name not in node_times for names in options for name in names):
            return None
        return speeds.scale * min(sum(node_times[name][0] for name in names) for names in options)

    def speeds(self, stage: int) -> ExecutorSpeeds | None:
        """The fitted speeds of stage ``stage``'s generated code (None where a sample has none, or the shapes
        profiled with their times are too few)."""
        sources = self._node_sources(stage)
        if sources is None:
            return None
        per_sample = [s.speeds[stage] for s in sources[0]]
        (scale,) = self._predict([[p[0]] for p in per_sample], times=False, rows=sources[1])  # (a ratio of times)
        (forward,) = self._predict([[p[1]] for p in per_sample], rows=sources[1])
        return ExecutorSpeeds(scale if scale > 0 else min(p[0] for p in per_sample), forward)

    def describe(self) -> str:
        """What was fitted from which shapes, for summaries."""
        stepped = {s.bindings for s in self.timed if s.from_steps}

        def shape(sample: ShapeSample) -> str:
            sizes = ", ".join(f"{k}={v}" for k, v in sample.bindings if k in self.varying)
            one_run = sample.profile is not None and getattr(sample.profile, "repeats", PROFILE_REPEATS) == 1
            memory_only = "memory only" if not sample.times_measured else ""
            if sample.bindings in stepped:
                return f"{sizes} ({memory_only + ', ' if memory_only else ''}timed in the training steps)"
            return sizes + (f" ({memory_only})" if memory_only else " (one timed run)" if one_run else "")

        profiled = {s.bindings for s in self.memory_samples}
        shapes = "; ".join(shape(s) for s in (*self.memory_samples,
                                               *(s for s in self.timed if s.from_steps and s.bindings not in profiled)))
        unfitted = self.unfitted_memory
        what = "times" if unfitted is None else "times and memory"
        memory_only = len(self.memory_samples) - len(self.profiled)
        from_steps = sum(s.from_steps for s in self.timed)
        how = {1: " scaled by the tokens", 2: " a line in the tokens"}.get(len(self.time_columns), "") \
            if self.reduced else ""
        count = len(self.timed)
        shapes_timed = f"{count} shape{'s' if count > 1 else ''} timed"
        line = (f"{what} fitted over {', '.join(self.varying)}: times{how} from {shapes_timed}"
                + (f" ({from_steps} in the training steps)" if from_steps else "")
                + (f", memory from {len(self.memory_samples)} shapes" + (
                    f" ({memory_only} with memory only)" if memory_only else "") if unfitted is not None else "")
                + f" ({shapes})")
        if self.step_ratios is not None:  # (what the profile's times, block options' among them, were scaled by)
            line += (f"; profiled times x{self.step_ratios[1]:.2f} forward, x{self.step_ratios[2]:.2f} backward, as "
                     "the training steps ran them")
        if unfitted is None:
            return f"{line}; memory measured at this shape"
        if unfitted:
            return f"{line}; the memory of stage(s) {', '.join(map(str, sorted(unfitted)))} measured at this shape"
        return line


def _least_squares(rows: np.ndarray, values: np.ndarray, non_negative: bool) -> np.ndarray:
    """The coefficients x minimizing ||rows x - values||, each >= 0 where ``non_negative`` (scipy.optimize.nnls;
    where it does not converge, the unconstrained fit)."""
    if non_negative:
        try:
            return nnls(rows, values)[0]
        except RuntimeError:  # (its iteration limit: never met on these few rows and columns)
            pass
    return np.linalg.lstsq(rows, values, rcond=None)[0]


def _structure(profile: ChainProfile) -> tuple:
    """What a profile holds besides sizes and times: equal at every shape a memory fit spans."""
    stages = tuple(
        (st.name, st.weight_cast_bytes, st.options[0].pins_input, st.options[0].pins_output)
        for st in profile.costs.stages
    )
    return stages, profile.mutated_buffers, profile.output_grad_mask, profile.costs.input_requires_grad
