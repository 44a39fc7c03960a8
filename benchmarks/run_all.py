"""Every rematerialization method on the same models and budgets, in one process and one sitting.

    python benchmarks/run_all.py                          # all models (gpt2-12 takes ~25 min on 2 CPU cores)
    python benchmarks/run_all.py --models mlp,resnet,gpt2-tiny --rounds 5
    python benchmarks/run_all.py --quick                  # smoke test: small MLP, 2 hierremat budgets, < 60 s
    python benchmarks/run_all.py --readme                 # also rewrite docs/results.md's results block
    python benchmarks/run_all.py --from-json benchmarks/results/run_all_gpt2_12.json --readme   # re-render only

Models (``--models``, built from configs with random weights, nothing downloaded):
  mlp        nn.Sequential MLP chain (Linear/LayerNorm/GELU/Dropout stages);
  resnet     ResNet-style nn.Sequential: conv stem, BasicBlocks (residual, BatchNorm), pooled head;
  gpt2-tiny  Hugging Face GPT2LMHeadModel, 4 layers, n_embd 256, batch 2, seq 128, vocab 50257;
  gpt2-12    GPT2LMHeadModel, 12 layers, n_embd 768, 12 heads, batch 2, seq 512, vocab 50257, fp32.
A training step is ``loss_of(model(x)).backward()`` (Sequential, loss = mean(y**2)) or
``model(ids, labels=ids, use_cache=False).loss.backward()`` (GPT-2). Models are in train mode:
dropout is on and seeded identically for every method.

Methods (one row each; a row that does not apply or fails is kept, with the reason):
  no checkpointing      plain autograd: the baseline every ratio is relative to;
  HF checkpointing      ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                        False})`` on a deepcopy (GPT-2 only);
  torch segments        ``torch.utils.checkpoint.checkpoint_sequential(model, K, x, use_reentrant=False)``
                        at every segment count K >= 2 (Sequential models);
  segments (hierremat runtime)  GPT-2: ``hierremat.remat(..., strategy="segments=K", variants=False)``, torch's
                        uniform segments on hierremat's chain of stages (the model's own operators), run by
                        hierremat's runtime;
  selective AC          per block (each Sequential child / each GPT-2 decoder block):
                        ``checkpoint(block, use_reentrant=False, context_fn=create_selective_checkpoint_contexts
                        (policy))``, policy: save mm/addmm/bmm/baddbmm/linear/convolution outputs, recompute the rest;
  torch.compile         ``torch._functorch.config.activation_memory_budget`` in ``--compile-budgets``; the first
                        step's wall time (compile included) is the "plan/compile s"; guarded by
                        ``--compile-timeout`` (SIGALRM); Inductor's caches are off (``--compile-cache``). Inductor draws dropout masks from its own RNG, so these
                        rows' gradient difference includes different dropout masks: it is not a correctness
                        check (Inductor's ``fallback_random`` would make masks equal, but at low budgets the
                        partitioner then recomputes the eager random op with fresh numbers: wrong gradients);
  hierremat             ``hierremat.remat(model, args, kwargs, budget=B)`` (GPT-2) or
                        ``hierremat.checkpoint_sequential(model, B, x)`` (Sequential) at: the measured peak of every
                        baseline (equal-memory comparison), the smallest feasible budget
                        (``InfeasibleBudgetError.min_budget_bytes`` after asking for 1 KiB) and
                        ``--between`` budgets spaced geometrically up to the plain peak. One warm-up step
                        first (hierremat re-plans after the first backward if the caller releases the output).
                        Defaults: per-block ILP options and operator variants (hierremat.blocks.variants);
  hierremat configurations  (HIERREMAT_CONFIGS) the same budgets without operator variants (variants=False),
                        Rotor on blocks (block_options="autograd", variants=False: autograd's options and the
                        model's own operators), the whole-graph ILP (segmentation="none"),
                        block options compiled by Inductor (compile=True; peaks from the CPU allocator's events,
                        as for torch.compile) and outputs="loss" (the logits not returned: the LM head may run
                        fused with the loss; also at its own smallest feasible budget), and compile=True with
                        outputs="loss" together; reported "not available"
                        where the API does not take their arguments.

Metrics per row: peak bytes above the parameter baseline and its ratio to no checkpointing; the
median step time over ``--rounds`` rounds (every method once per round, in a seeded shuffled order)
and its ratio; planning or compile seconds; max |grad - plain grad| over all parameters (one step,
same seed); hierremat's deterministic predicted step time (profiled op costs) and stage-forward count.

Peak memory on CPU is hierremat's live-tensor tracker (``hierremat.device.LiveTensorTracker``, what a
budget counts). Under the tracker's dispatch mode TorchDynamo runs the *uncompiled* code, so torch.compile
rows are measured with the CPU allocator's events from ``torch.profiler`` instead (column "alloc MiB" has
that meter for every row; for eager code it agrees with the tracker) and their ratio is to plain's
allocator peak. On CUDA every row uses the ``torch.cuda.max_memory_allocated`` delta.

Outputs under ``--out`` (default benchmarks/results): ``<stem>.json`` (all rows and the environment),
``<stem>.md`` (the Markdown report), ``<stem>_<model>.png`` (peak vs step time per model)
and ``<stem>_planning.png`` (planning/compile time per method); stem ``run_all`` (``run_all_quick`` with
``--quick``). ``--readme`` replaces the text between ``<!-- results:start -->`` and
``<!-- results:end -->`` in docs/results.md (the full tables the README links to) with the report, when
both markers exist.
"""

from __future__ import annotations

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence the profiler's start/stop lines

import argparse
import dataclasses
import copy
import functools
import gc
import inspect
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402

import hierremat  # noqa: E402
from hierremat import InfeasibleBudgetError  # noqa: E402

log = logging.getLogger("run_all")
MIB = C.MIB
SEED = 1234
ALL_MODELS = ("mlp", "resnet", "gpt2-tiny", "gpt2-12")


def _whole_model_options(extra: dict, **settings) -> dict:
    """A configuration's options as remat and plan take them: outputs= itself, the others in settings=."""
    fields = {k: v for k, v in extra.items() if k != "outputs"}
    return {"outputs": extra.get("outputs"), "settings": hierremat.Settings(**fields, **settings)}


# Extra hierremat configurations, each a row family at the same budgets as plain hierremat: (label, keyword
# arguments added to hierremat.remat / hierremat.checkpoint_sequential). A configuration whose arguments the API
# does not take yet is reported as "not available" (TypeError). To add a row once the API has it, add one line.
HIERREMAT_CONFIGS: list[tuple[str, dict]] = [
    # the "hierremat" rows use the defaults: whole models get per-block ILP option menus
    ("hierremat, no operator variants", {"variants": False}),  # the model's own cross-entropy and dropout ops
    # Rotor: autograd's options for each block, the model's own operators
    ("hierremat, Rotor on blocks (autograd's options only)", {"block_options": "autograd", "variants": False}),
    # one ILP over everything before the head (with the variants, its recomputation stops at dropouts:
    # hierremat.ilp.formulation.structure)
    ("hierremat, whole-graph ILP", {"segmentation": "none"}),
    # block options also offered compiled by Inductor, chosen with their measured compiled costs
    ("hierremat, compiled block options", {"compile": True}),
    # the caller uses the loss only (as every step here does): the logits are not returned, and the LM head
    # may run fused with the loss, chunk by chunk (an option of the output stage)
    ("hierremat, outputs='loss' (fused LM head)", {"outputs": "loss"}),
    # both: what a user who wants the fastest step at a given memory would set
    ("hierremat, compiled block options, outputs='loss'", {"compile": True, "outputs": "loss"}),
]
#: configurations whose smallest feasible budget differs from the default's: each also runs at its own
LOWER_MINIMUM_CONFIGS = ("outputs",)
# the whole-graph ILP grows with the model: run it on the small models only
WHOLE_GRAPH_MODELS = ("mlp", "resnet", "gpt2-tiny")


# --------------------------------------------------------------------------------------------
# models


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, residual (1x1 conv+BN projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet_seq(width: int, blocks_per_stage: int, batch: int, size: int, classes: int = 10):
    w = width
    layers = [nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())]
    c = w
    for stage, c_out in enumerate((w, 2 * w, 4 * w)):
        for b in range(blocks_per_stage):
            layers.append(BasicBlock(c, c_out, 2 if stage > 0 and b == 0 else 1))
            c = c_out
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(c, classes)))
    x = torch.randn(batch, 3, size, size)
    desc = (f"ResNet-style nn.Sequential: stem + {3 * blocks_per_stage} BasicBlocks (widths {w}/{2 * w}/{4 * w}) "
            f"+ head; input {tuple(x.shape)}")
    return nn.Sequential(*layers), x, desc


def mlp_chain(d: int, hidden: int, blocks: int, tokens: int, d_in: int = 64, d_out: int = 16):
    layers: list[nn.Module] = [nn.Linear(d_in, d)]
    for _ in range(blocks):
        layers.append(nn.LayerNorm(d))
        layers.append(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, d)))
    layers.append(nn.Linear(d, d_out))
    x = torch.randn(tokens, d_in)
    desc = (f"MLP nn.Sequential: {blocks} x (LayerNorm | Linear {d}->{hidden}, GELU, Dropout, Linear) "
            f"+ in/out Linear; input {tuple(x.shape)}")
    return nn.Sequential(*layers), x, desc


GPT2_CONFIGS = {
    "gpt2-tiny": (dict(n_layer=4, n_embd=256, n_head=4), 2, 128),
    "gpt2-12": (dict(n_layer=12, n_embd=768, n_head=12), 2, 512),
}
GPT2_QUICK = (dict(n_layer=2, n_embd=128, n_head=4), 2, 128)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


@dataclass
class Workload:
    name: str
    kind: str  # "gpt2" | "sequential"
    description: str
    model: nn.Module
    x: torch.Tensor  # the input (token ids for GPT-2)
    n_stages: int

    def run(self, module: Callable) -> None:
        """One training step through ``module`` (the model or a wrapper called like it)."""
        if self.kind == "gpt2":
            module(self.x, labels=self.x, use_cache=False).loss.backward()
        else:
            loss_of(module(self.x)).backward()

    @property
    def kwargs(self) -> dict:
        return {"labels": self.x, "use_cache": False} if self.kind == "gpt2" else {}


def build_workload(name: str, quick: bool, device: torch.device, gpt2_batch: int | None = None) -> Workload:
    torch.manual_seed(0)
    if name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg, batch, seq = GPT2_QUICK if quick else GPT2_CONFIGS[name]
        batch = gpt2_batch or batch
        cfg = dict(cfg, vocab_size=50257, n_positions=1024)
        model = GPT2LMHeadModel(GPT2Config(**cfg)).train()
        try:  # the loss set explicitly: otherwise transformers warns from inside forward, a graph break for Dynamo
            from transformers.loss.loss_utils import LOSS_MAPPING

            model.loss_function = LOSS_MAPPING["ForCausalLM"]
        except (ImportError, KeyError, AttributeError):
            pass
        x = torch.randint(0, cfg["vocab_size"], (batch, seq))
        desc = (f"GPT2LMHeadModel({', '.join(f'{k}={v}' for k, v in cfg.items())}), fp32, batch {batch}, "
                f"seq {seq}, dropout 0.1")
        wl = Workload(name, "gpt2", desc, model, x, cfg["n_layer"] + 2)
    elif name == "mlp":
        model, x, desc = mlp_chain(256, 1024, 3, 512) if quick else mlp_chain(256, 1024, 6, 512)
        wl = Workload(name, "sequential", desc, model.train(), x, len(model))
    elif name == "resnet":
        model, x, desc = resnet_seq(8, 1, 4, 32) if quick else resnet_seq(32, 2, 8, 64)
        wl = Workload(name, "sequential", desc, model.train(), x, len(model))
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")
    wl.model.to(device)
    wl.x = wl.x.to(device)
    n_params = sum(p.numel() for p in wl.model.parameters())
    wl.description += f"; {n_params / 1e6:.2f} M parameters"
    return wl


# --------------------------------------------------------------------------------------------
# rows


@dataclass
class Row:
    model: str
    method: str
    setting: str
    family: str  # plain | hf | segments | sac | compile | hierremat | hierremat-config
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    peak_meter: str = ""
    alloc_peak_bytes: int | None = None
    peak_ratio: float | None = None
    times: list = field(default_factory=list)
    median_s: float | None = None
    time_ratio: float | None = None
    first_step_s: float | None = None
    planning_s: float | None = None
    compile_s: float | None = None
    grad_max_abs_diff: float | None = None
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    forwards: int | None = None
    within_budget: bool | None = None
    # runtime only (not written)
    step: Callable | None = field(default=None, repr=False)
    params: list | None = field(default=None, repr=False)
    plan: object = field(default=None, repr=False)
    compiled: bool = False
    error: Exception | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        skip = ("step", "params", "plan", "compiled", "error")
        d = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def tag(r: Row) -> str:
    """A short name of a baseline row, for hierremat budget labels."""
    return {"hf": "HF", "sac": "selective AC", "plain": "plain"}.get(
        r.family, r.setting.replace("activation_memory_budget", "compile budget"))


SAVE_OPS = None


def sac_policy(ctx, op, *args, **kwargs):
    """Save the outputs of matmuls and convolutions, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    global SAVE_OPS
    if SAVE_OPS is None:
        aten = torch.ops.aten
        SAVE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                    aten.linear.default, aten.convolution.default, aten._convolution.default}
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpoint(nn.Module):
    """Runs ``block`` under torch's non-reentrant checkpoint with the selective policy ``sac_policy``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        return checkpoint(self.block, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, sac_policy), **kwargs)


class Bench:
    """One model: builds the rows, measures them, times them interleaved."""

    def __init__(self, wl: Workload, args, device: torch.device):
        self.wl = wl
        self.args = args
        self.device = device
        self.rows: list[Row] = []
        self.params = C.params_of(wl.model)
        self.ref_grads: list[torch.Tensor] | None = None
        self.started = time.perf_counter()
        self.notes: list[str] = []
        self.rounds = args.rounds or (3 if wl.name == "gpt2-12" else 5)
        self.rounds_done = 0

    # ---- measuring

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if row.status != "ok":
            log.info("  %s [%s]: %s (%s)", row.method, row.setting, row.status, row.reason)
        return row

    def skip(self, method, setting, family, reason, status="skipped", **kw) -> Row:
        return self.add(Row(self.wl.name, method, setting, family, status=status, reason=reason, **kw))

    def prepare(self, row: Row, guard: float | None = None) -> Row:
        """Warm-up step (compiles/plans/re-plans), then one measured step: peak bytes and gradients vs plain."""
        t0 = time.perf_counter()
        try:
            C.zero_grads(row.params)
            torch.manual_seed(SEED)
            t0 = time.perf_counter()
            with C.time_limit(guard, f"{row.method} first step"):
                row.step()
            C.synchronize(self.device)
            row.first_step_s = time.perf_counter() - t0
            C.zero_grads(row.params)
            torch.manual_seed(SEED)
            if self.device.type == "cpu":
                box = {}
                if row.compiled:  # the tracker's dispatch mode would make Dynamo run the uncompiled code
                    row.alloc_peak_bytes = C.allocator_peak_bytes(row.step)
                    row.peak_bytes, row.peak_meter = row.alloc_peak_bytes, "allocator"
                else:
                    row.alloc_peak_bytes = C.allocator_peak_bytes(
                        lambda: box.__setitem__("peak", C.peak_bytes(row.step, self.device)))
                    row.peak_bytes, row.peak_meter = box["peak"], "tracker"
            else:
                row.peak_bytes, row.peak_meter = C.peak_bytes(row.step, self.device), "cuda allocator"
            if self.ref_grads is None:
                self.ref_grads = C.grads_of(row.params)
                row.grad_max_abs_diff = 0.0
            else:
                row.grad_max_abs_diff = C.max_abs_diff([p.grad for p in row.params], self.ref_grads)
        except Exception as err:  # report, do not fix
            row.status, row.reason = "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            row.step = None
            row.error = err
            row.first_step_s = row.first_step_s or time.perf_counter() - t0  # (time until it failed)
            if self.args.verbose:
                log.exception("traceback")
        if row.plan is not None or row.family.startswith("hierremat") or row.family == "segments":
            self.read_plan(row)
        if row.status == "ok":
            pred = f", predicted {row.predicted_peak_bytes / MIB:.2f}" if row.predicted_peak_bytes else ""
            log.info("  %-40s %-34s peak %8.2f MiB (%s%s), alloc %s MiB, first step %.2f s, grad diff %.1e",
                     row.method[:40], row.setting[:34], row.peak_bytes / MIB, row.peak_meter, pred,
                     C.fmt(row.alloc_peak_bytes and row.alloc_peak_bytes / MIB), row.first_step_s,
                     row.grad_max_abs_diff)
        return self.add(row)

    def read_plan(self, row: Row) -> None:
        """Fill the plan-derived columns: planning seconds, predicted step time and peak, stage forwards."""
        plan = row.plan() if callable(row.plan) else row.plan
        if plan is None:
            return
        row.plan = plan
        try:
            row.planning_s = C.model_plan_seconds(plan)
            row.predicted_step_s = float(plan.predicted_step_time)
            row.predicted_peak_bytes = int(plan.predicted_peak_bytes)
            sched = plan.chain.schedule if hasattr(plan, "chain") else plan.schedule
            row.forwards = int(sum(sched.forward_counts()))
        except Exception as err:  # the plan's layout changed
            self.notes.append(f"{row.method} {row.setting}: plan fields unavailable ({err})")

    # ---- methods

    def plain(self) -> Row:
        wl = self.wl
        row = Row(wl.name, "no checkpointing", "plain autograd", "plain", step=lambda: wl.run(wl.model),
                  params=self.params, forwards=wl.n_stages)
        return self.prepare(row)

    def hf(self) -> None:
        wl = self.wl
        if wl.kind != "gpt2":
            return
        m = copy.deepcopy(wl.model)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        n_layer = len(m.transformer.h)
        self.prepare(Row(wl.name, "HF gradient_checkpointing_enable", "every decoder block, use_reentrant=False",
                         "hf", step=lambda: wl.run(m), params=C.params_of(m), forwards=wl.n_stages + n_layer))

    def segment_counts(self) -> list[int]:
        n = self.wl.n_stages
        if self.args.segments not in ("auto", "all"):
            return sorted({int(k) for k in self.args.segments.split(",") if 2 <= int(k) <= n})
        if self.args.quick and self.wl.kind == "gpt2":
            return sorted({2, n})
        if self.args.segments == "all" or self.wl.kind == "sequential" or n <= 8:
            return list(range(2, n + 1))
        return sorted({k for k in (2, 3, 4, 7, n) if k <= n})

    def segments(self) -> None:
        wl = self.wl
        for k in self.segment_counts():
            if wl.kind == "sequential":
                from torch.utils.checkpoint import checkpoint_sequential

                size = wl.n_stages // k
                step = functools.partial(
                    lambda k: loss_of(checkpoint_sequential(wl.model, k, wl.x, use_reentrant=False)).backward(), k)
                self.prepare(Row(wl.name, "torch checkpoint_sequential", f"segments={k}", "segments", step=step,
                                 params=self.params, forwards=wl.n_stages + size * (k - 1)))
            else:
                method = "torch-style segments (hierremat runtime)"
                try:
                    mod = hierremat.remat(wl.model, (wl.x,), wl.kwargs, budget="100GiB",
                                          settings=hierremat.Settings(strategy=f"segments={k}", variants=False))  # torch's segments run the model's own operators
                except Exception as err:
                    self.skip(method, f"segments={k}", "segments", f"{type(err).__name__}: {err}", "failed")
                    continue
                self.prepare(Row(wl.name, method, f"segments={k}", "segments", step=functools.partial(wl.run, mod),
                                 params=self.params, plan=lambda mod=mod: mod.plans[0]))

    def sac(self) -> None:
        wl = self.wl
        method = "selective AC (save matmul/conv outputs)"
        if wl.kind == "gpt2":
            m = copy.deepcopy(wl.model)
            for i, block in enumerate(m.transformer.h):
                m.transformer.h[i] = SelectiveCheckpoint(block)
            params, setting = C.params_of(m), "per decoder block"
        else:
            m = nn.Sequential(*[SelectiveCheckpoint(c) for c in wl.model])  # shares the parameters
            params, setting = self.params, "per Sequential child"
        self.prepare(Row(wl.name, method, setting, "sac", step=lambda: wl.run(m), params=params))

    def compile(self) -> None:
        wl = self.wl
        method = "torch.compile + activation_memory_budget"
        budgets = [float(b) for b in self.args.compile_budgets.split(",") if b.strip()]
        if not budgets:
            self.skip(method, "-", "compile", self.args.compile_skip_reason or "no --compile-budgets")
            return
        try:
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            # cold compiles (no FX-graph/AOT caches from earlier runs): comparable, reproducible compile times
            inductor_config.force_disable_caches = not self.args.compile_cache
        except Exception as err:
            self.skip(method, "-", "compile", f"torch.compile unavailable: {err}", "failed")
            return
        timed_out = ""
        for b in budgets:
            setting = f"activation_memory_budget={b:g}"
            if time.perf_counter() - self.started > self.args.compile_deadline:
                self.skip(method, setting, "compile", f"compile deadline ({self.args.compile_deadline:.0f} s into "
                          "this model) reached")
                continue

            def fwd(*a, **k):
                return wl.model(*a, **k)

            # a code object of its own per budget: Dynamo caches compiled code per code object, and the budget is
            # not part of its guards, so sharing one would reuse the first budget's graph. fullgraph=True for the
            # same reason: after a graph break the model's own frames would be compiled, and shared by all budgets
            fwd.__code__ = fwd.__code__.replace(co_name=f"fwd_budget_{str(b).replace('.', '_')}")
            compiled = torch.compile(fwd, fullgraph=True)

            def step(compiled=compiled, b=b):
                with functorch_config.patch(activation_memory_budget=b):
                    wl.run(compiled)

            row = self.prepare(Row(wl.name, method, setting, "compile", step=step, params=self.params, compiled=True),
                               guard=self.args.compile_timeout)
            timeout = self.args.compile_timeout
            if row.status == "ok" and row.first_step_s <= timeout:
                row.compile_s = row.first_step_s
            elif "TimeoutError" in row.reason or row.first_step_s >= 0.98 * timeout:
                # the alarm interrupted the compile (Inductor may swallow it or re-raise it as another error): the
                # compiled function and Inductor's compile workers may be left unusable, so stop compiling here
                row.status, row.step = "skipped", None
                row.reason = f"compile took over --compile-timeout {timeout:g} s" + (f" ({row.reason})" if row.reason
                                                                                     else "")
                timed_out = setting
            if timed_out:
                for b2 in budgets[budgets.index(b) + 1:]:
                    self.skip(method, f"activation_memory_budget={b2:g}", "compile",
                              f"not compiled: the compile at {timed_out} timed out")
                break

    # ---- hierremat

    def hierremat_runner(self, extra: dict):
        """(make(budget_bytes) -> (step, plan getter), plan_at(budget_str)) for this model's kind."""
        wl = self.wl
        if wl.kind == "gpt2":
            def make(b):
                mod = hierremat.remat(wl.model, (wl.x,), wl.kwargs, budget=f"{b}B",  # (with its block options, timed)
                                      **_whole_model_options(extra, defer_block_options=False))
                return functools.partial(wl.run, mod), (lambda: mod.plans[0])

            def plan_at(budget):
                return hierremat.plan(wl.model, (wl.x,), wl.kwargs, budget=budget, **_whole_model_options(extra))
        else:
            from hierremat.api.sequential import PlanCache, as_stages

            def make(b):
                def step():
                    loss_of(hierremat.checkpoint_sequential(wl.model, f"{b}B", wl.x, **extra)).backward()

                def plan():
                    from hierremat.dp.solve import DEFAULT_SLOTS

                    entry = hierremat.plan_cache.get(PlanCache.key(as_stages(wl.model), wl.x, b, DEFAULT_SLOTS))
                    return entry.plan if entry is not None else None

                return step, plan

            def plan_at(budget):
                return hierremat.plan_sequential(wl.model, budget, wl.x, **extra)
        return make, plan_at

    def budgets(self, plain: Row) -> tuple[list[tuple[int, str]], int | None]:
        """hierremat budgets (bytes, why) and the smallest feasible budget."""
        _, plan_at = self.hierremat_runner({})
        try:
            t0 = time.perf_counter()
            min_b = C.smallest_feasible_budget(plan_at)
            log.info("  smallest feasible hierremat budget %.2f MiB (%.1f s)", min_b / MIB, time.perf_counter() - t0)
            self.notes.append(f"hierremat's smallest feasible budget (InfeasibleBudgetError.min_budget_bytes when "
                              f"asked for 1 KiB): {min_b} B = {min_b / MIB:.2f} MiB")
        except Exception as err:
            self.notes.append(f"smallest feasible budget unknown: {type(err).__name__}: {err}")
            min_b = None
        cands: list[tuple[int, str]] = []
        for r in self.rows:
            if r.status == "ok" and r.family not in ("plain",) and r.peak_bytes:
                cands.append((r.peak_bytes, f"= {tag(r)} peak"))
        lo = min_b or max(plain.peak_bytes // 4, 1 << 20)
        hi = plain.peak_bytes
        n = self.args.between
        between = [(int(lo * (hi / lo) ** (i / (n + 1))), "between") for i in range(1, n + 1)] if hi > lo else []
        if self.args.quick:  # two budgets: the smallest feasible and one baseline's peak (or the midpoint)
            fits = [c for c in cands if (min_b is None or c[0] >= min_b) and c[0] < hi]
            second = max(fits) if fits else (int(math.sqrt(lo * hi)), "between")
            chosen = ([(min_b, "smallest feasible")] if min_b else []) + [second]
        else:
            chosen = ([(min_b, "smallest feasible")] if min_b else []) + cands + between
        out: list[tuple[int, str]] = []
        for b, why in chosen:  # merge budgets within 0.5 % of one already chosen
            same = next((i for i, (ob, _) in enumerate(out) if abs(ob - b) <= 0.005 * ob), None)
            if same is None:
                out.append((b, why))
            else:
                out[same] = (out[same][0], out[same][1] + "; " + why)
        out.sort()
        if len(out) > self.args.max_budgets:
            self.notes.append(f"{len(out)} hierremat budgets, kept the {self.args.max_budgets} smallest")
            out = out[: self.args.max_budgets]
        return out, min_b

    def hierremat_rows(self, budgets: list[tuple[int, str]], min_b: int | None) -> None:
        wl = self.wl
        families = [("hierremat", {}, "hierremat")] + [(label, extra, "hierremat-config")
                                                         for label, extra in HIERREMAT_CONFIGS]
        if self.args.configs is not None:  # the default row and the configurations named
            families = [f for f in families if f[2] == "hierremat" or any(c in f[0] for c in self.args.configs)]
        api = hierremat.remat if wl.kind == "gpt2" else hierremat.checkpoint_sequential
        api_params = set(inspect.signature(api).parameters)
        if wl.kind == "gpt2":  # (remat's options are hr.Settings' fields)
            api_params |= {f.name for f in dataclasses.fields(hierremat.Settings)}
        for method, extra, family in families:
            missing = [k for k in extra if k not in api_params]
            if extra.get("segmentation") == "none" and wl.name not in WHOLE_GRAPH_MODELS:
                self.skip(method, "segmentation='none'", family, "small models only (the whole-graph ILP grows with "
                          f"the model; run on {', '.join(WHOLE_GRAPH_MODELS)})")
                continue
            if extra.get("compile") and self.args.quick:
                self.skip(method, "compile=True", family, "--quick: not compiled (Inductor takes tens of seconds)")
                continue
            if missing:
                self.skip(method, ", ".join(f"{k}={v!r}" for k, v in extra.items()), family,
                          f"not yet available: hierremat.{api.__name__} has no {'/'.join(missing)}= argument")
                continue
            make, plan_at = self.hierremat_runner(extra)
            queue, retried = list(budgets), False
            family_min = min_b
            if any(k in extra for k in LOWER_MINIMUM_CONFIGS):
                try:
                    family_min = C.smallest_feasible_budget(plan_at)
                    self.notes.append(f"{method}: smallest feasible budget {family_min} B = {family_min / MIB:.2f} MiB")
                    lower = [(family_min, "smallest feasible with " + ", ".join(f"{k}={v!r}" for k, v in extra.items()))]
                    if min_b is not None and min_b > family_min:  # and between it and the default's minimum
                        n = self.args.between
                        lower += [(int(family_min * (min_b / family_min) ** (i / (n + 1))), "between the minimums")
                                  for i in range(1, n + 1)]
                    queue[:0] = lower
                except Exception as err:
                    self.notes.append(f"{method}: smallest feasible budget unknown: {type(err).__name__}: {err}")
            while queue:
                b, why = queue.pop(0)
                setting = f"budget {b / MIB:.2f} MiB ({why})"
                if family_min is not None and b < family_min:
                    self.skip(method, setting, family, f"below the smallest feasible budget {family_min / MIB:.2f} MiB",
                              budget_bytes=b)
                    continue
                if time.perf_counter() - self.started > self.args.plan_deadline:
                    self.skip(method, setting, family, f"planning deadline ({self.args.plan_deadline:.0f} s into "
                              "this model) reached", budget_bytes=b)
                    continue
                try:
                    step, plan = make(b)
                except TypeError as err:
                    self.skip(method, setting, family, f"not available: TypeError: {err}")
                    break
                except Exception as err:
                    self.skip(method, setting, family, f"{type(err).__name__}: {err}", "failed", budget_bytes=b)
                    continue
                # compiled code allocates outside the tracker's view: measured with the CPU allocator's events
                row = self.prepare(Row(wl.name, method, setting, family, budget_bytes=b, step=step,
                                       params=self.params, plan=plan, compiled=bool(extra.get("compile"))))
                if row.status == "ok":
                    row.within_budget = row.peak_bytes <= b
                elif isinstance(row.error, InfeasibleBudgetError) and not retried:
                    # planned, then infeasible when it re-planned for how the step used the output (warm-up): add,
                    # once, the smallest budget that re-plan says it needs (its budget excludes shared values)
                    need = row.error.min_budget_bytes + max(0, b - row.error.budget_bytes)
                    if need > max(x for x, _ in budgets):
                        queue.append((need, "smallest feasible after re-planning"))
                        retried = True

    # ---- timing and ratios

    def time_rows(self) -> None:
        rows = [r for r in self.rows if r.status == "ok" and r.step is not None]
        deadline = self.started + self.args.time_deadline if self.args.time_deadline else None
        t0 = time.perf_counter()

        def run(row, r):
            torch.manual_seed(r)
            row.times.append(C.timed_step(row.step, row.params, self.device))

        def after(r):
            log.info("  round %d/%d done (%.0f s)", r + 1, self.rounds, time.perf_counter() - t0)

        done = C.interleave(rows, self.rounds, SEED, run, after, deadline)
        self.rounds_done = done
        if done < self.rounds:
            self.notes.append(f"only {done} of {self.rounds} timing rounds: time deadline reached")
        plain = self.rows[0]
        for r in rows:
            r.median_s = C.median(r.times)
        for r in self.rows:
            if r.status != "ok":
                continue
            base = plain.alloc_peak_bytes if r.peak_meter == "allocator" else plain.peak_bytes
            r.peak_ratio = r.peak_bytes / base if base else None
            r.time_ratio = r.median_s / plain.median_s if plain.median_s and r.median_s else None

    def run(self) -> dict:
        wl, args = self.wl, self.args
        log.info("[%s] %s", wl.name, wl.description)
        plain = self.plain()
        if plain.status != "ok":
            raise RuntimeError(f"plain autograd failed on {wl.name}: {plain.reason}")
        if "hf" in args.methods:
            self.hf()
        if "segments" in args.methods:
            self.segments()
        if "sac" in args.methods:
            self.sac()
        if "compile" in args.methods:
            self.compile()
        if "hierremat" in args.methods:
            budgets, min_b = self.budgets(plain)
            self.hierremat_rows(budgets, min_b)
        log.info("[%s] timing %d methods x %d rounds", wl.name, sum(r.status == "ok" for r in self.rows), self.rounds)
        self.time_rows()
        return {
            "name": wl.name,
            "kind": wl.kind,
            "description": wl.description,
            "n_stages": wl.n_stages,
            "rounds": self.rounds_done,
            "plain_peak_bytes": plain.peak_bytes,
            "plain_alloc_peak_bytes": plain.alloc_peak_bytes,
            "plain_median_s": plain.median_s,
            "seconds": time.perf_counter() - self.started,
            "notes": self.notes,
            "rows": [r.to_dict() for r in self.rows],
        }


# --------------------------------------------------------------------------------------------
# report


def render(results: dict, plot_paths: dict[str, Path], doc_dir: Path) -> str:
    """The Markdown report of one run; plots (paths) are embedded as images relative to ``doc_dir``,
    the folder the report is written to."""
    meta = results["meta"]

    def image(title: str, path: Path) -> str:
        return f"![{title}]({os.path.relpath(path, doc_dir)})"

    lines = [
        f"Machine: {meta['device_name']} ({meta['device']}, {meta['cpu_count']} CPUs, {meta['torch_threads']} torch "
        f"threads); torch {meta['torch']}, transformers {meta.get('transformers', '-')}, hierremat {meta['hierremat']} "
        f"({meta['revision']}).",
        "",
        f"Command: `{meta['command']}` (median of interleaved rounds; total {meta['seconds']:.0f} s).",
        "",
        ("Peak = bytes of the tensors created during one step and alive at once (parameters, inputs and "
         "preallocated `.grad` not counted; hierremat's live-tensor tracker on CPU). torch.compile rows: CPU "
         "allocator peak from `torch.profiler` (the tracker cannot see inside compiled code), ratio to plain's "
         "allocator peak. " if meta["device"] == "cpu" else
         "Peak = `torch.cuda.max_memory_allocated` during one step above what was allocated before it "
         "(parameters, inputs and preallocated `.grad` not counted), every method alike. ") +
        "Ratios are to no checkpointing. *plan/compile s*: hierremat capture+profile+solve, or "
        "torch.compile's first step. *pred. step s*: hierremat's deterministic prediction from profiled op costs. "
        "*fwd*: stage forwards per step. *grad diff*: max |grad - plain grad| over all parameters, same seed.",
    ]
    for m in results["models"]:
        lines += ["", f"**{m['name']}**: {m['description']}. Plain: peak {m['plain_peak_bytes'] / MIB:.1f} MiB, "
                      f"step {C.fmt(m['plain_median_s'], '.3f')} s; {m['rounds']} rounds.", ""]
        header = ["method", "setting", "peak / plain", "time / plain", "peak MiB", "step s", "alloc MiB",
                  "plan/compile s", "pred. step s", "fwd", "grad diff", "notes"]
        rows = []
        for r in m["rows"]:
            if r["status"] != "ok":
                reason = r["reason"] if len(r["reason"]) <= 160 else r["reason"][:157] + "..."
                rows.append([r["method"], r["setting"]] + [""] * 9 + [f"{r['status']}: {reason}"])
                continue
            note = []
            if r["peak_meter"] == "allocator":
                note.append("allocator meter")
            if r["family"] == "compile":
                note.append("Inductor's dropout RNG: grad diff not comparable")
            if r["within_budget"] is False:
                note.append("**over budget**")
            ps = r["planning_s"] if r["planning_s"] is not None else r["compile_s"]
            rows.append([
                r["method"], r["setting"], C.fmt(r["peak_ratio"], ".3f"), C.fmt(r["time_ratio"], ".3f"),
                C.fmt(r["peak_bytes"] / MIB), C.fmt(r["median_s"], ".3f"),
                C.fmt(r["alloc_peak_bytes"] and r["alloc_peak_bytes"] / MIB), C.fmt(ps, ".1f"),
                C.fmt(r["predicted_step_s"], ".3f"), C.fmt(r["forwards"], "d"),
                C.fmt(r["grad_max_abs_diff"], ".1e"), "; ".join(note),
            ])
        lines.append(C.markdown_table(header, rows, "ll" + "r" * 9 + "l"))
        if m["notes"]:
            lines += [""] + [f"- note: {n}" for n in m["notes"]]
        if m["name"] in plot_paths:
            lines += ["", image(f"{m['name']}: peak against step time", plot_paths[m["name"]])]
    if "planning" in plot_paths:
        lines += ["", image("planning and compile time per method", plot_paths["planning"])]
    return "\n".join(lines) + "\n"


STYLES = {
    "plain": ("black", "s", "no checkpointing"),
    "hf": ("tab:red", "D", "HF checkpointing"),
    "segments": ("tab:orange", "o", "uniform segments"),
    "sac": ("tab:purple", "P", "selective AC"),
    "compile": ("tab:green", "v", "torch.compile budget (allocator meter)"),
    "hierremat": ("tab:blue", "^", "hierremat"),
    "hierremat-config": ("tab:cyan", "x", "hierremat configurations"),
}


def short_label(r: dict) -> str:
    if r["family"] == "compile":
        return f"torch.compile, budget {r['setting'].split('=')[-1]}"
    if r["family"].startswith("hierremat") and r["budget_bytes"]:
        return f"{r['method'][:40]}, {r['budget_bytes'] / MIB:.1f} MiB"
    return f"{r['method'][:40]}, {r['setting'][:24]}"


def plot(results: dict, out: Path, stem: str) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}

    for m in results["models"]:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for fam, (color, marker, label) in STYLES.items():
            ok = [r for r in m["rows"] if r["family"] == fam and r["status"] == "ok" and r["median_s"]]
            # one line per hierremat configuration (a family holds several); other families as points
            groups = sorted({r["method"] for r in ok}) if fam == "hierremat-config" else [None]
            for g, shade in zip(groups, (color, "tab:gray", "tab:olive", "tab:pink")):
                rs = sorted((r for r in ok if g is None or r["method"] == g), key=lambda r: r["peak_bytes"])
                if not rs:
                    continue
                ax.plot([r["peak_bytes"] / MIB for r in rs], [r["median_s"] for r in rs], marker=marker,
                        color=shade, label=label if g is None else g.removeprefix("hierremat, "),
                        linestyle="-" if fam.startswith("hierremat") and len(rs) > 1 else "none",
                        markersize=7, alpha=0.9)
        ax.set_xlabel("measured peak MiB (above parameters)")
        ax.set_ylabel("median step s")
        ax.set_title(f"{m['name']}: memory vs time ({results['meta']['device']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"{stem}_{m['name']}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths[m["name"]] = p.resolve()

    bars = []
    for m in results["models"]:
        for r in m["rows"]:
            s = r["planning_s"] if r["planning_s"] is not None else r["compile_s"]
            if r["status"] == "ok" and s is not None:
                bars.append((f"{m['name']}: {short_label(r)}", s, r["family"]))
    if bars:
        fig, ax = plt.subplots(figsize=(9, 0.28 * len(bars) + 1.2))
        ax.barh(range(len(bars)), [b[1] for b in bars], color=[STYLES.get(b[2], ("grey",))[0] for b in bars])
        ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
        ax.invert_yaxis()
        values = [b[1] for b in bars if b[1] > 0]
        if values and max(values) / min(values) > 50:
            ax.set_xscale("log")
        ax.set_xlabel("planning (hierremat: capture+profile+solve) / compile (first step) s")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        p = out / f"{stem}_planning.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths["planning"] = p.resolve()
    return paths


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(ALL_MODELS)} (default: all; "
                    "--quick: mlp; with --quick every model is built at a smaller size)")
    ap.add_argument("--methods", default="hf,segments,sac,compile,hierremat",
                    help="comma list of hf, segments, sac, compile, hierremat (plain always runs)")
    ap.add_argument("--configs", default=None, help="comma list of words: only the hierremat configurations whose "
                    "label contains one (e.g. 'outputs,compiled'; default: all), beside the default row")
    ap.add_argument("--quick", action="store_true", help="smoke test: one small model, 2 hierremat budgets, 2 rounds, "
                    "no torch.compile (unless --compile-budgets is given)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 5, 3 for gpt2-12; 2 with --quick)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default 2; 1 with --quick, "
                    "which runs while other work shares the cores)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--gpt2-batch", type=int, default=None, help="batch size of the GPT-2 models (default 2; "
                    "a GPU wants more to leave the launch-bound regime)")
    ap.add_argument("--segments", default="auto", help="segment counts: 'auto' (every K >= 2 for Sequential and "
                    "for up to 8 stages, else 2,3,4,7,L), 'all', or a comma list")
    ap.add_argument("--compile-budgets", default=None, help="activation_memory_budget values (default 1.0,0.5,0.1; "
                    "none with --quick); '' to skip")
    ap.add_argument("--compile-timeout", type=float, default=180, help="skip a torch.compile row whose first step "
                    "(compile included) takes longer than this many s")
    ap.add_argument("--compile-cache", action="store_true", help="let torch.compile use Inductor's on-disk caches "
                    "(default: disabled, so the compile time is a cold compile's)")
    ap.add_argument("--compile-deadline", type=float, default=900, help="no new torch.compile row after this many s "
                    "into a model")
    ap.add_argument("--between", type=int, default=2, help="extra hierremat budgets between the smallest feasible "
                    "one and the plain peak")
    ap.add_argument("--max-budgets", type=int, default=16, help="at most this many hierremat budgets per model")
    ap.add_argument("--plan-deadline", type=float, default=1200, help="no new hierremat budget after this many s "
                    "into a model")
    ap.add_argument("--time-deadline", type=float, default=2400, help="no new timing round after this many s into "
                    "a model")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR, help="output folder")
    ap.add_argument("--stem", default=None, help="output file stem (default run_all, run_all_quick with --quick)")
    ap.add_argument("--readme", action="store_true", help="rewrite docs/results.md (the full tables the README "
                    "links to) between <!-- results:start --> and <!-- results:end --> with the report")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--from-json", type=Path, nargs="+", help="run nothing: render the report of earlier runs' "
                    "JSON files (with --readme, into docs/results.md)")
    ap.add_argument("-v", "--verbose", action="store_true", help="hierremat INFO logs and tracebacks")
    args = ap.parse_args(argv)
    args.configs = None if args.configs is None else [c.strip() for c in args.configs.split(",") if c.strip()]
    args.models = [m.strip() for m in (args.models or ("mlp" if args.quick else ",".join(ALL_MODELS))).split(",")
                   if m.strip()]
    for m in args.models:
        if m not in ALL_MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(ALL_MODELS)}")
    args.methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if args.quick and args.rounds is None:
        args.rounds = 2
    args.threads = args.threads or (1 if args.quick else 2)
    args.compile_skip_reason = ""
    if args.compile_budgets is None:
        args.compile_budgets = "" if args.quick else "1.0,0.5,0.1"
        if args.quick:
            args.compile_skip_reason = ("skipped with --quick (compiling takes ~30 s per budget on 2 CPU cores); "
                                        "pass --compile-budgets to include")
    args.stem = args.stem or ("run_all_quick" if args.quick else "run_all")
    return args


#: The document ``--readme`` rewrites: the full tables, linked from README.md.
RESULTS_DOC = C.REPO_ROOT / "docs" / "results.md"


def rewrite_results_doc(report: str, doc: Path = RESULTS_DOC) -> None:
    new = C.replace_between_markers(doc.read_text(), report, "<!-- results:start -->", "<!-- results:end -->")
    if new is None:
        log.warning("%s has no <!-- results:start --> ... <!-- results:end --> markers: not changed", doc)
    else:
        doc.write_text(new)
        log.info("rewrote the results block of %s", doc)


def report_from_json(paths: list[Path], doc_dir: Path) -> str:
    """The Markdown report of earlier runs (their JSON files, plots found beside them), one after the other."""
    parts = []
    for path in paths:
        results = json.loads(path.read_text())
        stem = path.stem
        plots = {m["name"]: path.parent / f"{stem}_{m['name']}.png" for m in results["models"]}
        plots["planning"] = path.parent / f"{stem}_planning.png"
        parts.append(render(results, {k: v for k, v in plots.items() if v.exists()}, doc_dir))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(relativeCreated)7.0f ms] %(message)s")
    if args.from_json:
        paths = [p.resolve() for p in args.from_json]
        print(report_from_json(paths, paths[0].parent))
        if args.readme:
            rewrite_results_doc(report_from_json(paths, RESULTS_DOC.parent))
        return 0
    logging.getLogger("hierremat").setLevel(logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t_start = time.perf_counter()
    meta = C.device_info(device, args.threads)
    meta.update(command="python benchmarks/run_all.py " + " ".join(argv), quick=args.quick,
                methods=sorted(args.methods), hierremat_configs=[v[0] for v in HIERREMAT_CONFIGS])
    results = {"meta": meta, "models": []}
    for name in args.models:
        wl = build_workload(name, args.quick, device, args.gpt2_batch)
        results["models"].append(Bench(wl, args, device).run())
        del wl
        torch._dynamo.reset()
        hierremat.plan_cache.clear()
        gc.collect()
    meta["seconds"] = time.perf_counter() - t_start

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_paths: dict[str, str] = {}
    if not args.no_plots:
        try:
            plot_paths = plot(results, out, args.stem)
        except Exception as err:  # plots are optional
            log.warning("plotting failed: %s", err)
    report = render(results, plot_paths, out)
    (out / f"{args.stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{args.stem}.md").write_text("# hierremat: all methods, same models and budgets\n\n" + report)
    print(report)
    log.info("wrote %s, %s%s", out / f"{args.stem}.json", out / f"{args.stem}.md",
             "".join(f", {p}" for p in plot_paths.values()))
    if args.readme:
        rewrite_results_doc(render(results, plot_paths, RESULTS_DOC.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
