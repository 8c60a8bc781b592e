"""`torchrun --nproc_per_node 2 -m uvic.fid score`: features gathered across processes give the 1-process FID."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from fid_testutils import smooth_images

from uvic.fid import compute_fid


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:.*N=\d+ <= feature dim")
def test_two_cpu_processes_match_one(extractors, weights_file, tmp_path):
    np.savez(tmp_path / "s.npz", smooth_images(5, size=16, seed=8))  # 5 images: uneven shards (3 + 2)
    np.savez(tmp_path / "r.npz", smooth_images(6, size=16, seed=9))
    single = compute_fid(tmp_path / "s.npz", tmp_path / "r.npz", extractor=extractors("pytorch-fid", 64),
                         batch_size=2, progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "yes"}  # as `accelerate launch --cpu`
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "uvic.fid",
           "score", "s.npz", "r.npz", "--json", "out.json", "--weights", str(weights_file), "--weights-sha256",
           "none", "--dims", "64", "--batch-size", "2", "--num-workers", "0", "--no-progress", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["meta"]["world_size"] == 2 and out["n"] == 5
    # Same features in the same order; only the CPU thread count differs (rounding in the convolutions).
    assert out["fid5"] == pytest.approx(single.fid, rel=1e-6)
    assert proc.stdout.count("fid5=") == 1  # printed by the main process only
