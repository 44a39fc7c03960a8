"""Python's cyclic garbage collector paused while a shape is planned from its family's symbolic capture.

Planning a shape there (its program specialized at its sizes, its stages costed, the chain DP solved) allocates tens
of thousands of short-lived container objects, many in reference cycles (fx nodes, fake tensors). With the collector
running, its young-generation collections during planning move those still alive to the oldest generation; once
dropped, their cycles wait there for a full collection, which walks every object the process holds: 0.3 s in issue
35's loop (four GPT-2 models, transformers and torch: about 600,000 objects), landing on some new length's first
step. Paused, the objects planning makes stay young, and one young-generation collection after it frees their cycles
at the cost of those objects alone, before the step runs.

PyTorch pauses it for the same reason around ``get_state_dict`` (``torch.distributed.checkpoint.state_dict``).
Only a new shape's planning from its family's symbolic capture is paused (a tenth of a second at 4 layers, 0.24 s at
12); a family's first shape (profiled, its block options solved), a shape outside the capture (exported on its own)
and a shape planned again to build its block options once they pay (``RematModule._plan_again``: ILP solves and
traces, seconds) run with the collector as the caller set it, so that no long phase holds its garbage. (A shape whose
sizes bind the capture but fail one of its guards is exported under the pause: rare, seconds.)
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The collector off for the block, then, where it was on, on again and its young generation (everything
    allocated in the block) collected; where the caller had it off, it stays off. Restored on an exception too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(0)
