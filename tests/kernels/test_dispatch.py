"""The eager launch path of the fused kernel on CPU, with the GPU launch stubbed (benchmarks/bench_dispatch.py).

After the first call with a given shape key, `attention_forward` / `attention_backward` launch the compiled
kernels directly (`uvic.kernels.attention._PLANS`) instead of going through triton's autotuner and JIT. On CPU the
stub runs all of that Python with the launcher's C call replaced by a recorder, so the tests check that a replayed
launch passes what the autotuner path passed, that every call triton would specialize differently gets its own
plan, and how much Python one call runs.
"""

import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_dispatch import python_calls, stubbed_launches  # noqa: E402

from uvic.kernels import attention as kattn  # noqa: E402
from uvic.kernels.ops import fused_attention  # noqa: E402


pytestmark = pytest.mark.skipif(kattn._interpreting(), reason="the stub runs triton's JIT path, not the interpreter")


def _qkv(B=2, nh=3, Lq=40, Lk=40, hd=64, dtype=torch.bfloat16, packed=False):
    g = torch.Generator().manual_seed(0)
    if packed:  # a packed qkv projection: (B, L, 3, nh, hd) viewed per head, strided and not contiguous
        qkv = torch.randn(B, Lq, 3, nh, hd, generator=g).to(dtype).permute(2, 0, 3, 1, 4)
        return [t.requires_grad_() for t in (qkv[0], qkv[1], qkv[2])]
    return [torch.randn(B, nh, L, hd, generator=g).to(dtype).requires_grad_() for L in (Lq, Lk, Lk)]


def _forward_backward(q, k, v, **kw):
    out = fused_attention(q, k, v, **kw)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _same_launch(a, b, inputs):
    """Two recorded launches pass the same kernel, grid and non-tensor arguments, and tensors of one layout."""
    (kernel_a, grid_a, args_a), (kernel_b, grid_b, args_b) = a, b
    assert kernel_a is kernel_b and grid_a == grid_b and len(args_a) == len(args_b)
    for x, y in zip(args_a, args_b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            layout = lambda t: (t.shape, t.stride(), t.dtype, t.data_ptr() % 16)
            assert layout(x) == layout(y)
        else:
            assert type(x) is type(y) and x == y
    # the inputs themselves reach the kernels in both (they are not copied when no copy is needed)
    ptrs = {t.data_ptr() for t in inputs}
    assert {t.data_ptr() for t in args_a if isinstance(t, torch.Tensor)} & ptrs == {
        t.data_ptr() for t in args_b if isinstance(t, torch.Tensor)} & ptrs


CASES = {
    "plain": ({}, {}),
    "causal, key padding, fp16": ({"dtype": torch.float16, "Lq": 33, "Lk": 70}, {"causal": True, "mask": True}),
    "window and softcap": ({"Lq": 50, "Lk": 50}, {"window": (7, 3), "softcap": 20.0}),
    "negative scale": ({}, {"scale": -0.3}),
    "fp32": ({"dtype": torch.float32}, {"causal": True}),
    "packed qkv": ({"packed": True}, {}),
    "softmax mode, head dim 128": ({"hd": 128}, {"cog": False}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_launch_passes_what_the_autotuner_path_passed(case):
    """The first call builds the plans through triton's autotuner and JIT; the second replays them. Every launch of
    the second call (1 forward, 3 backward) matches the first's: compiled kernel, grid, every scalar and
    constexpr, the tensors' layouts, and the inputs themselves."""
    shape, kw = CASES[case][0], dict(CASES[case][1])
    q, k, v = _qkv(**shape)
    if kw.pop("mask", False):
        kw["key_padding_mask"] = torch.arange(k.shape[2]) < torch.tensor([[k.shape[2] - 5], [17]])
    with stubbed_launches() as launches:
        _forward_backward(q, k, v, **kw)
        first = list(launches)
        assert len(first) == 4 and len(kattn._PLANS) == 2  # a forward plan and a backward plan
        launches.clear()
        _forward_backward(q, k, v, **kw)
        assert len(launches) == 4 and len(kattn._PLANS) == 2
        for a, b in zip(first, launches):
            _same_launch(a, b, (q, k, v))


def test_a_call_triton_specializes_differently_gets_its_own_plan():
    """Triton compiles a kernel per specialization of its arguments (16-byte alignment of pointers, integers equal
    to 1 or divisible by 16): a call that differs from a planned one only there must launch its own kernel, not
    replay the planned one."""
    q, k, v = _qkv(Lq=40, Lk=40)
    with stubbed_launches() as launches:
        fused_attention(q, k, v)
        fused_attention(q, k, v)
        planned = launches[-1][0]
        # the same shapes and strides, q one element off 16-byte alignment
        q_off = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
        fused_attention(q_off, k, v)
        assert launches[-1][0] is not planned
        # the same shapes, head dim not innermost in q (stride_qd = 40 instead of 1)
        q_t = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
        fused_attention(q_t, k, v)
        assert launches[-1][0] not in (planned, launches[-2][0])
        # and the planned call still replays its own kernel
        fused_attention(q, k, v)
        assert launches[-1][0] is planned


def test_host_work_per_call_is_bounded():
    """The Python functions one eager call enters, beyond what an empty autograd.Function costs. Through triton's
    autotuner and JIT a forward took 86 and a forward + backward 250 (56 and 220 beyond the empty Function); with
    the launch plans 31 and 87. The bounds leave room for torch's own autograd and context code to change."""
    from bench_dispatch import calls

    with stubbed_launches() as launches:
        timed = calls(torch.device("cpu"), (1, 2, 16, 64))
        for fn in timed.values():  # the first call builds the plans
            fn()
        counts = {name: python_calls(fn) for name, fn in timed.items()}
        launches.clear()
        timed["fused fwd+bwd"]()
        assert len(launches) == 4
    assert counts["fused fwd"] <= 45
    assert counts["fused fwd+bwd"] - counts["floor"] <= 80


def test_forward_sign_ptx_follows_the_compute_capability():
    """`min.xorsign.abs` exists from sm_86 (PTX ISA 7.2): the forward takes it for 16-bit inputs on the GPUs of
    compute capability 8.6 to 8.9, which run the sm_80 tile table, and on the sm_90 table's (9.x, 10.x). A100
    (sm_80) keeps the clamp, and so do float32 inputs and majors 11 and 12 (RTX 50xx: the sm_80 table spills there
    in either form, configs.forward_sign_ptx)."""
    from uvic.kernels.configs import config_arch, forward_sign_ptx

    for capability, ptx in ((80, False), (86, True), (87, True), (89, True), (90, True), (100, True), (103, True),
                            (110, False), (120, False), (121, False)):
        assert forward_sign_ptx(capability, "bf16") is forward_sign_ptx(capability, "fp16") is ptx, capability
        assert forward_sign_ptx(capability, "fp32") is False, capability
    assert config_arch(8, 6, 101376, False) == config_arch(12, 0, 101376, False) == (80, None)  # the sm_80 table


# (major, minor), opt-in shared memory per block, the SIGN_PTX the forward gets for bf16 and for fp32 inputs
SIGN_CASES = {
    "A100 sm_80": ((8, 0), 166912, False),
    "RTX 30xx sm_86": ((8, 6), 101376, True),
    "RTX 40xx sm_89": ((8, 9), 101376, True),
    "H100 sm_90": ((9, 0), 232448, True),
    "RTX 50xx sm_120": ((12, 0), 101376, False),
}


@pytest.mark.parametrize("gpu", SIGN_CASES)
def test_the_forward_launch_takes_its_sign_step_from_the_devices_capability(gpu):
    """What the launcher passes the forward kernel as SIGN_PTX, read from the recorded launch: decided by the
    device's compute capability (the launcher's cached device query), not by its tile table (sm_86 and sm_89 run
    the sm_80 table with the PTX form; A100 and sm_120 the same table with the clamp)."""
    capability, smem, ptx = SIGN_CASES[gpu]
    names = kattn.KERNEL_FNS["fwd"].arg_names
    for dtype, expected in ((torch.bfloat16, ptx), (torch.float16, ptx), (torch.float32, False)):
        q, k, v = _qkv(dtype=dtype)
        with stubbed_launches(capability, smem) as launches, torch.no_grad():
            fused_attention(q, k, v)
            assert len(launches) == 1
            kernel, _, args = launches[0]
            assert kattn._arch(q.device) == (90 if capability[0] in (9, 10) else 80)
        assert len(args) == len(names)  # every parameter, the constexprs included (triton >= 3.3)
        assert args[names.index("SIGN_PTX")] is expected, (gpu, dtype)
