"""The OpenMP environment torch's CPU threads run under. OpenMP reads it once, when torch is first imported, so the
command line sets it before anything imports torch."""

from __future__ import annotations

import os


def prefer_passive_waits() -> None:
    """Let OpenMP's threads sleep, rather than spin, when they wait for each other (``OMP_WAIT_POLICY=PASSIVE``,
    unless the environment sets a policy). By default each thread spins for a while at the end of every parallel
    region; when other processes keep the cores busy, the spinning threads take turns on the cores with the one still
    working, and every operator waits for it: on a busy 2-core machine, 2 threads decoded the default model at 1.5
    tok/s with spinning waits, 6.9 with passive ones and 5.7 with 1 thread (docs/bench/HISTORY.md, 2026-11-29)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
