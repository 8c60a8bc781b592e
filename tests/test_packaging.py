"""A regular (non-editable) install puts kernels/ and fid/ inside the uvic namespace, never as top-level names."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def test_regular_install_maps_kernels_and_fid_into_uvic(tmp_path):
    target = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (target / "uvic" / "kernels" / "attention.py").is_file()
    assert (target / "uvic" / "fid" / "metric.py").is_file()
    assert not (target / "kernels").exists() and not (target / "fid").exists()  # no top-level `kernels` / `fid`
    for init in (ROOT / "uvic").rglob("__init__.py"):  # pyproject lists the packages by hand: none may be left out
        assert (target / init.relative_to(ROOT)).is_file(), f"{init.parent.relative_to(ROOT)} is not installed"
    code = (
        "import uvic, uvic.kernels, uvic.kernels.ops, uvic.fid, uvic.integrations;"
        "from uvic.attention import unsupported_reason;"
        "print(uvic.__file__); print(uvic.kernels.__file__); print(uvic.fid.__file__)"
    )
    # Run from an empty directory with only the install target on the path (not the checkout).
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.split():
        assert line.startswith(str(target)), line
