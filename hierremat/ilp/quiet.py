"""Keep native solvers off the terminal: what they write to stdout/stderr goes to ``logging``.

HiGHS (inside scipy) and Gurobi print from C/C++ straight to file descriptors 1 and 2,
below Python's ``sys.stdout``, e.g. HiGHS's
``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``. While a solve
runs, :func:`solver_output_to_log` points both descriptors at a temporary file and, after
the solve, logs each line it received at DEBUG on the given logger.

The redirection is process-wide for its duration: a line another thread writes to fd 1 or
2 during a solve is logged too, never lost.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or detached streams
            pass


@contextmanager
def solver_output_to_log(logger: logging.Logger, what: str) -> Iterator[None]:
    """Run the block with fds 1 and 2 captured; log the captured lines as ``what: line``."""
    saved: list[tuple[int, int]] = []
    with tempfile.TemporaryFile() as sink:
        _flush_python_streams()
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # no such descriptor in this process: nothing to redirect
                continue
            os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            _flush_python_streams()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            text = sink.read().decode("utf-8", errors="replace")
            for line in text.splitlines():
                if line.strip():
                    logger.debug("%s: %s", what, line.rstrip())
