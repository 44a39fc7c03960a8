"""``hierremat.explore`` and ``python -m hierremat``: what each budget costs, before training."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hierremat as hr
from hierremat.api.cli import main
from hierremat.device import LiveTensorTracker

from models import TinyResNet

ROOT = Path(__file__).resolve().parents[1]

MODEL_FILE = '''
import torch
from models import TinyResNet

def build():
    torch.manual_seed(0)
    return TinyResNet(width=8).train(), (torch.randn(4, 3, 16, 16),)
'''


def _resnet():
    torch.manual_seed(0)
    return TinyResNet(width=8).train(), (torch.randn(4, 3, 16, 16),)


def _step_peak(module, args):
    with LiveTensorTracker() as tracker:
        module(*args).float().pow(2).mean().backward()
    return tracker.peak_bytes


def test_explore_menu_is_monotone_and_its_plans_run_within_budget():
    model, args = _resnet()
    explorer = hr.explore(model, args)
    menu = explorer.menu(4)
    assert menu[0].budget_bytes == explorer.smallest_feasible_bytes
    assert menu[-1].budget_bytes == explorer.keep_all_bytes
    for lower, higher in zip(menu, menu[1:]):
        assert lower.budget_bytes < higher.budget_bytes
        assert higher.predicted_step_time <= lower.predicted_step_time + 1e-12
    for p in menu:
        assert p.predicted_peak_bytes <= p.budget_bytes
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        explorer.plan("1KiB")
    assert err.value.min_budget_bytes == explorer.smallest_feasible_bytes
    # the smallest plan trains: gradients equal plain autograd's, measured peak within its budget
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(*args).float().pow(2).mean().backward()
    module = hr.remat(model, args, plan=menu[0])
    torch.manual_seed(1)
    peak = _step_peak(module, args)
    assert peak <= menu[0].budget_bytes
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_cli_model_file_json(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    (tmp_path / "net.py").write_text(MODEL_FILE)
    assert main(["--model", f"{tmp_path / 'net.py'}:build", "--points", "3", "--budget", "0.8x", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    menu = out["menu"]
    assert len(menu) == 3 and menu[0]["budget_bytes"] == out["smallest_feasible_bytes"]
    assert [m["budget_bytes"] for m in menu] == sorted(m["budget_bytes"] for m in menu)
    assert out["plan"]["format"] == "hierremat.ModelPlan/1"
    plan = hr.ModelPlan.from_json(json.dumps(out["plan"]))
    assert plan.budget_bytes == int(0.8 * out["keep_all_peak_bytes"])


def test_cli_text_and_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    (tmp_path / "net.py").write_text(MODEL_FILE)
    spec = f"{tmp_path / 'net.py'}:build"
    assert main(["--model", spec, "--points", "2", "--budget", "0.9x"]) == 0
    text = capsys.readouterr().out
    assert "hierremat model plan" in text and "memory against time" in text and "(smallest feasible)" in text
    assert main(["--model", spec, "--points", "2", "--budget", "0.01x"]) == 2
    assert "smallest feasible budget is" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="defines no 'missing'"):
        main(["--model", f"{tmp_path / 'net.py'}:missing"])
    with pytest.raises(SystemExit, match="write FILE.py:FUNCTION"):
        main(["--model", "net.py"])
    with pytest.raises(SystemExit):  # argparse: --set needs --hf
        main(["--model", spec, "--set", "n_layer=2"])


@pytest.mark.slow
def test_python_dash_m_hierremat_on_an_hf_config():
    pytest.importorskip("transformers")
    results = []
    for extra in ([], ["--outputs", "loss"]):
        out = subprocess.run(
            [sys.executable, "-m", "hierremat", "--hf", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64",
             "--set", "n_head=4", "--set", "vocab_size=2048", "--batch", "2", "--seq", "32", "--points", "3", "--json",
             "--grads", "kept", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["menu"]) == 3
        assert result["menu"][0]["predicted_step_seconds"] >= result["menu"][-1]["predicted_step_seconds"]
        results.append(result)
    # the logits not returned: the head may run fused with the loss, which lowers the smallest budget
    assert results[1]["smallest_feasible_bytes"] < results[0]["smallest_feasible_bytes"]
