"""apply_torch_settings: the inductor flags generation relies on, and one Triton ptxas for this process and
inductor's compile workers (else tuned kernels miss Triton's cache in the next process)."""

import os
import subprocess
import sys

REPORT = "import os; print(os.environ.get('TRITON_PTXAS_PATH'))"
OURS = f"from gpt_fast.settings import apply_torch_settings; apply_torch_settings(); {REPORT}"
WORKERS = f"from torch._inductor.runtime import compile_tasks as t; t._set_triton_ptxas_path(); {REPORT}"


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_process_uses_the_ptxas_the_compile_workers_use():
    assert _run(OURS) == _run(WORKERS)


def test_a_ptxas_the_user_chose_is_kept():
    assert _run(OURS, TRITON_PTXAS_PATH="/opt/cuda/bin/ptxas") == "/opt/cuda/bin/ptxas"


def test_inductor_flags():
    code = (
        "import torch._inductor.config as c; from gpt_fast.settings import apply_torch_settings as a; a(); "
        "print(c.coordinate_descent_tuning, c.triton.unique_kernel_names, c.fx_graph_cache)"
    )
    assert _run(code) == "True True True"


def test_importing_changes_nothing():
    code = f"import torch._inductor.config as c; import gpt_fast.settings; {REPORT}; print(c.coordinate_descent_tuning)"
    assert _run(code).split() == ["None", "False"]
