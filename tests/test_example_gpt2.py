"""The GPT-2 fine-tuning example runs end to end on CPU."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2" / "finetune.py"


def _load():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# bf16 halves the activations, not the fp32 gradients the step allocates (PyTorch's default zero_grad):
# at batch 2 x 64 those are most of half of plain's peak, so bf16 runs at 0.7 of it.
@pytest.mark.parametrize("dtype, fraction", [("fp32", "0.5"), ("bf16", "0.7")])
def test_finetune_three_steps_tiny_cpu(tmp_path, dtype, fraction):
    """--dtype bf16: autocast around the forward only, a fresh context each step (the standard recipe)."""
    report = _load().main(
        ["--steps", "3", "--seq-len", "64", "--batch", "2", "--budget-fraction", fraction, "--device", "cpu",
         "--dtype", dtype, "--out", str(tmp_path)]
    )
    assert all(math.isfinite(loss) for loss in report["train_losses"]) and len(report["train_losses"]) == 3
    assert report["within_budget"] and report["measured_peak_bytes"] <= report["budget_bytes"]
    assert math.isfinite(report["validation_loss"])
    for name in ("report.json", "report.png", "plan.json", "model/config.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "report.json").read_text())["budget_bytes"] == report["budget_bytes"]


def test_finetune_baseline_without_remat(tmp_path):
    report = _load().main(["--steps", "2", "--seq-len", "64", "--batch", "2", "--no-remat", "--out", str(tmp_path)])
    assert report["budget_bytes"] is None and report["predicted_peak_bytes"] is None
