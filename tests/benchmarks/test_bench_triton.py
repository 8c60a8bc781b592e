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
    tflops = bt.bench(L=32, hd=16, nh=2, causal=True, mode=mode, provider="cog", fn=sdpa, device="cpu", tokens=64,
                         do_bench=fake_do_bench)
    assert tflops == pytest.approx(4 * 2 * 2 * 32 * 32 * 16 * 0.5 * {"fwd": 1, "bwd": 2.5, "fwd+bwd": 3.5}[mode] * 1e-9)
    leaves = seen["leaves"]
    assert leaves is not None and len(leaves) == 3
    assert all(t.is_leaf and t.requires_grad and t.shape == (2, 2, 32, 16) for t in leaves)
    if mode != "fwd":  # the timed function does write those grads
        seen["fn"]()
        assert all(t.grad is not None for t in leaves)


def test_inputs_the_kernel_refuses_give_nan_without_timing():
    """A point outside the kernel's envelope (here: CPU tensors) is NaN for the kernel's modes, never run; SDPA's
    point of the same shape is timed."""

    def refuse(fn, **kwargs):
        raise AssertionError("do_bench called for inputs the kernel refuses")

    for provider in bt.ATTENTIONS:
        tflops = bt.bench(L=32, hd=72, nh=2, causal=False, mode="fwd", provider=provider, device="cpu", tokens=64,
                          do_bench=refuse)
        assert tflops != tflops  # NaN


def test_time_ratios_are_the_inverse_tflops_ratios():
    table = bt.time_ratios({"L": [4096, 16384], "cog": [300.0, 320.0], "softmax": [330.0, 320.0],
                            "sdpa-flash": [270.0, 400.0]})
    assert table["cog/softmax time"] == pytest.approx([1.1, 1.0])
    assert table["cog/sdpa-flash time"] == pytest.approx([0.9, 1.25])
    text = bt.format_table("attention-bf16-hd64-full-fwd+bwd", table).splitlines()
    assert text[0] == "attention-bf16-hd64-full-fwd+bwd:"
    assert text[1].split() == ["L", "cog", "softmax", "sdpa-flash", "cog/softmax", "time", "cog/sdpa-flash", "time"]
    assert text[2].split() == ["4096", "300.000", "330.000", "270.000", "1.100", "0.900"]
