"""benchmarks/gpu_check.sh without a GPU: a stand-in python records what each step runs, so the test sees that the
script runs the GPU tests and every benchmark of benchmarks/, keeps each step's log, goes on after a failing step
and reports it, and that its time limits add up to what a 15-minute device loan allows."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run(tmp_path, fail_on=""):
    """Run the script with PYTHON a stub that appends its arguments to calls.txt (and fails when they contain
    `fail_on`); returns (exit status, stdout, the recorded calls)."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n'
                    f'[ -n "{fail_on}" ] && [[ "$*" == *"{fail_on}"* ]] && exit 3\nexit 0\n')
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub)}
    env.pop("GPU_CHECK_FULL", None)
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "logs")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    return res.returncode, res.stdout, calls.read_text().splitlines()


def test_runs_the_gpu_tests_and_every_benchmark(tmp_path):
    rc, out, calls = _run(tmp_path)
    assert rc == 0, out
    steps = re.findall(r"^== (\w+) \(limit", out, re.M)
    assert steps == ["env", "tests", "bench_dispatch", "bench_uvit_step", "bench_triton", "bench_attention"]
    for name in steps:
        assert (tmp_path / "logs" / f"{name}.txt").is_file()
    pytest_call = next(c for c in calls if c.startswith("-m pytest"))
    assert "tests/kernels/test_triton_gpu.py" in pytest_call and "tests/kernels/test_device.py" in pytest_call
    scripts = {Path(c.split()[0]).name for c in calls if c.startswith("benchmarks/")}
    # Every GPU benchmark; bench_nanogpt.py times uvic beside a nanoGPT checkout on the CPU (docs/benchmarks.md).
    assert scripts == {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")} - {"bench_nanogpt.py"}
    assert any("bench_uvit_step.py --device cuda" in c for c in calls)


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    rc, out, calls = _run(tmp_path, fail_on="bench_dispatch.py")
    assert rc == 1
    assert "== bench_dispatch: exit 3" in out
    assert any("bench_attention.py" in c for c in calls)  # the last step still ran


def test_time_limits_fit_a_device_loan():
    limits = [int(n) for n in re.findall(r"^step \w+ (\d+) ", SCRIPT.read_text(), re.M)]
    assert len(limits) == 6
    assert sum(limits) <= 465  # plus 10 s of grace per step: under 9 of the 15 minutes a loan has with start-up
