"""Shorter lengths a RematModule measures to fit new shapes' costs from (hierremat.planning.shape_fit): cut from
the inputs it is called with, measured for times and memory, for memory alone, or for memory and times from one run.
"""

from __future__ import annotations

import logging
import time

from torch import nn

from ..blocks.eager_masks import padding_key
from ..blocks.sources import clear_fake_tensor_cache, forget_sources, recorded_sources
from ..blocks.symbolic import SymbolicCapture
from ..device.memory import profiler_active
from ..planning.shape_fit import (
    ShapeSample, add_sample, memory_sizes_ahead, memory_sizes_to_sample, sizes_to_sample,
)
from .block_building import BlockBuilding
from .shape_families import family_key
from .shape_planning import PlanSettings, sample_at
from .step_retiming import StepRetimer

log = logging.getLogger(__name__)


class LengthSampler:
    """Measures ``model`` at shorter lengths for a RematModule; ``building`` and ``retimer`` are the module's."""

    def __init__(self, model: nn.Module, building: BlockBuilding, retimer: StepRetimer):
        self.model = model
        self.building = building
        self.retimer = retimer

    def sample_shorter_lengths(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                               settings: PlanSettings, from_steps: bool = False) -> None:
        """At a family's second shape (while its measured shapes cannot fit a new one's times), measure the
        model also at shorter lengths cut from these inputs (sizes_to_sample), so that this shape or the shapes after
        it are fitted rather than each measured (``from_steps``: not, the training steps time the shapes); then,
        while the shapes whose memory was measured are too few to check a memory fit, its memory alone at shorter
        lengths still (memory_sizes_to_sample; where the training steps time the shapes, with one timed run each)."""
        bindings = symbolic.bindings(args, kwargs)
        if not bindings:
            return
        to_time = sizes_to_sample(samples, bindings) if not from_steps else None
        self._sample_at_lengths(symbolic, args, kwargs, samples, settings, to_time, timed=True)
        steps = self.retimer.step_samples_of(family_key(args, kwargs)) if from_steps else None
        wanted = memory_sizes_to_sample(samples, bindings, steps)
        self._sample_at_lengths(symbolic, args, kwargs, samples, settings, wanted, timed=False, one_run=from_steps)

    def sample_memory_ahead(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                            settings: PlanSettings) -> None:
        """At a family's first shape, captured symbolically because its sizes were said to vary: measure its
        memory at shorter lengths cut from these inputs now (memory_sizes_ahead), so that the shapes after it are
        planned from fits alone, none measured (the cost of a second shape, paid at the first where the caller said
        shapes will vary; each timed from one run: the family's times are fitted from its training steps)."""
        wanted = memory_sizes_ahead(samples, symbolic.bindings(args, kwargs) or {})
        self._sample_at_lengths(symbolic, args, kwargs, samples, settings, wanted, timed=False, one_run=True)

    def _sample_at_lengths(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                           settings: PlanSettings, wanted: tuple[tuple[str, ...], tuple[int, ...]] | None,
                           timed: bool, one_run: bool = False) -> None:
        """_sample_at_length at each of ``wanted``'s values (its sizes, its values; None: none)."""
        for value in wanted[1] if wanted is not None else ():
            self._sample_at_length(symbolic, args, kwargs, samples, settings, wanted[0], value, timed, one_run)

    def _sample_at_length(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                          settings: PlanSettings, names: tuple[str, ...], value: int, timed: bool,
                          one_run: bool) -> None:
        """Measure the model at the inputs cut to ``value`` along ``names`` (``timed`` False: its memory alone;
        ``one_run``: and its times from one timed run each, no block menu) and add the sample to ``samples``; a
        length the model or its symbolic capture cannot take is skipped (logged). With block options built once
        they pay, a sample measures their node times none while none is built, and, while those built were built
        only because the cache had them (``building.pay`` False), only where this cache has their menus at its sizes
        (a run whose cache an earlier one filled would otherwise trace and profile the blocks at two lengths for
        nothing but fits). Once they were built because they pay or the budget needs them, a sample builds them."""
        name, model_name = "=".join(names), type(self.model).__name__
        started = time.perf_counter()
        narrowed = self.narrowed(symbolic, args, kwargs, names, value)
        sources: list[str] = []
        try:
            with recorded_sources() as sources:
                sample = sample_at(self.model, *narrowed, settings, symbolic, timed=timed, one_run=one_run,
                                   blocks=timed and not self.building.deferring(settings) and not profiler_active(),
                                   cached_blocks=settings.defer_block_options and not self.building.pay,
                                   ) if narrowed else None
        except Exception as err:  # noqa: BLE001 - a length the model rejects: not a sample, nothing else
            log.info("%s not measured at %s=%d (%s: %s)", model_name, name, value,
                     type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            return
        finally:
            forget_sources(sources)
            clear_fake_tensor_cache()
        if sample is None:
            log.info("%s not measured at %s=%d (its symbolic capture does not take it)", model_name, name, value)
            return
        add_sample(samples, sample)
        log.info("%s measured at %s=%d in %.2f s (%s), to fit shapes from", model_name, name, value,
                 time.perf_counter() - started,
                 "times and memory" if timed else "memory, and times from one run" if one_run else "memory alone")

    def narrowed(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, names: tuple[str, ...],
                 value: int) -> tuple[tuple, dict] | None:
        """The inputs cut to ``value`` along the sizes ``names``: each row's first entries, or its last
        where only those keep which padding masks are all ones as the call has them (right-padded rows cut
        to a prefix lose their padding, and a model may run a mask of all ones otherwise)."""
        wanted = padding_key(self.model, args, kwargs)
        cut = symbolic.narrowed(args, kwargs, names, value)
        if cut is not None and padding_key(self.model, *cut) != wanted:
            suffix = symbolic.narrowed(args, kwargs, names, value, last=True)
            if suffix is not None and padding_key(self.model, *suffix) == wanted:
                return suffix
        return cut
