"""2,000 training steps under a tight budget leak nothing: tapes, RNG states, cached graphs, plans.

Slow (a few minutes): runs with ``HIERREMAT_RUN_SLOW=1`` or ``-m slow``. The live-tensor
peak of step 2,000 equals step 10's, and so does the resident set size (with
``MALLOC_MMAP_THRESHOLD_=65536``, to within 1%: the allocator's own bookkeeping).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_thousand_steps_leak_nothing():
    pytest.importorskip("transformers")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "long_run.py"), "--steps", "2000"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first, last = result["at"]["10"], result["at"]["2000"]
    assert last["peak_bytes"] == first["peak_bytes"] <= result["budget_bytes"], result
    assert last["plans"] == first["plans"] == 1, result
    assert last["rss_bytes"] <= first["rss_bytes"] * 1.01, result
