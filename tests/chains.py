"""Random chain costs and a brute-force enumerator of Rotor's schedule family (test oracles)."""

from __future__ import annotations

import itertools

import numpy as np

from hierremat.plans.costs import ChainCosts, OptionCosts, ResidentCosts, StageCosts, TierBandwidth
from hierremat.plans.schedule import Backward, FAll, FCk, Fetch, FetchKept, FNone, Loss, Offload, OffloadKept


def random_residents(rng: np.random.Generator, L: int, max_bytes: int) -> tuple[ResidentCosts, ...]:
    """Up to three values carried beside the activation: a random producer (or one made before
    the chain: producer -1, its value the caller's, its gradient summed to the end), later readers,
    some returned by the model (exported, then perhaps read by no stage), some without a gradient."""
    residents = []
    for _ in range(int(rng.integers(1, 4)) if L >= 2 else 0):
        producer = int(rng.integers(-1, L - 1))
        later = range(producer + 1, L)
        exported = producer >= 0 and bool(rng.integers(0, 2))  # an exported one may have no reader (a returned cache)
        count = int(rng.integers(0 if exported else 1, len(later) + 1))
        readers = tuple(sorted(int(j) for j in rng.choice(later, size=count, replace=False)))
        value = int(rng.integers(1, max_bytes))
        grad = value * int(rng.integers(0, 2))
        residents.append(ResidentCosts(producer, readers, 0 if producer < 0 else value, grad, exported))
    return tuple(residents)


def random_chain(
    rng: np.random.Generator, L: int, K: int, *, max_bytes: int = 20, zero_sizes: bool = False, residents: bool = False,
    step_grads: bool = False, offload: bool = False,
) -> ChainCosts:
    """A chain with small integer sizes (so a memory unit of 1 byte is exact); ``residents``: with
    values carried beside the activation (random_residents); ``step_grads``: with parameter
    gradients allocated by some stages' backward and kept to the end of the step; ``offload``: with a
    second tier whose transfers take about as long as a stage, and options whose kept values may go there."""
    low = 0 if zero_sizes else 1
    a = [int(v) for v in rng.integers(low, max_bytes, size=L + 1)]
    stages = []
    for i in range(L):
        out = a[i + 1]
        grad_in = a[i]
        options = []
        for _ in range(int(rng.integers(1, K + 1))):
            kept = int(rng.integers(0, 2 * max_bytes))
            options.append(
                OptionCosts(
                    fwd_time=float(rng.uniform(0.5, 2.0)),
                    bwd_time=float(rng.uniform(0.5, 4.0)),
                    kept_bytes=kept,
                    fwd_overhead_bytes=kept + out + int(rng.integers(0, max_bytes)),
                    bwd_overhead_bytes=grad_in + int(rng.integers(0, max_bytes)),
                    pins_output=bool(rng.integers(0, 2)),
                    pins_input=bool(rng.integers(0, 2)),
                    offloadable=offload and bool(rng.integers(0, 2)),
                )
            )
        stages.append(
            StageCosts(
                nograd_fwd_time=float(rng.uniform(0.5, 2.0)),
                nograd_fwd_overhead_bytes=out + int(rng.integers(0, max_bytes)),
                options=tuple(options),
            )
        )
    output_grad = None if rng.integers(0, 2) else int(rng.integers(low, max_bytes))
    return ChainCosts(
        tuple(a), tuple(stages), input_requires_grad=bool(rng.integers(0, 2)),
        output_held_bytes=[None, 0, int(rng.integers(0, a[-1] + 1))][int(rng.integers(0, 3))],
        output_grad_bytes=output_grad, residents=random_residents(rng, L, max_bytes) if residents else (),
        step_grad_bytes=tuple(int(g) * int(rng.integers(0, 2)) for g in rng.integers(1, max_bytes, size=L))
        if step_grads else (),
        tier=TierBandwidth("test", float(rng.uniform(1, 4)) * max_bytes, float(rng.uniform(1, 4)) * max_bytes)
        if offload else None,
    )


def enumerate_schedules(costs: ChainCosts):
    """Every schedule of Rotor's persistent family, as op tuples (exponential: tiny chains)."""
    L = costs.length

    def sub(s: int, t: int):
        for k in range(len(costs.stages[s].options)):
            if s == t:
                tail = (Loss(),) if t == L - 1 else ()
                yield (FAll(s, k),) + tail + (Backward(s),)
            else:
                kept_away = costs.tier is not None and costs.stages[s].options[k].kept_offloadable
                for rest in sub(s + 1, t):
                    yield (FAll(s, k),) + rest + (Backward(s),)
                    if kept_away:  # what the option keeps offloaded while the rest runs (with x_s where it may go)
                        yield (FAll(s, k), OffloadKept(s)) + rest + (FetchKept(s), Backward(s))
                        if s > 0 and costs.stages[s].options[k].pins_input:
                            yield (FAll(s, k), OffloadKept(s, True)) + rest + (FetchKept(s), Backward(s))
        for sp in range(s + 1, t + 1):
            fwd = (FCk(s),) + tuple(FNone(j) for j in range(s + 1, sp))
            for right, left in itertools.product(list(sub(sp, t)), list(sub(s, sp - 1))):
                yield fwd + right + left
                if costs.tier is not None and s > 0:  # x_s offloaded through the right part (where it may be)
                    yield fwd + (Offload(s),) + right + (Fetch(s),) + left

    yield from sub(0, L - 1)
