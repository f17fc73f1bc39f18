"""apply_torch_settings: the inductor flags generation relies on, and one Triton ptxas for this process and
inductor's compile workers (else tuned kernels miss Triton's cache in the next process)."""

import os
import subprocess
import sys

import pytest
import torch

REPORT = "import os; print(os.environ.get('TRITON_PTXAS_PATH'))"
OURS = f"from gpt_fast.util.settings import apply_torch_settings; apply_torch_settings(); {REPORT}"
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
        "import torch._inductor.config as c; from gpt_fast.util.settings import apply_torch_settings as a; a(); "
        "print(c.coordinate_descent_tuning, c.triton.unique_kernel_names, c.fx_graph_cache)"
    )
    assert _run(code) == "True True True"


def test_importing_changes_nothing():
    code = "import torch._inductor.config as c; import gpt_fast.util.settings; "
    code += f"{REPORT}; print(c.coordinate_descent_tuning)"
    assert _run(code).split() == ["None", "False"]


def fake_autotuner(compiled, cached):
    """A statically launched kernel's autotuner as ``recheck_autotune_cache`` sees it: ``compiled`` configurations
    (kwargs, warps) and an autotune cache answering ``cached`` (a hit: one configuration)."""
    import types

    def config(kwargs, warps, coordesc=None):
        c = types.SimpleNamespace(kwargs=kwargs, num_warps=warps, num_stages=1)
        if coordesc is not None:
            c.found_by_coordesc = coordesc
        return c

    return types.SimpleNamespace(
        compile_results=[types.SimpleNamespace(config=config(*c)) for c in compiled],
        filename="kernel.py",
        inductor_meta={"coordinate_descent_tuning": True},
        fn=types.SimpleNamespace(fn=object()),
        is_statically_launchable=lambda: True,
        _precompile_config=lambda c: types.SimpleNamespace(config=c),
    ), [config(*c) for c in cached]


CASES = {
    "the tuned winner is one of two compiled": ([({"X": 1}, 4), ({"X": 8}, 8)], [({"X": 8}, 8, True)]),
    "the tuned winner is the only one compiled": ([({"X": 8}, 8)], [({"X": 8}, 8, True)]),
    "the tuned winner is not compiled": ([({"X": 1}, 4), ({"X": 2}, 4)], [({"X": 8}, 8, True)]),
    "an untuned entry": ([({"X": 1}, 4), ({"X": 2}, 4)], [({"X": 2}, 4, False)]),
    "a miss": ([({"X": 1}, 4), ({"X": 2}, 4)], [({"X": 1}, 4), ({"X": 2}, 4)]),
}


@pytest.mark.skipif(torch.__version__.startswith("2.11."), reason="the reference is the fix newer torch has")
@pytest.mark.parametrize("case", CASES)
def test_a_cached_kernel_keeps_its_tuned_configuration_as_newer_torch_does(monkeypatch, case):
    """Our replacement for torch 2.11's check against the reference: the same method in the torch installed here,
    which has upstream's fix (pytorch/pytorch#172819). Both keep the configuration the entry names, and its
    found_by_coordesc flag, so that the kernel is not tuned again at its first call."""
    from torch._inductor.runtime import triton_heuristics

    from gpt_fast.util.settings import recheck_autotune_cache

    compiled, cached = CASES[case]
    outcomes = []
    for recheck in (triton_heuristics.CachingAutotuner.recheck_autotune_cache, recheck_autotune_cache):
        tuner, answer = fake_autotuner(compiled, cached)
        monkeypatch.setattr(triton_heuristics, "check_autotune_cache", lambda *_, a=answer: (a, None, {}))
        recheck(tuner, lambda: None)
        kept = [r.config for r in tuner.compile_results]
        outcomes.append([(sorted(c.kwargs.items()), getattr(c, "found_by_coordesc", False)) for c in kept])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("version, replaced", [("2.11.0+cu130", True), ("2.13.0+cpu", False)])
def test_the_cache_fixes_are_made_on_torch_2_11_only(monkeypatch, version, replaced):
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime import triton_heuristics

    from gpt_fast.util import settings

    tuner = triton_heuristics.CachingAutotuner
    monkeypatch.setattr(tuner, "recheck_autotune_cache", tuner.recheck_autotune_cache)  # restored afterwards
    monkeypatch.setattr(torch, "__version__", version)
    with inductor_config.patch(dynamic_scale_rblock=True):  # the config module's own undo (monkeypatch's deletes)
        settings._keep_tuned_configs_on_load()
        assert (tuner.recheck_autotune_cache is settings.recheck_autotune_cache) == replaced
        assert inductor_config.dynamic_scale_rblock is not replaced
    assert inductor_config.dynamic_scale_rblock


@pytest.fixture
def cores(monkeypatch, tmp_path):
    """Four cores in the affinity mask, OMP_NUM_THREADS unset and no cgroup quota (an empty cgroup root)."""
    from gpt_fast.util import settings

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(settings, "CGROUP", tmp_path)
    return tmp_path


def test_threads_follow_the_affinity(cores):
    from gpt_fast.util.settings import cpu_threads

    assert cpu_threads() == (4, "the 4 cores available")


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"cpu.max": "150000 100000\n"}, (1, "the cgroup's CPU quota of 1.5 cores")),
        ({"cpu.max": "max 100000\n"}, (4, "the 4 cores available")),
        (
            {"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"},
            (2, "the cgroup's CPU quota of 2 cores"),
        ),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, (4, "the 4 cores available")),
        ({"cpu.max": "garbage"}, (4, "the 4 cores available")),
    ],
)
def test_threads_follow_the_cgroup_quota(cores, files, expected):
    from gpt_fast.util.settings import cpu_threads

    for name, text in files.items():
        (cores / name).parent.mkdir(exist_ok=True)
        (cores / name).write_text(text)
    assert cpu_threads() == expected


def test_omp_num_threads_wins(cores, monkeypatch):
    from gpt_fast.util.settings import cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == (3, "OMP_NUM_THREADS=3")
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")  # not a count: ignored
    assert cpu_threads() == (4, "the 4 cores available")


def test_threads_asked_for_win(cores, monkeypatch):
    from gpt_fast.util.settings import cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == (2, "as asked")


def test_the_cpu_gets_its_thread_count_and_an_eager_run_no_inductor():
    code = (
        "import sys, torch; from gpt_fast.util.settings import apply_torch_settings, cpu_threads_note; "
        "apply_torch_settings(torch.device('cpu'), compiled=False); "
        "print(torch.get_num_threads(), 'torch._inductor' in sys.modules, cpu_threads_note())"
    )
    assert _run(code, OMP_NUM_THREADS="1") == "1 False 1 thread (OMP_NUM_THREADS=1)"


def _policy_after_main(env: dict[str, str]) -> str:
    code = (
        "import os\nfrom gpt_fast.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def test_the_command_line_lets_openmp_threads_sleep_unless_told_otherwise():
    """OpenMP reads its wait policy when torch is imported: the command line sets it first, and keeps the user's."""
    assert _policy_after_main({}) == "PASSIVE"
    assert _policy_after_main({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_compiled_steps_see_every_change_to_a_module():
    """With the step settings (:func:`gpt_fast.util.settings.apply_step_settings`, on for the whole test run),
    Dynamo skips a module's guards while its ``__dict__`` is unchanged: a new attribute value, kernel, parameter or
    buffer must still reach the compiled code."""
    import torch
    from torch import nn

    from gpt_fast.util.settings import apply_step_settings

    apply_step_settings()

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.register_buffer("shift", torch.zeros(4))
            self.factor, self.kernel = 1.0, torch.relu

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.kernel(self.inner(x) * self.factor + self.shift)

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(3, 4)
    step = torch.compile(lambda m, t: m(t), backend="eager", fullgraph=True)

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(step(model, x), model(x), rtol=0, atol=0)

    check()
    check()
    model.factor = 2.0
    check()
    model.kernel = torch.tanh
    check()
    model.inner.weight = nn.Parameter(torch.randn(4, 4))
    check()
    model.shift = torch.ones(4)
    check()
    model.inner = nn.Linear(4, 4)
    check()
