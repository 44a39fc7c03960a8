"""Smoke test of benchmarks/run_all.py --quick: runs, writes JSON/Markdown/plots, hierremat within budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "run_all.py"


@pytest.mark.slow
def test_run_all_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]

    data = json.loads((tmp_path / "run_all_quick.json").read_text())
    meta = data["meta"]
    for key in ("device_name", "torch", "date", "cpu_count", "command"):
        assert meta.get(key), key
    assert len(data["models"]) == 1
    model = data["models"][0]
    rows = model["rows"]
    ok = [r for r in rows if r["status"] == "ok"]

    plain = [r for r in ok if r["family"] == "plain"]
    assert len(plain) == 1 and plain[0]["peak_ratio"] == 1.0 and plain[0]["time_ratio"] == 1.0
    baselines = [r for r in ok if r["family"] in ("hf", "segments", "sac", "compile")]
    assert baselines, "no baseline row measured"
    hier = [r for r in ok if r["family"] == "hierremat"]
    assert len({r["budget_bytes"] for r in hier}) >= 2, [(r["setting"], r["status"], r["reason"]) for r in rows]

    for r in hier:
        assert r["peak_bytes"] <= r["budget_bytes"], r
        assert r["within_budget"] is True
        assert r["planning_s"] is not None and r["predicted_step_s"] is not None
    for r in plain + hier + [b for b in baselines if b["family"] != "compile"]:
        assert r["grad_max_abs_diff"] is not None and r["grad_max_abs_diff"] < 1e-5, r
        assert r["median_s"] > 0 and r["peak_ratio"] > 0 and r["time_ratio"] > 0
    # the hooks for later hierremat variants are reported, not silently dropped
    assert any(r["family"] == "hierremat-config" for r in rows)

    md = (tmp_path / "run_all_quick.md").read_text()
    assert "| method | setting | peak / plain | time / plain |" in md
    assert "no checkpointing" in md and "hierremat" in md and meta["torch"] in md
    assert (tmp_path / f"run_all_quick_{model['name']}.png").stat().st_size > 0
