"""Run the interpreter suites (numerics vs the float64 reference, torch.library / torch.compile) in a subprocess.

TRITON_INTERPRET must be set before triton is first imported (triton's own @jit helpers are built then), and in a
whole-suite pytest session other tests import triton early (torch._dynamo does). A child process with the
variable set from the start is the one reliable way.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).parent
SUITES = ["interpret_numerics.py", "interpret_library.py"]


@pytest.mark.slow
def test_interpreter_suites():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / s) for s in SUITES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent.parent)
    assert proc.returncode == 0, f"interpreter suites failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
