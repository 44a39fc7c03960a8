"""Dynamic padding: a training loop whose every batch has its own length (CPU, one run).

A collator with dynamic padding gives each batch the length of its longest row, so a run sees many
lengths. hierremat plans each new length: from the second on, from one symbolic capture specialized to
it (no trace) with the block menus solved at another length re-costed (no ILP solve).

The loop: GPT-2 (random weights, fp32, train mode, 4 layers, 256 wide, vocabulary 8192),
batch 4, ``--steps`` steps whose lengths are drawn from ``--lengths`` lengths evenly spaced over 64..512,
each batch dynamically padded (rows of random lengths up to the batch's, padding masked, labels -100),
AdamW, PyTorch's default ``optimizer.zero_grad()``. Methods, each on the same weights and batches:
  plain       eager autograd;
  hf          Hugging Face gradient checkpointing (``gradient_checkpointing_enable()``);
  hierremat   ``hierremat.remat`` at 0.5x plain's allocator peak at the longest length, planned at it (a batch
              padded as the loop's are) with a fresh cache, remat's defaults: the padded attention mask says the
              lengths will vary, so the model is captured symbolically at the first shape and its memory measured at
              three shorter lengths there too (no later length is measured); block options built once they pay
              (``defer_block_options``; ``--eager``: built at once, at the first shape).
  hierremat unpadded example   the same, planned at an unpadded batch of that length (nothing says the lengths
              will vary): the sizes that vary are captured symbolically at the second length; a cache of its own.
Steps are interleaved: at every step each method runs once, in a seeded shuffled order; before the loop, one step
of each at the longest length (each method's first step through its model, hierremat's through the plan remat made:
no loop length's first step is also that); a method's wall time is the sum of its steps, that one included
(hierremat's includes its planning). Per length: planning seconds (the plan's capture + profile + block options +
DP), the new length's whole cost to hierremat ("new-length s": its first step's wall time, the longest's (the step
before the loop) with the plan remat made, less a later step's: the symbolic capture, shapes measured to
fit from, the plan, the first run of generated code), the allocator-meter and live-tensor-tracker peaks of one extra
step (not timed) against the budget, the predicted and measured (median of STEADY_STEPS = 5 steps after the loop)
step time of the plan the length then runs ("planned/measured": as its first plan predicted it, from the times it was
planned with: fitted from other lengths, or of one run each; "predicted/measured": its plan then, solved again from its
own steps' times where they time it, hierremat.runtime.step_times), whether its block options were re-costed (at its first call: "yes", at a later
one, once its steps without them had lost what re-costing takes: "later", never: "no"), and whether every
gradient equals plain's bitwise at every step.

``--model gpt2-12``: 12-layer GPT-2 (768 wide, vocabulary 50257), lengths 160..256 instead (the 2 s per
new length at that size).

    python benchmarks/bench_shapes.py [--steps 36] [--lengths 12]
    python benchmarks/bench_shapes.py --model gpt2-12 --steps 8 --lengths 6
    python benchmarks/bench_shapes.py --warm        # the same loop, its cache filled by an earlier process
    python benchmarks/bench_shapes.py --eager       # the same loop, block options built at the first shape
    python benchmarks/bench_shapes.py --rss 500     # RSS, 500 distinct lengths (tiny GPT-2; --max-shapes, --plain)
    python benchmarks/bench_shapes.py --accuracy    # each length's first plan: predicted step and peak, measured
    python benchmarks/bench_shapes.py --accuracy --model gpt2-12 --lengths 6

``--warm``: a training script run a second time on the machine. The loop first runs in a child process that fills a
fresh cache (block menus, stage costs: hierremat.store.cache), then in this one with it; nothing else carries over
(the plans, the samples to fit from and the symbolic capture are per process).

Writes benchmarks/results/bench_shapes.md (``--model gpt2-12``: bench_shapes_gpt2-12.md; ``--warm``: with a ``_warm``
suffix, ``--eager``: ``_eager``; the ``--rss`` table to bench_shapes_rss.md, ``--accuracy``'s to
bench_shapes_accuracy.md).

``--accuracy`` ("on lengths never profiled, the fitted model predicts step time within 10% and peak at or
above the measured one"): hierremat alone, each length's first plan against that plan's own steps (run_accuracy),
the prediction's miss split in two: the same schedule priced with the stage times its own steps recorded
("predicted/own times": what the fit missed) and those over the measured step ("own times/measured": what a step
costs beyond its stages' ops); its steps measured twice, in a row and in ``--rounds`` interleaved rounds over every
length (the host's drift between lengths cancelled), and each fit made again from the interleaved rounds' medians
("quiet fit": the fit's own miss where its inputs are quiet); then how each stage's own time grows with the length.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import common as C
import hierremat as hr
from hierremat.api.settings import DEFAULT_MAX_SHAPES
from hierremat.api.step_retiming import STEP_SAMPLES, observed_times
from hierremat.device import LiveTensorTracker
from hierremat.plans.simulate import simulate

RSS_RESULTS = C.RESULTS_DIR / "bench_shapes_rss.md"
SEED = 1234
BATCH = 4
#: Steps timed per length after the loop, their median the measured step (this CPU: one step in three can be 30% off)
STEADY_STEPS = 5
#: Steps timed per length in run_accuracy (after one untimed), their median the measured step
ACCURACY_STEPS = 5
#: Rounds over every length in run_accuracy's interleaved phase (one step of each a round, in a shuffled order)
ACCURACY_ROUNDS = 7
#: --model: (layers, width, vocabulary, shortest length, longest length)
MODELS = {"gpt2-4": (4, 256, 8192, 64, 512), "gpt2-12": (12, 768, 50257, 160, 256)}


def _gpt2(n_layer: int, n_embd: int, vocab: int, positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=positions,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def padded_batch(length: int, vocab: int, seed: int) -> dict:
    """A dynamically padded batch: row lengths drawn up to ``length``, the longest exactly it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, length), generator=g)
    rows = torch.randint(length // 2, length + 1, (BATCH,), generator=g)
    rows[0] = length
    mask = (torch.arange(length)[None, :] < rows[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    seconds: float = 0.0
    step_seconds: dict = field(default_factory=dict)  # length -> [seconds of steps after its first]
    grads: list | None = None

    def step(self, batch: dict) -> float:
        started = time.perf_counter()
        self.optimizer.zero_grad()
        self.module(**batch).loss.backward()
        elapsed = time.perf_counter() - started
        self.grads = [p.grad for p in self.model.parameters()]
        self.optimizer.step()
        return elapsed


def _step_seconds(step, count: int) -> list[float]:
    """Wall seconds of each of ``count`` calls of ``step`` in a row."""
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return seconds


def _loop_lengths(steps: int, count: int, shortest: int = 64, longest: int = 512) -> list[int]:
    lengths = [shortest + round(i * (longest - shortest) / (count - 1)) for i in range(count)]
    schedule = [lengths[i % count] for i in range(steps)]
    random.Random(SEED).shuffle(schedule)
    return schedule


def _model_at_longest(model: str) -> tuple[torch.nn.Module, dict, int]:
    """(the seeded GPT-2 of ``--model``, a padded batch at its longest length, plain autograd's allocator peak
    there in bytes: what the budget is a share of)."""
    layers, width, vocab, _, high = MODELS[model]
    torch.manual_seed(SEED)
    base = _gpt2(layers, width, vocab, high)
    longest = padded_batch(high, vocab, SEED)
    probe = copy.deepcopy(base)
    return base, longest, C.allocator_peak_bytes(lambda: probe(**longest).loss.backward())


def run_loop(steps: int, count: int, cache: str, model: str = "gpt2-4", eager: bool = False) -> str:
    layers, width, vocab, low, high = MODELS[model]
    base, longest, plain_peak = _model_at_longest(model)
    schedule = _loop_lengths(steps, count, low, high)
    budget = plain_peak // 2
    methods = []
    for name in ("plain", "hf", "hierremat", "hierremat unpadded example"):
        model = copy.deepcopy(base)
        module = model
        if name == "hf":  # (transformers 5 renamed it; the old name warns)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        started = time.perf_counter()
        if name.startswith("hierremat"):  # a fresh cache (every block menu solved in this run), or one an earlier
            example = dict(longest)  # run filled
            if name == "hierremat unpadded example":  # (every row the full length: nothing says lengths vary)
                example.update(attention_mask=torch.ones_like(longest["input_ids"]), labels=longest["input_ids"])
            module = hr.remat(model, (), example, budget=budget,
                              settings=hr.Settings(cache=f"{cache}/{name.replace(' ', '-')}", defer_block_options=not eager))  # (a cache of its own: neither fills the other's)
        method = Method(name, model, module, torch.optim.AdamW(model.parameters(), lr=1e-4))
        method.seconds = time.perf_counter() - started  # hierremat's first plan
        methods.append(method)
    remats = methods[2:]
    planned = {m.name: m.seconds for m in remats}
    rng = random.Random(SEED)
    bitwise = True
    per_length: dict[int, dict] = {}

    def same_grads() -> bool:  # every hierremat method's gradients of the step just run, bitwise plain's
        return all(torch.equal(a, b) for remat in remats for a, b in zip(methods[0].grads, remat.grads))

    # one step of each method at the longest length first (counted in its wall time): the process's first step
    # through a model, and hierremat's through the plan remat made, so that no loop length's first step is also that
    warm = padded_batch(high, vocab, SEED - 1)
    for method in methods:
        torch.manual_seed(SEED - 1)
        elapsed = method.step(warm)
        method.seconds += elapsed
        if method in remats:
            per_length[method.name, high] = {"plan": method.module.plans[-1], "first": elapsed + planned[method.name]}
    bitwise &= same_grads()
    seen: set[int] = {high}
    for step, length in enumerate(schedule):
        batch = padded_batch(length, vocab, SEED + step)
        first = length not in seen
        seen.add(length)
        order = list(methods)
        rng.shuffle(order)
        first_step = {}
        for method in order:
            torch.manual_seed(step)  # dropout: the same masks for every method
            elapsed = method.step(batch)
            method.seconds += elapsed
            if not first:
                method.step_seconds.setdefault(length, []).append(elapsed)
            elif method in remats:
                first_step[method.name] = elapsed
        bitwise &= same_grads()
        for remat in remats if first else ():
            per_length[remat.name, length] = {"plan": remat.module.plans[-1], "first": first_step[remat.name]}
    for (name, length), row in per_length.items():  # one extra step per length, measured, not timed
        batch = padded_batch(length, vocab, SEED)
        remat = next(m for m in remats if m.name == name)

        def step():
            remat.optimizer.zero_grad()
            remat.module(**batch).loss.backward()

        for _ in range(20):  # (until the length runs the plan it keeps: block options re-costed, where they will be)
            step()
            if not next(reversed(remat.module._planned.values())).block_gain:
                break
        row["alloc"] = C.allocator_peak_bytes(step)
        with LiveTensorTracker() as tracker:
            step()
        row["tracker"] = tracker.peak_bytes
        row["final"] = remat.module.plans[-1]  # (the plan this length runs now: block options re-costed since?)
        row["steady"] = statistics.median(_step_seconds(step, STEADY_STEPS))
        remat.optimizer.zero_grad()
    hf_seconds = methods[1].seconds
    summary = C.markdown_table(
        ["method", f"wall s ({steps} + 1 steps incl. planning)", "x hf", "x plain"],
        [[m.name, C.fmt(m.seconds, ".1f"), C.fmt(m.seconds / hf_seconds, ".2f"),
          C.fmt(m.seconds / methods[0].seconds, ".2f")] for m in methods],
    )
    rows = []
    for name, length in sorted(per_length):
        row = per_length[name, length]
        plan, final = row["plan"], row["final"]
        remat = next(m for m in remats if m.name == name)
        measured = statistics.median(remat.step_seconds.get(length, [float("nan")]))
        plan_seconds = plan.capture_seconds + plan.chain.profile_seconds + plan.options_seconds + plan.chain.solve_seconds
        rows.append([
            name, str(length), plan.capture_kind, _fitted(plan.times), "later" if final.menus and not plan.menus else
            ("yes" if plan.menus else "no"),
            str(plan.options_solves), C.fmt(plan_seconds, ".2f"), C.fmt(row["first"] - measured, ".2f"),
            C.fmt(row["alloc"] / C.MIB), C.fmt(row["tracker"] / C.MIB), C.fmt(row["alloc"] / budget, ".3f"),
            C.fmt(final.predicted_peak_bytes / C.MIB), C.fmt(final.predicted_step_time * 1e3, ".0f"),
            C.fmt(row["steady"] * 1e3, ".0f"), C.fmt(plan.predicted_step_time / row["steady"], ".2f"),
            C.fmt(final.predicted_step_time / row["steady"], ".2f"),
        ])
    detail = C.markdown_table(
        ["method", "length", "capture", "costs", "block options", "ILP solves", "plan s", "new-length s", "alloc peak MiB",
         "tracker MiB", "peak/budget", "predicted MiB", "predicted ms", "measured ms", "planned/measured",
         "predicted/measured"], rows,
    )
    return (f"GPT-2 {layers} layers, {width} wide, vocabulary {vocab}, batch {BATCH}; "
            f"budget {budget / C.MIB:.1f} MiB = 0.5 x plain's allocator peak at {high} ({plain_peak / C.MIB:.1f} MiB); "
            f"lengths {sorted(set(schedule))}; gradients bitwise equal to plain's at every step: {bitwise}\n\n"
            f"{summary}\n\n{detail}")


def _fitted(times: str) -> str:
    """What of a plan's costs was fitted (ModelPlan.times): "measured", "times fitted", "times+memory fitted"
    (every stage's memory too) or "times+memory fitted but s5" (stage 5's memory measured)."""
    if times.startswith("measured"):
        return "measured"
    if not times.startswith("times and memory"):
        return "times fitted"
    if "the memory of stage(s)" in times:
        stages = times.split("the memory of stage(s) ")[1].split(" measured")[0]
        return f"times+memory fitted but s{stages}"
    return "times+memory fitted"


def run_accuracy(count: int, cache: str, model: str = "gpt2-4", rounds: int = ACCURACY_ROUNDS) -> str:
    """Each length's first plan (its costs fitted from the lengths run before it, or measured) against that same
    plan's steps: its predicted step time and peak over the measured step and the allocator's peak. hierremat alone
    in the process, remat's defaults, planned at the longest length padded (as run_loop's "hierremat"). Two phases:

    1. the lengths of run_loop's schedule in its order, each run ACCURACY_STEPS + 1 times in a row (its first step
       untimed: the first run of its generated code) by the orchestrator its first call got, so that no step runs a
       plan made again at the length (solved again from its own steps, block options built or re-costed); the fit of
       each length is made from the steps of the lengths before it, as in a training loop;
    2. ``rounds`` rounds over every length in a seeded shuffled order, one step each through the same orchestrators,
       each stage's times recorded (hierremat.runtime.step_times): per length the median step over the rounds
       ("interleaved": the host's drift between lengths cancelled), and the fit of phase 1 made again from these
       rounds' stage times at the same lengths it had ("quiet fit": how far a fit over 1, n and n * s is from a
       length's own times where its inputs are medians of interleaved rounds, not a few steps in a row)."""
    layers, width, vocab, low, high = MODELS[model]
    base, longest, plain_peak = _model_at_longest(model)
    budget = plain_peak // 2
    module = hr.remat(base, (), dict(longest), budget=budget, settings=hr.Settings(cache=cache))
    order = list(dict.fromkeys([high, *_loop_lengths(count * 3, count, low, high)]))
    runs, rows, fitted_ratios = {}, [], []
    for i, length in enumerate(order):
        batch = padded_batch(length, vocab, SEED + i)
        before = {family: list(samples) for family, samples in module._families.samples.items()}  # (as this plan had them)
        _, kwargs = module._orchestrator((), dict(batch))  # (the plan this length's first call gets)
        plan = module.plans[-1]
        compiled = next(reversed(module._planned.values()))
        profiled = before.get(compiled.family, [])

        def step(compiled=compiled, kwargs=kwargs):
            base.zero_grad()  # (PyTorch's default: gradients made in the step)
            compiled.orchestrator()(**kwargs).loss.backward()  # (the orchestrator set to run this plan's chain)

        step()
        seconds = _step_seconds(step, ACCURACY_STEPS)
        recorder = compiled.chain_module.planned.step_times  # (the meter's step, slower under its profiler: not timed)
        wanted, recorder.wanted = recorder.wanted, min(recorder.wanted, recorder.steps)
        peak = C.allocator_peak_bytes(step)
        recorder.wanted = wanted
        runs[length] = {"step": step, "plan": plan, "compiled": compiled, "seconds": seconds, "profiled": profiled,
                        "peak": peak, "own": observed_times(compiled)}
    # phase 2: every length's stages timed afresh, over interleaved rounds
    for run in runs.values():
        planned = run["compiled"].chain_module.planned
        planned.step_times = None
        planned.time_steps(rounds)
        run["interleaved"] = []
    rng = random.Random(SEED)
    for _ in range(rounds):
        for length in rng.sample(order, len(order)):
            runs[length]["interleaved"] += _step_seconds(runs[length]["step"], 1)
    quiet = {length: observed_times(run["compiled"]) for length, run in runs.items()}
    base.zero_grad()
    for i, length in enumerate(order):
        run = runs[length]
        plan, compiled = run["plan"], run["compiled"]
        schedule, costs = plan.chain.schedule, plan.chain.costs
        measured = statistics.median(run["seconds"])
        interleaved = statistics.median(run["interleaved"])

        def priced(times) -> float:
            return simulate(costs.with_step_times(times), schedule).time  # (as the plan is solved again from them)

        own, own_quiet = priced(run["own"]), priced(quiet[length])
        quiet_fit = _quiet_fit(run["profiled"], [(runs[n]["compiled"], quiet[n]) for n in order[:i]], compiled, costs)
        quiet_seconds = simulate(quiet_fit, schedule).time if quiet_fit is not None else None
        fitted = not plan.times.startswith("measured")
        if fitted:
            fitted_ratios.append((plan.predicted_step_time / measured, plan.predicted_step_time / interleaved,
                                  quiet_seconds / interleaved if quiet_seconds else None,
                                  quiet_seconds / own_quiet if quiet_seconds else None))
        rows.append([str(length), _fitted(plan.times), C.fmt(plan.predicted_step_time * 1e3, ".0f"),
                     C.fmt(measured * 1e3, ".0f"), C.fmt(plan.predicted_step_time / measured, ".2f"),
                     C.fmt(plan.predicted_step_time / own, ".2f"), C.fmt(own / measured, ".2f"),
                     C.fmt(interleaved * 1e3, ".0f"), C.fmt(plan.predicted_step_time / interleaved, ".2f"),
                     C.fmt(quiet_seconds / interleaved, ".2f") if quiet_seconds and fitted else "",
                     C.fmt(quiet_seconds / own_quiet, ".2f") if quiet_seconds and fitted else "",
                     C.fmt(own_quiet / interleaved, ".2f"),
                     C.fmt(plan.predicted_peak_bytes / C.MIB), C.fmt(run["peak"] / C.MIB),
                     C.fmt(plan.predicted_peak_bytes / run["peak"], ".3f"), C.fmt(run["peak"] / budget, ".3f")])
    table = C.markdown_table(
        ["length", "costs", "predicted ms", "in a row: measured ms", "predicted/measured", "predicted/own times",
         "own times/measured", "interleaved: measured ms", "predicted/measured", "quiet fit/measured",
         "quiet fit/own times", "own times/measured", "predicted peak MiB", "alloc peak MiB",
         "predicted/measured peak", "peak/budget"], rows)
    # how each stage's own time (forward + backward under autograd, over the interleaved rounds) grows with the
    # length, over the longest's, beside the tokens' ratio and its square (a time linear in the tokens, a time
    # all attention): what a fit over 1, n and n * s has to follow
    stage_times = {n: [fwd + bwd for _, fwd, bwd in quiet[n]] for n in order}
    blocks = range(1, len(stage_times[high]) - 1)
    growth = C.markdown_table(
        ["length", "tokens / longest's", "(tokens / longest's)^2", "block stages' time / longest's",
         "LM head stage's time / longest's"],
        [[str(n), C.fmt(n / high, ".2f"), C.fmt((n / high) ** 2, ".2f"),
          " ".join(C.fmt(stage_times[n][i] / stage_times[high][i], ".2f") for i in blocks),
          C.fmt(stage_times[n][-1] / stage_times[high][-1], ".2f")] for n in sorted(stage_times)])
    lines = []
    for k, what in enumerate(("predicted over the steps in a row", "predicted over the interleaved steps",
                              "the quiet fit over the interleaved steps", "the quiet fit over its own times")):
        ratios = [r[k] for r in fitted_ratios if r[k] is not None]
        if ratios:
            lines.append(f"- {what}: {sum(abs(r - 1) <= 0.10 for r in ratios)} of {len(ratios)} within 10% "
                         f"({min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f})")
    return (f"GPT-2 {layers} layers, {width} wide, vocabulary {vocab}, batch {BATCH}; budget {budget / C.MIB:.1f} MiB "
            f"= 0.5 x plain's allocator peak at {high}; hierremat alone, remat's defaults, planned at {high} padded; "
            f"lengths in the loop's order. Each length's first plan (predicted) over: the median of its "
            f"{ACCURACY_STEPS} steps in a row after its first (\"in a row\"), and the median of {rounds} steps in "
            f"rounds over every length in a shuffled order (\"interleaved\"); \"own times\": the same schedule priced "
            f"with the stage times those steps recorded; \"quiet fit\": the fit the length was planned with, made "
            f"again from the interleaved rounds' stage times at the lengths it was fitted from\n\n{table}\n\n"
            + ("Fitted lengths:\n" + "\n".join(lines) + "\n\n" if lines else "No length fitted.\n\n")
            + f"Each stage's own time over the longest length's (medians of the interleaved rounds):\n\n{growth}")


def _quiet_fit(profiled: list, before: list, compiled, costs):
    """The stage costs a length's fit would give (hierremat.planning.shape_fit.ShapeFit, as its first plan was
    fitted: from the family's ``profiled`` samples as they were when it was planned and the lengths timed before it,
    at most STEP_SAMPLES of them as there), its lengths' stage times those of the interleaved rounds (``before``:
    (PlannedShape, their stage times) of each length run before it); None where no fit takes the length (a length
    measured has no fit either: the caller skips those)."""
    from hierremat.planning.shape_fit import ShapeFit, ShapeSample, add_sample, chain_pattern

    if compiled.bindings is None:
        return None
    pattern = chain_pattern([info.signature for info in compiled.chain.infos])
    steps: list = []
    for shape, times in before:
        if shape.bindings is not None and times is not None:
            add_sample(steps, ShapeSample.from_step_times(shape.bindings, pattern, times), STEP_SAMPLES)
    fit = ShapeFit.of([*profiled, *steps], compiled.bindings, pattern, reduced=True)
    return fit.stage_costs(costs) if fit is not None else None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _trimmed_rss_bytes() -> int | None:
    """RSS after a garbage collection and glibc's ``malloc_trim(0)`` (what the process holds, less the free memory
    its heap kept from the steps' tensors of other sizes); None without glibc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _rss_bytes()


def run_rss(count: int, max_shapes: int = DEFAULT_MAX_SHAPES, plain: bool = False) -> str:
    """RSS over ``count`` distinct lengths, one step each (``plain``: the model itself, no hierremat: what the steps'
    tensors of every size leave in the heap alone)."""
    torch.manual_seed(SEED)
    model = _gpt2(2, 64, 512, 1024)
    module = model if plain else hr.remat(model, (), padded_batch(8, 512, SEED), budget="64GiB",
                                          settings=hr.Settings(max_shapes=max_shapes))
    marks = sorted({1, *range(50, count + 1, 50), count})
    lengths = list(range(9, 9 + count))
    random.Random(SEED).shuffle(lengths)  # the longest steps early: what grows after is what planning keeps
    rows, started = [], time.perf_counter()
    base_rss = base_trimmed = None
    for i, length in enumerate(lengths, 1):
        module(**padded_batch(length, 512, SEED + i)).loss.backward()
        model.zero_grad()
        if i in marks:
            rss = _rss_bytes()
            trimmed = _trimmed_rss_bytes()
            objects = len(gc.get_objects())  # (counted, not kept: a list of them would keep every one alive)
            base_rss = base_rss or rss
            base_trimmed = base_trimmed or trimmed
            rows.append([str(i), C.fmt(rss / C.MIB, ".0f"), C.fmt((rss - base_rss) / C.MIB, ".0f"),
                         "n/a" if trimmed is None else C.fmt((trimmed - base_trimmed) / C.MIB, ".0f"),
                         str(objects), "" if plain else str(len(module.plans)),
                         C.fmt(time.perf_counter() - started, ".0f")])
    what = "plain autograd (no hierremat)" if plain else f"plans kept: max_shapes={module.max_shapes}"
    return (f"tiny GPT-2 (2 layers, 64 wide, vocabulary 512), batch {BATCH}, one step at each of {count} distinct lengths "
            f"9..{8 + count} in a shuffled order; {what}; growth from the first "
            "length's RSS, and after a garbage collection and glibc's malloc_trim (the heap's free memory returned: "
            "what the process holds; each mark's RSS is read before its trim, after the trims of the marks before it)\n\n"
            + C.markdown_table(["lengths seen", "RSS MiB", "growth MiB", "growth after trim MiB", "Python objects",
                                "plans kept", "elapsed s"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--lengths", type=int, default=12)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-4",
                        help="gpt2-12: 12-layer GPT-2 (768 wide, vocabulary 50257) over lengths 160..256 (the "
                        "2 s per new length); try --steps 8 --lengths 6")
    parser.add_argument("--warm", action="store_true",
                        help="the loop with a cache an earlier process filled running it (a script run again)")
    parser.add_argument("--eager", action="store_true",
                        help="block options built at once at the first shape (defer_block_options=False)")
    parser.add_argument("--fill-cache", metavar="DIR", help=argparse.SUPPRESS)  # (--warm's child: the loop, no table)
    parser.add_argument("--rss", type=int, help="instead: RSS over this many distinct lengths")
    parser.add_argument("--max-shapes", type=int, default=DEFAULT_MAX_SHAPES, help="with --rss: remat's max_shapes")
    parser.add_argument("--plain", action="store_true", help="with --rss: plain autograd's loop instead")
    parser.add_argument("--accuracy", action="store_true",
                        help="instead: each length's first plan's predicted step time and peak against its steps")
    parser.add_argument("--rounds", type=int, default=ACCURACY_ROUNDS,
                        help="--accuracy's interleaved rounds (a step of every length each)")
    args = parser.parse_args()
    if args.fill_cache:
        run_loop(args.steps, args.lengths, args.fill_cache, args.model, args.eager)
        return
    started = time.perf_counter()
    info = ", ".join(f"{k} {v}" for k, v in C.device_info(torch.device("cpu"), torch.get_num_threads()).items())
    if args.rss:
        text = run_rss(args.rss, args.max_shapes, args.plain)
        custom = args.max_shapes != DEFAULT_MAX_SHAPES
        command = f"--rss {args.rss}" + (f" --max-shapes {args.max_shapes}" if custom else "") + (
            " --plain" if args.plain else "")
        name = "bench_shapes_rss_plain.md" if args.plain else \
            f"bench_shapes_rss_max{args.max_shapes}.md" if custom else RSS_RESULTS.name
        path = RSS_RESULTS.with_name(name)
    elif args.accuracy:
        with tempfile.TemporaryDirectory(prefix="hierremat-bench-") as cache:
            text = run_accuracy(args.lengths, cache, args.model, args.rounds)
        suffix = "" if args.model == "gpt2-4" else f"_{args.model}"
        command = f"--accuracy --lengths {args.lengths}" + (f" --model {args.model}" if suffix else "") \
            + (f" --rounds {args.rounds}" if args.rounds != ACCURACY_ROUNDS else "")
        path = C.RESULTS_DIR / f"bench_shapes_accuracy{suffix}.md"
    else:
        loop = ["--steps", str(args.steps), "--lengths", str(args.lengths), "--model", args.model] \
            + (["--eager"] if args.eager else [])
        with tempfile.TemporaryDirectory(prefix="hierremat-bench-") as cache:
            if args.warm:
                subprocess.run([sys.executable, __file__, *loop, "--fill-cache", cache], check=True)
            text = run_loop(args.steps, args.lengths, cache, args.model, args.eager)
        if args.warm:
            text = f"The cache filled by the same loop in an earlier process (a script run again).\n\n{text}"
        command = f"--steps {args.steps} --lengths {args.lengths}" + (f" --model {args.model}" if args.model != "gpt2-4" else "") \
            + (" --warm" if args.warm else "") + (" --eager" if args.eager else "")
        name = "bench_shapes" + ("" if args.model == "gpt2-4" else f"_{args.model}") + ("_warm" if args.warm else "") \
            + ("_eager" if args.eager else "")
        path = C.RESULTS_DIR / f"{name}.md"
    header = (f"# bench_shapes\n\n{info}\n\n"
              f"`python benchmarks/bench_shapes.py {command}` ({time.perf_counter() - started:.0f} s)\n\n")
    C.write_results(path, header + text + "\n")


if __name__ == "__main__":
    main()
