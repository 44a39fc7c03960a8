"""Per-node costs of a joint graph: measured times (and CUDA workspace), or a FLOP model.

``profile_nodes`` runs the joint graph once, node by node, with an fx Interpreter on
real inputs; at each ``call_function`` node it times the node's own op on the values
just computed:

* CUDA (``x.is_cuda``): one pair of CUDA events per repeat on the current stream, after
  a warm-up; the median. Workspace = the allocator's peak during one run of the op above
  what was allocated before it, minus the bytes of its result (clamped at 0).
* CPU: ``time.perf_counter`` around each repeat after a warm-up; the least (as the stages' times:
  other processes only add time). Workspace:
  the scratch a kernel allocates below the dispatcher (``_safe_softmax``'s mask, ...), which the
  live-tensor tracker cannot see but the CPU allocator meter does, read from one more run of the
  graph under ``torch.profiler``'s memory events (each node marked with ``record_function``): the
  allocator's peak during the node above what was allocated before it, minus its result's new bytes
  (returned a third time: it is scratch, hierremat.plans.block_graph.GraphNode.scratch_bytes).
* ``method="flops"``: deterministic, no timing: ``overhead + flops / flops_per_s +
  bytes / bytes_per_s`` where flops come from ``torch.utils.flop_counter.FlopCounterMode``
  on the node's op and bytes are its tensor inputs and outputs; views and getitems cost 0.

Running ops again draws random numbers; the caller's CPU and CUDA RNG states are
restored afterwards, and the stage's buffers are not updated.
"""

from __future__ import annotations

import contextlib
import operator
import statistics
import time

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..device.autocast import AutocastState
from ..device.memory import allocated_bytes, allocator_peaks_in_marks, check_no_profiler, cpu_memory_profile
from ..blocks.joint import JointGraph, evaluate_size, is_view_node, joint_inputs, overwritten_argument

#: Defaults of the FLOP cost model (seconds = overhead + flops/rate + bytes/bandwidth).
FLOPS_PER_S = 1e12
BYTES_PER_S = 1e11
OP_OVERHEAD_S = 1e-6


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _new_bytes(result, inputs) -> int:
    seen = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    total = 0
    for t in _tensors(result):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += allocated_bytes(t.untyped_storage().nbytes(), t.device)
    return total


def _is_free(node: fx.Node) -> bool:
    return node.target is operator.getitem or is_view_node(node)


class _Profiler(fx.Interpreter):
    def __init__(self, gm, method: str, repeats: int, warmup: int, cuda: bool, rates: tuple[float, float, float]):
        super().__init__(gm)
        self.method = method
        self.repeats = max(1, repeats)
        self.warmup = warmup
        self.cuda = cuda
        self.rates = rates
        self.costs: dict[str, tuple[float, int]] = {}

    def run_node(self, node: fx.Node):
        if node.op != "call_function":
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        target = node.target
        overwritten = overwritten_argument(node)
        written = self.env[overwritten] if overwritten is not None else None
        result = target(*args, **kwargs)
        # the op runs again below: an in-place op on a copy of what it overwrote (its result)
        again = (lambda: _with_copy_of(written, args, kwargs)) if written is not None else (lambda: (args, kwargs))
        if self.method == "flops":
            self.costs[node.name] = (self._model_time(node, target, *again(), result), 0)
        elif self.cuda:
            self.costs[node.name] = self._cuda(node, target, again)
        else:
            self.costs[node.name] = self._cpu(target, again)
        return result

    def _model_time(self, node, target, args, kwargs, result) -> float:
        if _is_free(node):
            return 0.0
        flops_per_s, bytes_per_s, overhead = self.rates
        counter = FlopCounterMode(display=False)
        with counter:
            target(*args, **kwargs)
        moved = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)) + _tensors(result))
        return overhead + counter.get_total_flops() / flops_per_s + moved / bytes_per_s

    def _cpu(self, target, again) -> tuple[float, int]:
        for _ in range(self.warmup):
            args, kwargs = again()
            target(*args, **kwargs)
        times = []
        for _ in range(self.repeats):
            args, kwargs = again()
            start = time.perf_counter()
            target(*args, **kwargs)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9), 0  # (the least: as the stages' times, runtime.profile.run_seconds)

    def _cuda(self, node, target, again) -> tuple[float, int]:
        stream = torch.cuda.current_stream()
        for _ in range(self.warmup):
            args, kwargs = again()
            target(*args, **kwargs)
        pairs = []
        for _ in range(self.repeats):
            args, kwargs = again()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            target(*args, **kwargs)
            end.record(stream)
            pairs.append((start, end))
        stream.synchronize()
        seconds = statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3
        workspace = 0
        if not _is_free(node):
            args, kwargs = again()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            result = target(*args, **kwargs)
            peak = torch.cuda.max_memory_allocated()
            workspace = max(0, peak - before - _new_bytes(result, (args, kwargs)))
            del result
        return max(seconds, 1e-9), int(workspace)


#: record_function label of a node's run in the workspace pass (CPU)
_MARK = "hierremat-node:"


class _CpuWorkspaces(fx.Interpreter):
    """Runs the graph once, each node that computes marked for the profiler; ``new_bytes``: per node, the
    bytes of the storages its result allocated."""

    def __init__(self, gm):
        super().__init__(gm)
        self.new_bytes: dict[str, int] = {}

    def run_node(self, node: fx.Node):
        if node.op != "call_function" or _is_free(node):
            return super().run_node(node)
        inputs = self.fetch_args_kwargs_from_env(node)
        with torch.profiler.record_function(_MARK + node.name):
            result = super().run_node(node)
        self.new_bytes[node.name] = _new_bytes(result, inputs)
        return result


def _cpu_workspaces(gm: fx.GraphModule, args: list) -> dict[str, int]:
    """Per node, the CPU allocator's peak during its run above what was allocated when it started, minus its
    result's new bytes (module docstring)."""
    check_no_profiler("measure the CPU workspaces of a block's operators")
    interpreter = _CpuWorkspaces(gm)
    with cpu_memory_profile() as prof:
        interpreter.run(*args, enable_io_processing=False)
    events = list(prof.profiler.kineto_results.events())
    del prof
    return {name: max(0, peak - base - interpreter.new_bytes.get(name, 0))
            for name, (base, peak) in allocator_peaks_in_marks(events, _MARK).items()}


def _with_copy_of(written: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every occurrence of ``written`` replaced by one copy of it."""
    copy = written.clone()

    def swap(a):
        return copy if a is written else a

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def profile_nodes(
    joint: JointGraph,
    x: torch.Tensor,
    shared: tuple = (),
    device: torch.device | str | None = None,
    repeats: int = 5,
    *,
    method: str = "measure",
    warmup: int = 1,
    flops_per_s: float = FLOPS_PER_S,
    bytes_per_s: float = BYTES_PER_S,
    op_overhead_s: float = OP_OVERHEAD_S,
) -> dict[str, tuple[float, int]]:
    """Cost of every ``call_function`` node of ``joint``: name -> (seconds, workspace bytes), and on CPU (measured)
    a third element, the part of the workspace that is kernel scratch (all of it there).

    device: where to run (default: x's device); inputs and the stage's parameters and
        buffers are copied there if they live elsewhere.
    method: ``"measure"`` (timed, see the module docstring) or ``"flops"`` (deterministic model).
    The output gradient fed to the backward is ones.
    """
    if method not in ("measure", "flops"):
        raise ValueError(f"method must be 'measure' or 'flops', got {method!r}")
    device = torch.device(device) if device is not None else x.device
    tangent_vals = {
        i: joint.module.graph.find_nodes(op="placeholder", target=name)[0].meta["val"]
        for i, name in joint.tangent_names.items()
    }
    tangents = [torch.ones([evaluate_size(n, joint.sizes) for n in v.shape], dtype=v.dtype, device=device)
                for _, v in sorted(tangent_vals.items())]  # (a graph traced with symbolic sizes: at its sizes)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in joint_inputs(joint, x, shared, tangents)]
    cuda = device.type == "cuda"
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    profiler = _Profiler(joint.module, method, repeats, warmup, cuda, (flops_per_s, bytes_per_s, op_overhead_s))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.no_grad())
        stack.enter_context(AutocastState.off((device.type,)).applied())  # the graph's casts are explicit
        if cuda:
            stack.enter_context(torch.cuda.device(device))
        profiler.run(*args, enable_io_processing=False)
        if method == "measure" and not cuda:
            scratch = _cpu_workspaces(joint.module, args)
            for name, (seconds, _) in profiler.costs.items():
                profiler.costs[name] = (seconds, scratch.get(name, 0), scratch.get(name, 0))
    return profiler.costs
