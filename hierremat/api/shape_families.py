"""What a RematModule keeps per family of input shapes beside their plans: a family is one call signature (the
inputs' structure, dtypes, devices, ranks, non-tensor values and autocast setting), whatever the sizes.

Each family has at most one symbolic capture (hierremat.blocks.symbolic), made when a second shape comes or at the
first where its sizes are said to vary; the size-generic graphs its specialized shapes run (hierremat.blocks.generic),
with their block options' programs (hierremat.planning.family_programs); and the samples its costs are fitted from
(hierremat.planning.shape_fit: shapes profiled, and shapes timed in the training steps).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..blocks.generic import MAX_GENERIC_CHAINS, GenericChain
from ..blocks.segment import CHAIN_ATTRIBUTE
from ..blocks.sources import forget_sources, source_keys
from ..blocks.symbolic import SymbolicCapture, capture_symbolic, every_dim, marked_dims, padded_dims, varying_dims
from ..device.autocast import AutocastState
from ..planning.family_programs import FamilyPrograms
from ..planning.shape_fit import ShapeSample, add_sample
from .planned_shape import ChainDispatch, PlannedShape
from .shape_planning import device_types

log = logging.getLogger(__name__)


def input_shapes(inputs: tuple) -> tuple:
    """The shapes of the tensors among ``inputs`` (``(args, kwargs)``, tensors or meta skeletons)."""
    return tuple(tuple(v.shape) for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor))


def family_key(args: tuple, kwargs: dict) -> tuple:
    """What one symbolic capture serves (hierremat.blocks.symbolic): the inputs' structure, dtypes,
    devices, ranks and non-tensor values, and the autocast setting; not their sizes."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(device_types(args, kwargs)).key()
    return (str(spec), autocast) + tuple(
        (v.dim(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


class ShapeFamilies:
    """Per family of input shapes (family_key): its symbolic capture, the dimensions made symbolic, its size-generic
    graphs and their programs, and its samples; forgotten with the family's last plan (``forget``), but which
    first-shape captures failed (a few dimensions each, so that a failed export is not tried again).

    ``dynamic`` and ``on_new_shape`` are remat's: whether sizes are all symbolic (True), never (False) or as the
    shapes show (None), and whether a new shape is planned at all."""

    def __init__(self, model: nn.Module, dynamic: bool | None, on_new_shape: str):
        self.model = model
        self.dynamic = dynamic
        self.on_new_shape = on_new_shape
        self.symbolic: dict[tuple, SymbolicCapture | None] = {}  # None: export each shape
        self.symbolic_dims: dict[tuple, frozenset] = {}  # the dimensions its capture made symbolic
        #: the size-generic graphs its shapes specialized from its symbolic capture run (share_graphs; one per program
        #: among them); None: its graphs could not be made size-generic
        self.generic: dict[tuple, list[GenericChain] | None] = {}
        #: per size-generic chain: its stages' joint graphs traced once with symbolic sizes and the block options'
        #: programs generated from them (hierremat.planning.family_programs), dropped with it
        self.programs: weakref.WeakKeyDictionary[GenericChain, FamilyPrograms] = weakref.WeakKeyDictionary()
        self.first_capture_failed: dict[tuple, frozenset] = {}  # the dimensions a first shape's capture tried
        self.samples: dict[tuple, list[ShapeSample]] = {}  # times and memory measured at its shapes
        #: for a family whose times the training steps give (StepRetimer.times_from_steps): the shapes timed there
        self.step_samples: dict[tuple, list[ShapeSample]] = {}
        #: block graphs' node times and speeds measured at shapes whose times were fitted (ShapeSample.nodes_only)
        self.node_samples: dict[tuple, list[ShapeSample]] = {}

    @property
    def _name(self) -> str:
        return type(self.model).__name__

    def _per_family(self) -> tuple[dict, ...]:
        return self.symbolic, self.symbolic_dims, self.generic, self.samples, self.step_samples, self.node_samples

    def kept(self) -> set[tuple]:
        """The families something is kept for."""
        return {family for kept in self._per_family() for family in kept}

    def forget(self, family: tuple) -> None:
        """Forget what a family kept (its last plan dropped): its symbolic capture, its size-generic graphs (and their
        sources), its samples. Called again, its first shape is a first shape again (where its capture there failed
        before, it is not tried again)."""
        self.drop_generic(family)
        for kept in self._per_family():
            kept.pop(family, None)

    def clear(self) -> None:
        """Forget every family, the failed first-shape captures too (the model moved to another device)."""
        for family in self.kept():
            self.forget(family)
        self.first_capture_failed.clear()

    def program_sources(self) -> set[str]:
        """The source keys of every family's block option programs (forgotten with the family)."""
        return {key for programs in self.programs.values() for key in source_keys(programs.graph_modules())}

    def programs_for(self, family: tuple, chain, matched: list | None = None) -> FamilyPrograms | None:
        """The joint graphs and programs (hierremat.planning.family_programs) of the family's size-generic chain that
        ``chain`` (specialized from its symbolic capture) runs; None where it runs none yet (share_graphs makes it).
        matched: where given, (chain, the generic chain it runs or None) is appended to it, for share_graphs."""
        try:
            generic = next((g for g in self.generic.get(family) or () if g.holds_for(chain)), None)
        except Exception as err:  # (a graph the check cannot read: as share_graphs, the shape keeps its own)
            log.info("%s's graphs not shared at this shape: %s", self._name, err)
            return None
        if matched is not None:
            matched.append((chain, generic))
        if generic is None:
            return None
        if generic not in self.programs:
            self.programs[generic] = FamilyPrograms(generic.stages)
        return self.programs[generic]

    def drop_generic(self, family: tuple) -> None:
        """Drop the family's size-generic graphs and their block options' programs, forgetting their sources."""
        for generic in self.generic.pop(family, None) or ():
            forget_sources(list(generic.sources))
            programs = self.programs.pop(generic, None)
            if programs is not None:  # (plans that still run them run on: only tracebacks read the sources)
                forget_sources(source_keys(programs.graph_modules()))

    def share_graphs(self, family: tuple, planned: PlannedShape, matched: tuple | None = None) -> None:
        """Run ``planned``, a shape specialized from its family's symbolic capture, from the family's size-generic
        graphs where they are its program (GenericChain.holds_for), made from its own where none is (up to
        MAX_GENERIC_CHAINS): its own graphs are then dropped, and their sources with them (a shape's plan then holds
        its schedule, costs and runner state alone, and where its block options run code traced at its shape, that
        code, bound to the generic stages: ChainMenus.use_stages). matched: (a chain, the generic one it runs or
        None) as programs_for found them while it was planned."""
        generics = self.generic.setdefault(family, [])
        if generics is None:
            return
        made = False  # (whether this shape's graphs are made the generic ones of a program of its own)
        try:
            if matched is not None and matched[0] is planned.chain and (matched[1] is None or matched[1] in generics):
                generic = matched[1]  # (found while it was planned: nothing joined generics since)
            else:
                generic = next((g for g in generics if g.holds_for(planned.chain)), None)
            made = generic is None and len(generics) < MAX_GENERIC_CHAINS
            if made:
                generic = GenericChain.of(planned.chain, ChainDispatch())
        except Exception as err:  # (a graph the check or the copy cannot read: the shape keeps its own graphs)
            log.info("%s's graphs not shared at this shape: %s", self._name, err)
            return
        if generic is None:
            if made:
                log.info("%s's graphs compute a size hierremat cannot compute from their inputs' sizes: shapes of "
                         "this program keep graphs of their own", self._name)
                if not generics:
                    self.generic[family] = None
            return
        if made:
            setattr(planned.chain.orchestrator, CHAIN_ATTRIBUTE, nn.Identity())  # (the reference keeps no plan)
            generics.append(generic)
            log.info("%s's graphs made size-generic: every shape specialized from its symbolic capture to this program "
                     "runs them (%d programs)", self._name, len(generics))
        self._run_generic(planned, generic)

    @staticmethod
    def _run_generic(planned: PlannedShape, generic: GenericChain) -> None:
        own = source_keys([planned.chain.orchestrator,
                           *(getattr(stage, "graph_module", stage) for stage in planned.chain.stages)])
        planned.run_generic(generic)
        menus = planned.chain_module.planned.menus
        generated = menus is not None and menus.runs_code_of_its_own  # (the code generated for block options stays)
        dropped = set(own if generated else planned.sources)
        forget_sources(list(dropped))
        planned.sources = [key for key in planned.sources if key not in dropped]

    def symbolic_capture(self, args: tuple, kwargs: dict, plans: Iterable[PlannedShape],
                         sharded: bool) -> SymbolicCapture | None:
        """The symbolic capture for calls like this one, made when a second shape of them comes (a model called at
        one shape never pays for it), with the sizes that differ between the shapes seen (``plans``' skeletons)
        symbolic (varying_dims); at the first shape already where its inputs say sizes vary (dims_said_to_vary);
        None before that (or while no size differs: a shape planned again), with ``dynamic=False``, under FSDP2
        (``sharded``: export cannot run shards), or where the model has none. A later call that varies another size
        has the model exported again with that one symbolic too, kept where it takes every shape the one before took
        (its samples rebound to it), else the one before stays and this shape is exported on its own; dimensions
        whose capture failed are not tried again."""
        if sharded or self.dynamic is False:
            return None
        family = family_key(args, kwargs)
        earlier = self.symbolic.get(family)
        if family in self.symbolic and (earlier is None or earlier.bindings(args, kwargs) is not None):
            return earlier
        plans = [c for c in plans if c.family == family]
        shapes = [c.skeleton for c in plans]
        if not shapes and family not in self.symbolic:  # the family's first shape (a family whose plans were all
            # dropped is forgotten with them: forget)
            return self._first_shape_capture(family, args, kwargs) if self.on_new_shape == "replan" else None
        dims = varying_dims([*shapes, (args, kwargs)]) | self.symbolic_dims.get(family, frozenset())
        if dims and self.first_capture_failed.get(family) == dims:  # (failed at the first shape with these)
            self.symbolic[family], self.symbolic_dims[family] = None, dims
            return None
        if not dims or (earlier is not None and dims <= self.symbolic_dims[family]):
            # (no size varies yet: another padding state of a shape seen; or the capture does not hold here for
            # another reason, or failed with these dimensions before: this shape is exported on its own)
            return earlier
        started = time.perf_counter()
        symbolic = capture_symbolic(self.model, args, kwargs, dims)
        self.symbolic_dims[family] = dims
        if earlier is not None and not self._rebind(family, symbolic, earlier, shapes):
            log.info("%s's new input shape varies another size, and a capture with it symbolic does not take "
                     "the shapes before: this shape is exported on its own", self._name)
            return earlier
        self.symbolic[family] = symbolic
        self.drop_generic(family)  # (its sizes are the new capture's symbols)
        samples = self.samples.setdefault(family, [])
        for c in plans:  # the shapes measured before: samples to fit later shapes' times from
            bindings = symbolic.bindings(*c.skeleton) if symbolic is not None else None
            if c.sample is not None and bindings:
                add_sample(samples, c.sample.bound(bindings))
        if symbolic is not None:
            log.info("%s has a new input shape: captured %s with symbolic sizes (%d dimensions: those that differ "
                     "between its shapes) in %.2f s; every later shape is specialized from it", self._name,
                     "again" if earlier is not None else "once", len(symbolic.symbolic_dims),
                     time.perf_counter() - started)
        return symbolic

    def _rebind(self, family: tuple, symbolic: SymbolicCapture | None, earlier: SymbolicCapture,
                shapes: list) -> bool:
        """Whether ``symbolic`` replaces ``earlier``: where it takes every shape that one took and every sample
        rebinds to it (rebound then, the shapes timed in the steps where they can be)."""
        samples = self.samples.setdefault(family, [])
        took = [skeleton for skeleton in shapes if earlier.bindings(*skeleton) is not None]
        rebound = [symbolic.rebound(dict(s.bindings), earlier) for s in samples] if symbolic is not None else []
        if symbolic is None or not all(rebound) or any(symbolic.bindings(*skeleton) is None for skeleton in took):
            return False
        samples[:] = [s.bound(bindings) for s, bindings in zip(samples, rebound)]
        for kept in (self.step_samples.get(family, []), self.node_samples.get(family, [])):
            kept[:] = [s.bound(b) for s in kept for b in [symbolic.rebound(dict(s.bindings), earlier)] if b]
        return True

    def _first_shape_capture(self, family: tuple, args: tuple, kwargs: dict) -> SymbolicCapture | None:
        """The symbolic capture at a family's first shape, with the sizes said to vary symbolic, or None where none
        is or the capture fails (logged; the second shape then captures with the sizes that differ)."""
        if family in self.first_capture_failed:  # (not tried again, also where its plans were all dropped since)
            return None
        dims, why = self.dims_said_to_vary(args, kwargs)
        if not dims:
            return None
        started = time.perf_counter()
        symbolic = capture_symbolic(self.model, args, kwargs, dims)
        if symbolic is None:
            self.first_capture_failed[family] = dims
            log.info("%s's %s, and no capture with them symbolic holds: captured at this shape, symbolically at the "
                     "second", self._name, why)
            return None
        self.symbolic[family] = symbolic
        self.symbolic_dims[family] = dims
        log.info("%s's %s: captured once with %d sizes symbolic in %.2f s, every shape specialized from it",
                 self._name, why, len(symbolic.symbolic_dims), time.perf_counter() - started)
        return symbolic

    def dims_said_to_vary(self, args: tuple, kwargs: dict) -> tuple[frozenset, str]:
        """The input dimensions a first shape is captured with symbolic, and why: every one with ``dynamic=True``
        (blocks.symbolic.every_dim); else those its inputs mark dynamic (marked_dims: ``torch._dynamo.mark_dynamic``)
        and the length of a padded ``attention_mask`` (padded_dims: a batch padded to its longest row says the
        lengths will vary)."""
        if self.dynamic:
            return every_dim(args, kwargs), "sizes are all dynamic (dynamic=True)"
        marked, padded = marked_dims(args, kwargs), padded_dims(self.model, args, kwargs)
        why = " and ".join(text for dims, text in ((marked, "inputs mark sizes dynamic"),
                                                   (padded, "attention_mask pads its rows (lengths will vary)")) if dims)
        return marked | padded, why
