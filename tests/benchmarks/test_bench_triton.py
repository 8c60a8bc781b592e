"""benchmarks/bench_triton.py on CPU: its missing-pandas message and the wiring of its timed calls (no GPU needed)."""

import importlib.util

import pytest
import torch.nn.functional as F


pytest.importorskip("triton")
import bench_triton as bt  # noqa: E402  (benchmarks/, on the path from conftest.py)


def test_missing_pandas_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else real(name, *a))
    with pytest.raises(SystemExit, match=r'pip install "uvic\[bench\]"'):
        bt.main([])


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_timed_runs_reset_the_input_grads(mode):
    """Backward runs accumulate into q/k/v.grad: do_bench must get q, k, v as grad_to_none so that each timed run
    starts from None. Checked on CPU with SDPA standing in for the providers and a do_bench that records its call."""
    seen = {}

    def fake_do_bench(fn, grad_to_none=None, **kwargs):
        seen["fn"], seen["leaves"] = fn, grad_to_none
        return 1.0

    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    tflops = bt.bench.fn(L=32, hd=16, nh=2, causal=True, mode=mode, provider="cog", fn=sdpa, device="cpu", tokens=64,
                         do_bench=fake_do_bench)
    assert tflops == pytest.approx(4 * 2 * 2 * 32 * 32 * 16 * 0.5 * {"fwd": 1, "bwd": 2.5, "fwd+bwd": 3.5}[mode] * 1e-9)
    leaves = seen["leaves"]
    assert leaves is not None and len(leaves) == 3
    assert all(t.is_leaf and t.requires_grad and t.shape == (2, 2, 32, 16) for t in leaves)
    if mode != "fwd":  # the timed function does write those grads
        seen["fn"]()
        assert all(t.grad is not None for t in leaves)
