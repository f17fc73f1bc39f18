"""Starting the ranks of tensor parallelism on this host: ``gpt-fast generate --tp N`` and ``gpt-fast bench tp`` run the
command again as N processes under PyTorch's own launcher, ``python -m torch.distributed.run`` (``torchrun``),
with ``--standalone`` (a rendezvous on a free local port). ``torchrun`` sets each process's ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``, watches them, and stops them all when one fails or is interrupted.

For several hosts run ``torchrun`` yourself on each (README: ``--nnodes``, ``--rdzv_endpoint``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

# After Ctrl-C, how long torchrun gets to stop its processes by itself (a terminal's Ctrl-C reaches it too), then
# after a SIGINT of ours (it waits up to 30 s for each process to end), before it is terminated.
GRACE_SECONDS = 5
STOP_SECONDS = 60


def ranks_command(nproc: int, module_args: Sequence[str]) -> list[str]:
    """The command that runs ``python -m MODULE ARGS`` (``module_args``) as ``nproc`` ranks on this host."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        *module_args,
    ]


def run_ranks(nproc: int, module_args: Sequence[str], timeout: float | None = None) -> int:
    """Run ``python -m MODULE ARGS`` as ``nproc`` ranks and return torchrun's exit status (non-zero when a rank
    failed; its own error is printed above by that rank). The ranks write to this process's standard output and
    error. Ctrl-C is handed on to torchrun, which stops the ranks; ``timeout`` seconds end them all the same way."""
    process = subprocess.Popen(ranks_command(nproc, module_args))
    try:
        return process.wait(timeout=timeout)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        stop(process)
        raise


def stop(process: subprocess.Popen) -> None:
    """Let torchrun stop its ranks: give it :data:`GRACE_SECONDS` (Ctrl-C in a terminal reached it too; a second
    SIGINT would cut its shutdown short), then send it SIGINT, then terminate it after :data:`STOP_SECONDS`."""
    for wait, then in ((GRACE_SECONDS, process.send_signal), (STOP_SECONDS, lambda _: process.terminate())):
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            then(signal.SIGINT)
    process.wait()
