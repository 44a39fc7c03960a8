"""benchmarks/bits_by_op.py, the diagnosis a GPU session runs, checked where it can be: on CPU, where
hierremat's bf16 steps are bitwise plain autograd's, it names no op; with one bit of one backward matmul of
hierremat's step flipped (``--self-check``), it names that op first."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/bits_by_op.py", "--device", "cpu", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bits_by_op_names_no_op_where_the_steps_agree_and_the_op_a_fault_is_put_in():
    clean = _run()
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "0 of 29 results differ from plain autograd's" in clean.stdout, clean.stdout[-3000:]
    assert "\n0 of hierremat's ops read known values" in clean.stdout, clean.stdout[-3000:]
    faulty = _run("--self-check")
    assert faulty.returncode == 0, faulty.stdout[-3000:] + faulty.stderr[-3000:]
    assert "\n1 of hierremat's ops read known values" in faulty.stdout
