"""One stage's menu, from wherever it already is or solved: a saved plan, the on-disk cache, a menu solved for the
same block at other sizes and re-costed, or the block ILP's sweep (hierremat.ilp.options.solve_menu).

The cache keys a menu by the stage's signature, a digest of its traced graph's structure, the device and the
versions its costs and formulation come from (:func:`cost_model_version`), so a second run solves nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..plans.block_graph import BlockGraph
from ..blocks.joint import to_block_graph
from ..runtime.node_profile import profile_nodes
from ..store.cache import CacheKey, OptionsCache, canonical_json
from ..ilp.options import recost_options, solve_menu
from ..session import current_session
from ..runtime.stage_cost_cache import STAGE_COST_VERSION, device_name
from .chain_menus import StageMenu
from .shape_fit import FIT_VERSION

if TYPE_CHECKING:
    from .family_programs import FamilyPrograms
    from .shape_fit import ShapeFit

log = logging.getLogger(__name__)

#: Bump when node profiling or the time calibration changes (invalidates cached menus).
COST_MODEL_VERSION = "nodes-5"  # (CPU node times: the least of their runs)
#: Bump when the ILP formulation changes (invalidates cached menus).
FORMULATION_VERSION = "staged-6"


def cost_model_version() -> str:
    """The versions a plan's costs come from: block nodes' times and their calibration (COST_MODEL_VERSION), the
    stage costs (hierremat.runtime.stage_cost_cache.STAGE_COST_VERSION), the block ILP (FORMULATION_VERSION), the
    costs fitted at shapes not measured (hierremat.planning.shape_fit.FIT_VERSION) and torch's (ModelPlan.cost_model:
    a saved plan made under others is warned about where it is run)."""
    return f"{COST_MODEL_VERSION}/{STAGE_COST_VERSION}/{FORMULATION_VERSION}/{FIT_VERSION}/torch-{torch.__version__}"


@dataclass(frozen=True)
class MenuRequest:
    """What hierremat.planning.menus.build_menus was asked, beside the stages and their inputs (its docstring says
    what each means)."""

    cache: OptionsCache
    stored: dict[str, StageMenu] | None
    time_limit: float
    deadline: float | None
    variants: bool
    residents: object
    recompute_across_dropouts: bool
    fitted: "ShapeFit | None"
    backward_autocast: bool | None
    programs: "FamilyPrograms | None"


def _warn_solver_failure(signature: str, err: Exception) -> None:
    """One warning per planner session for a failing ILP solver; later failures are logged at INFO."""
    what, failures = f"{type(err).__name__}: {err}", current_session().solver_failures
    (log.info if failures else log.warning)(
        "the block ILP for stage signature %s failed (%s): that block runs autograd's option only%s", signature,
        what, "" if failures else " (further failures of this planner session are logged at INFO)",
    )
    failures.append(what)


@contextlib.contextmanager
def _progress_bar(description: str):
    """A tqdm bar (when tqdm is installed and stderr is a terminal) advanced once per ILP solve."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda text: log.debug("%s: %s", description, text)
        return
    with tqdm(desc=description, unit="solve", disable=None, leave=False) as bar:
        def advance(text: str) -> None:
            bar.update(1)
            bar.set_postfix_str(text, refresh=False)
            log.debug("%s: %s", description, text)

        yield advance


def graph_structure(graph: BlockGraph, sizes: bool = True) -> tuple:
    """Everything of a BlockGraph but its measured costs: equal structures, interchangeable menus.
    sizes=False leaves the bytes out too: equal then for one block at two input shapes, whose
    menus are re-costed from each other (:func:`_recosted_menu`)."""
    return tuple(
        (n.name, n.op, n.phase, n.inputs, n.out_bytes if sizes else None, n.alias_of, n.random, n.in_place)
        for n in graph.nodes
    ) + (graph.input_name, graph.output_name, graph.output_grad_name, graph.input_grad_name, graph.held_grad_names)


def graph_key(signature: str, graph: BlockGraph) -> str:
    """The cache key of a stage's traced graph (menus, executor speeds): its signature and a
    digest of the graph's structure as the variants left it, so that graphs rewritten
    differently (variants on or off, another torch) never share or overwrite an entry."""
    digest = hashlib.sha256(repr(graph_structure(graph)).encode()).hexdigest()[:16]
    return f"{signature}/{digest}"


def family_key(graph: BlockGraph, recompute_across_dropouts: bool) -> str:
    """The cache signature of a block's menus at every size: a digest of its structure without bytes
    (:func:`graph_structure`); the entry names the key of the menu solved last, at whatever sizes."""
    digest = hashlib.sha256(repr(graph_structure(graph, sizes=False)).encode()).hexdigest()[:16]
    return f"any-shape/{digest}" + ("" if recompute_across_dropouts else "+cut-at-dropouts")


def _solved_at_other_sizes(cache: OptionsCache, family: CacheKey) -> dict | None:
    """The menu solved last for this block structure at any sizes (a StageMenu dict), or None: the one
    the cache's any-shape entry names (None where that menu was since evicted or is damaged), or
    without a cache the one the planner session solved (PlannerSession.solved_menus)."""
    if not cache.enabled:
        solved = current_session().solved_menus.get(family.digest())
        return solved.to_dict() if solved is not None else None
    pointer = cache.get(family)
    try:
        return cache.get(CacheKey.from_dict(pointer["menu_key"])) if pointer is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _parsed_menu(payload: dict) -> StageMenu:
    """``StageMenu.from_dict(payload)``, the same object for the same payload while it is among the last
    hierremat.session.PARSED_MENUS parsed: every shape whose block options are re-costed from it then shares its
    options' op lists (recost_options replaces their costs alone), where each parsed its own (2 MiB a shape for a
    4-layer GPT-2)."""
    text, parsed = canonical_json(payload), current_session().parsed_menus
    menu = parsed.get(text)
    if menu is None:
        menu = StageMenu.from_dict(payload)
        parsed.put(text, menu)
    return menu


def _recosted_menu(graph: BlockGraph, payload: dict | None, signature: str) -> StageMenu | None:
    """The menu solved for this block at other sizes (``payload``, a cached StageMenu), its options
    re-costed on ``graph`` (hierremat.ilp.options.recost_options); None where there is none or it
    does not fit this graph (then the menu is solved)."""
    if payload is None:
        return None
    try:
        solved = _parsed_menu(payload)
        if graph_structure(solved.graph, sizes=False) != graph_structure(graph, sizes=False):
            return None
        options = recost_options(graph, solved.options)
    except (KeyError, TypeError, ValueError) as err:
        log.info("stage signature %s: the menu solved at other sizes does not re-cost here (%s); solving", signature, err)
        return None
    log.info("stage signature %s: %d options re-costed from the menu solved at other sizes", signature, len(options))
    return StageMenu(graph, tuple(options), 0.0, solved.coarse, recosted=True)


def stage_menu(
    request: MenuRequest, joint, x, shared, signature: str, key_signature: str, name: str,
    node_costs: dict | None = None, measured: bool = True,
) -> StageMenu | None:
    """The stage's menu: from a saved plan, else from the cache, else re-costed from the menu solved
    at other sizes, else solved (and cached, unless the planning deadline cut it short); None when
    solving fails (the stage then offers autograd's option only, with a warning). key_signature: the
    signature the cache keys it by (hierremat.planning.menus: the graph's key). name: the stage's, for the progress
    bar. node_costs: fitted node costs (name -> (seconds, workspace
    bytes)) to re-cost with instead of measuring; a menu re-costed with them is not cached. measured: False
    models node costs from FLOPs and bytes (hierremat.runtime.node_profile's "flops": the planning deadline has
    passed); a menu costed so is not cached.

    A saved or cached menu is used only if its block graph has the structure of the one
    traced now (op lists name nodes of that graph)."""
    cache, stored = request.cache, request.stored
    unprofiled = to_block_graph(joint)
    structure = graph_structure(unprofiled)
    if stored is not None and signature in stored:
        menu = stored[signature]
        if graph_structure(menu.graph) == structure:
            return menu
        raise ValueError(f"the saved plan's options for stage signature {signature} do not match the traced graph")
    key = CacheKey(
        signature=key_signature,
        device_type=x.device.type,
        device_name=device_name(x.device),
        dtype=str(x.dtype) if x.is_floating_point() else "int",
        cost_model_version=f"{COST_MODEL_VERSION}/torch-{torch.__version__}",
        formulation_version=FORMULATION_VERSION,
    )
    # the menu last solved for this block at any sizes: options re-costed from it where no menu was solved at these
    family = replace(key, signature=family_key(unprofiled, request.recompute_across_dropouts))
    payload = cache.get(key)
    if payload is not None:
        try:
            menu = StageMenu.from_dict(payload)
            if graph_structure(menu.graph) == structure:
                return menu
            log.warning("cached options for %s do not match the traced graph; solving again", signature)
        except (KeyError, TypeError, ValueError) as err:
            log.warning("cached options for %s are unreadable (%s); solving again", signature, err)
    solved_before = _solved_at_other_sizes(cache, family)
    if solved_before is not None and node_costs is not None:
        recosted = _recosted_menu(to_block_graph(joint, node_costs), solved_before, signature)
        if recosted is not None:
            return replace(recosted, fitted=True)
    graph = to_block_graph(joint, profile_nodes(joint, x, shared, method="measure" if measured else "flops"))
    recosted = _recosted_menu(graph, solved_before, signature)
    if recosted is not None:
        if measured:
            cache.put(key, recosted.to_dict())  # a later plan at these sizes measures nothing again
        return recosted
    try:
        with _progress_bar(f"hierremat: block {name} ({signature})") as advance:
            solved = solve_menu(graph, time_limit=request.time_limit, progress=advance, label=signature,
                                deadline=request.deadline, recompute_across_dropouts=request.recompute_across_dropouts)
    except Exception as err:  # a solver that errors (HiGHS failing, a broken install): plan without the menu
        _warn_solver_failure(signature, err)
        return None
    menu = StageMenu(graph, tuple(solved.options), solved.solve_seconds, solved.coarse)
    if measured and not solved.cut_by_deadline:
        cache.put(key, menu.to_dict())
        cache.put(family, {"menu_key": key.to_dict()})
        if not cache.enabled:
            current_session().solved_menus.put(family.digest(), menu)
    log.info("stage signature %s: %d options from %d ILP solves in %.2f s", signature, len(menu.options), solved.n_solves, solved.solve_seconds)
    return menu
