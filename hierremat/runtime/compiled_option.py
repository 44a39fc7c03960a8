"""Block options compiled by Inductor: an option's forward and backward graphs as fused kernels.

:func:`hierremat.runtime.option_codegen.generate_option` without ``accumulate`` gives an
option's two phases as pure ATen graphs (buffer updates and parameter gradients returned,
not applied). :class:`CompiledProgram` compiles each with ``torch._inductor.compile`` on
example inputs, once per (stage signature, option): parameters are inputs of the graphs,
so every stage of one signature shares the compiled code. :class:`CompiledOptionExecutor`
binds it to one stage and has :class:`hierremat.runtime.block_exec.OptionExecutor`'s
interface, so the chain runner runs either.

* **Dropout is bitwise eager's.** Inductor compiles with ``fallback_random=True``: random
  ops call the ATen kernels, which draw what eager autograd draws from the same RNG state
  (the chain runner restores it for a replay). Other values agree with eager to within the
  rounding of fused arithmetic (the tolerance ``torch.compile`` itself gives).
* **Costs are measured on the compiled form** (:meth:`CompiledOptionExecutor.measure`):
  forward and backward seconds, and peaks from the device allocator (on CPU the
  profiler's allocation events, which see inside compiled code; the live-tensor tracker
  cannot). Inductor orders and fuses work its own way, so the ILP's memory model does not
  apply to a compiled option; the chain DP gets these measured figures instead.
* **Inputs are laid out as compiled.** Inductor's code assumes its example inputs'
  strides; an input that comes with other strides (a non-contiguous output gradient) is
  copied into that layout first.
* **Compiled code is cached on disk** by Inductor's own caches (FX graph cache), under
  hierremat's cache directory (``<cache>/inductor``) unless ``TORCHINDUCTOR_CACHE_DIR`` is set,
  so a second process with the same graphs loads them instead of compiling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..blocks.joint import JointGraph
from ..plans.costs import OptionCosts
from ..plans.block_options import BlockOption, ForwardOnly
from ..blocks.variants.in_place import functional_joint
from ..device.autocast import AutocastState
from .block_exec import OptionTape
from ..device.memory import CpuAllocatorMeter, CudaPeakMeter
from .option_codegen import ForwardProgram, OptionProgram, StageBinding, generate_forward_only, generate_option
from .profile import run_seconds, timed_seconds, storage_bytes

log = logging.getLogger(__name__)


@contextlib.contextmanager
def inductor_cache_dir(directory: str | os.PathLike | None):
    """Point Inductor's on-disk caches at ``directory`` while compiling, unless the user chose
    another with ``TORCHINDUCTOR_CACHE_DIR`` (Inductor itself sets it to its default on first use)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if directory is None or (chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir())):
        yield
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(directory)):
        yield


def _layout(value):
    return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device) if isinstance(value, torch.Tensor) else None


class _Compiled:
    """One compiled phase and the layouts of the inputs it was compiled for."""

    def __init__(self, module, example: list):
        import torch._inductor  # noqa: F401  (loaded when an option is compiled: a heavy import)

        with torch._inductor.config.patch(fallback_random=True):
            self.fn = torch._inductor.compile(module, example)
        self.layouts = [_layout(v) for v in example]

    def __call__(self, args: list):
        for i, (value, layout) in enumerate(zip(args, self.layouts)):
            if layout is not None and _layout(value) != layout:
                log.debug("compiled option input %d has layout %s, compiled for %s: copied", i, _layout(value), layout)
                args[i] = torch.empty_strided(layout[0], layout[1], dtype=layout[2], device=layout[3]).copy_(value)
        return self.fn(*args)


class CompiledProgram:
    """An option's pure program with both phases compiled (shared by the stages of one signature).

    compile_seconds: wall seconds spent compiling (cold) or loading from Inductor's cache.
    """

    def __init__(self, joint: JointGraph, option: BlockOption, x: torch.Tensor, shared: tuple, cache_dir=None):
        if joint.resident_seeds:  # (hierremat.planning.chain_menus.ChainMenus.compilable)
            raise ValueError("options of stages that read residents are not compiled: their seeds may be missing")
        self.option = option
        joint = functional_joint(joint)  # Inductor places buffers itself
        self.program: OptionProgram = generate_option(joint, option)
        started = time.perf_counter()
        binding = StageBinding(joint)
        fwd_args = binding.args(self.program.forward_inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
                y, *rest = self.program.forward(*fwd_args)  # example inputs of the backward
            tape = OptionTape.of(option, rest[: len(self.program.kept_slots)], x.detach(), y)
            bwd_args = binding.args(self.program.backward_inputs, tape.x, shared, torch.ones_like(y), tape)
            del y, rest, tape
            with inductor_cache_dir(cache_dir):
                self.forward = _Compiled(self.program.forward_module, fwd_args)
                self.backward = _Compiled(self.program.backward_module, bwd_args)
        self.compile_seconds = time.perf_counter() - started


@dataclass(frozen=True)
class CompiledCosts:
    """An option's costs measured on its compiled form (see OptionCosts for the fields' meaning)."""

    fwd_time: float
    bwd_time: float
    kept_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int

    def to_option_costs(self, option: BlockOption) -> OptionCosts:
        """``option``'s costs for the chain DP with these figures in place of the ILP's."""
        return replace(
            option, name=f"{option.name}+compiled", fwd_time=self.fwd_time, bwd_time=self.bwd_time,
            kept_bytes=self.kept_bytes, fwd_peak_bytes=self.fwd_peak_bytes, bwd_peak_bytes=self.bwd_peak_bytes,
        ).to_option_costs()


class CompiledOptionExecutor:
    """Runs a CompiledProgram on one stage (``joint`` bound to it); OptionExecutor's interface.

    binding: the stage's parameters and buffers (default: made here)."""

    def __init__(self, joint: JointGraph, compiled: CompiledProgram, binding: StageBinding | None = None):
        self.joint = joint
        self.option = compiled.option
        self.compiled = compiled
        self.binding = binding if binding is not None else StageBinding(joint)
        self.program = compiled.program

    def forward(self, x: torch.Tensor, shared: tuple) -> tuple[torch.Tensor, OptionTape]:
        args = self.binding.args(self.program.forward_inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            y, *rest = self.compiled.forward(args)
        n_kept = len(self.program.kept_slots)
        for target, value in zip(self.program.buffer_updates, rest[n_kept:]):
            self.binding.buffer(target).copy_(value)
        return y, OptionTape.of(self.option, rest[:n_kept], x, y)

    def backward(self, tape: OptionTape, dy: torch.Tensor, shared: tuple) -> torch.Tensor | None:
        args = self.binding.args(self.program.backward_inputs, tape.x, shared, dy, tape)
        tape.kept, tape.x, tape.y = [], None, None
        with torch.no_grad(), AutocastState.off((dy.device.type,)).applied():
            dx, *grads = self.compiled.backward(args)
        del args
        params = [self.binding.param(t) for t in self.program.param_grads]
        pairs = [(p, g) for p, g in zip(params, grads) if p.requires_grad]
        del grads
        if pairs:  # through AccumulateGrad, so gradient hooks fire as in plain training
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
        return dx

    def measure(self, x: torch.Tensor, shared: tuple, repeats: int = 3) -> CompiledCosts:
        """Seconds and peak bytes of the forward and of the backward, as the chain DP counts them
        (call under hierremat.runtime.profile's no_side_effects and scratch_grads)."""
        device = x.device
        y, tape = self.forward(x, shared)  # warm-up
        dy = torch.ones_like(y)
        del y
        self.backward(tape, dy, shared)
        with _peak_meter(device) as fwd_meter:
            y, tape = self.forward(x, shared)
        # kept values that are views of the stage's inputs, parameters or buffers own no new memory
        inputs = self.binding.args(self.program.forward_inputs, x, shared)
        excluded = {v.untyped_storage().data_ptr() for v in (*inputs, y) if isinstance(v, torch.Tensor)}
        del inputs
        kept = [v for v in tape.kept if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in excluded]
        kept_bytes = storage_bytes(tuple(kept)) if kept else 0
        del kept, y
        with _peak_meter(device) as bwd_meter:
            self.backward(tape, dy, shared)
        fwd_time = timed_seconds(lambda: self.forward(x, shared), repeats, device)
        # the backward timed on its own after each (untimed) forward, not as a difference of two noisy times
        bwd_times = []
        for _ in range(repeats):
            y, tape = self.forward(x, shared)
            del y
            bwd_times.append(timed_seconds(lambda: self.backward(tape, dy, shared), 1, device))
        del tape
        bwd_time = run_seconds(bwd_times)
        return CompiledCosts(fwd_time, bwd_time, kept_bytes, int(fwd_meter.peak_bytes), int(bwd_meter.peak_bytes))


def _peak_meter(device: torch.device):
    """The allocator's meter on ``device``: it sees inside compiled code, the live-tensor tracker does not."""
    return CudaPeakMeter(device) if device.type == "cuda" else CpuAllocatorMeter()


class CompiledForward:
    """A stage signature's no-grad forward (F_none / F_ck) compiled by Inductor, shared by its stages.

    compile_seconds: wall seconds spent compiling (cold) or loading from Inductor's cache.
    """

    def __init__(self, joint: JointGraph, forward: ForwardOnly, x: torch.Tensor, shared: tuple, cache_dir=None):
        self.forward = forward
        joint = functional_joint(joint)  # Inductor places buffers itself
        self.program: ForwardProgram = generate_forward_only(joint, forward.ops, pure=True)
        started = time.perf_counter()
        args = StageBinding(joint).args(self.program.inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied(), inductor_cache_dir(cache_dir):
            self.compiled = _Compiled(self.program.module, args)
        self.compile_seconds = time.perf_counter() - started


class CompiledForwardExecutor:
    """Runs a CompiledForward on one stage; hierremat.runtime.block_exec.ForwardExecutor's interface."""

    def __init__(self, compiled: CompiledForward, binding: StageBinding):
        self.compiled = compiled
        self.binding = binding

    def __call__(self, x: torch.Tensor, shared: tuple) -> torch.Tensor:
        program = self.compiled.program
        args = self.binding.args(program.inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            y, *updates = self.compiled.compiled(args)
            for target, value in zip(program.buffer_updates, updates):
                self.binding.buffer(target).copy_(value)
        return y

    def measure(self, x: torch.Tensor, shared: tuple, repeats: int = 3) -> tuple[float, int]:
        """(seconds, peak bytes above the memory before, the output included), as the chain DP
        counts a forward without grad (call under hierremat.runtime.profile's no_side_effects)."""
        self(x, shared)  # warm-up
        with _peak_meter(x.device) as meter:
            y = self(x, shared)
        del y
        return timed_seconds(lambda: self(x, shared), repeats, x.device), int(meter.peak_bytes)

