"""Which GPUs the fused kernel accepts and which tiles they get.

`config_arch` decides from the four values a GPU reports (major, minor, opt-in shared memory, ROCm), so it is
checked on CPU with the values of real GPUs; the device query itself (`cuda_device_info`) needs a GPU.
"""

import operator

import pytest
import torch

from uvic.attention import unsupported_reason
from uvic.kernels import cuda_device_info
from uvic.kernels.configs import SMEM_LIMIT, SMEM_NEEDED, config_arch


KB = 1024
# shared_memory_per_block_optin as CUDA reports it
A100, RTX_SM86, H100 = 166912, 101376, 232448  # sm_89 (RTX 40xx) and sm_120/121 (RTX 50xx, GB10) report 101376 too


@pytest.mark.parametrize(
    "major,minor,smem,arch",
    [
        (8, 0, A100, 80),
        (8, 6, RTX_SM86, 80),
        (8, 9, RTX_SM86, 80),
        (8, 7, A100, 80),  # Jetson Orin
        (9, 0, H100, 90),
        (10, 0, H100, 90),  # B200: the sm_90 table, which the AOT check verifies for sm_90 only
        (12, 0, RTX_SM86, 80),  # RTX 50xx: 99 KB per block, too little for the sm_90 tiles
        (12, 1, RTX_SM86, 80),
        (11, 0, A100, 80),  # a future major is treated as sm_80 class when its shared memory allows
    ],
)
def test_config_arch_picks_a_table_that_fits(major, minor, smem, arch):
    assert config_arch(major, minor, smem, False) == (arch, None)
    assert smem >= SMEM_NEEDED[arch]


@pytest.mark.parametrize(
    "major,minor,smem,is_hip,words",
    [
        (9, 4, 65536, True, "ROCm"),  # MI300X: torch reports it as CUDA capability 9.4
        (8, 0, A100, True, "ROCm"),
        (7, 5, 65536, False, "8.0 or newer"),  # T4
        (7, 0, 98304, False, "sm_70"),
        (12, 0, 64 * KB, False, "sm_80 tiles need up to 96 KB"),
        (9, 0, 160 * KB, False, "sm_90 tiles"),  # majors 9 and 10 never fall back to the sm_80 table
    ],
)
def test_config_arch_refuses_with_a_reason(major, minor, smem, is_hip, words):
    arch, why = config_arch(major, minor, smem, is_hip)
    assert arch is None and words in why


def test_smem_needs_fit_the_limits():
    for arch in (80, 90):
        assert SMEM_NEEDED[arch] <= SMEM_LIMIT[arch]
    assert SMEM_NEEDED[80] <= RTX_SM86  # why sm_86/89/120 can run the sm_80 tiles


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
def test_cuda_device_info_reports_the_devices_properties():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    major, minor, smem, is_rocm = cuda_device_info(index)
    assert (major, minor) == torch.cuda.get_device_capability(index)
    assert is_rocm == (torch.version.hip is not None)
    if not is_rocm and hasattr(props, "shared_memory_per_block_optin"):
        assert smem == props.shared_memory_per_block_optin


def _trace_envelope_check(q):
    """Compile `x + 1 if unsupported_reason(x, x, x, backend="triton") is None else x - 1` with fullgraph=True (a
    graph break raises); returns (output, the call_function targets of the one graph)."""

    def f(x):
        why = unsupported_reason(x, x, x, backend="triton")
        return x + 1 if why is None else x - 1

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend=backend, fullgraph=True)(q)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    return out, [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]


@requires_cuda
def test_envelope_check_is_a_constant_under_torch_compile():
    """fullgraph=True: the device query inside the kernel's envelope check runs at trace time and leaves no graph
    node. The branch was decided at trace time: one of the two ops, and this GPU is inside the envelope. (Dynamo
    may add a getattr node of its own: torch 2.11 does on an H100.)"""
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    out, targets = _trace_envelope_check(q)
    torch.testing.assert_close(out, q + 1)
    assert operator.add in targets and operator.sub not in targets


@pytest.mark.parametrize("device_type", ["cpu", "meta"])
def test_envelope_check_compiles_without_graph_breaks_on_cpu(device_type):
    """The same fullgraph=True trace for tensors the kernel refuses (CPU without TRITON_INTERPRET): the checks before
    the device test (triton installed, the interpreter switch) trace without a break, so a compiled model calling
    the op on any device keeps one graph. (A per-call `importlib.util.find_spec` broke the graph under torch 2.11;
    torch 2.14 traces it, so on this project's CPU build the test guards the property, not that regression.)"""
    q = torch.randn(1, 2, 16, 64, device=device_type)
    out, targets = _trace_envelope_check(q)
    assert operator.sub in targets
    if device_type == "cpu":
        torch.testing.assert_close(out, q - 1)


# ---------------------------------------------------------------------------------------------------------
# The launch path on a GPU: launch plans and CUDA graphs
# ---------------------------------------------------------------------------------------------------------


def _out_and_grads(fn, q, k, v):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # the same memory (and alignment) as q, k, v
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out) / out.numel() ** 0.5)
    return [out.detach(), *grads]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True, "mask": True}, {"window": (31, 0), "softcap": 30.0}, {"scale": -0.2}, {"cog": False}],
    ids=["plain", "causal+mask", "window+softcap", "negative scale", "softmax mode"],
)
def test_replayed_launches_give_the_first_calls_values_on_gpu(monkeypatch, kw):
    """The first call of a shape goes through triton's autotuner and JIT and records a launch plan; the next calls
    replay it (`uvic.kernels.attention._PLANS`). Outputs and gradients are bitwise those of the first call, and a
    q that is not 16-byte aligned (its own plan, triton's unaligned specialization) gives the same values."""
    import uvic.kernels.attention as kattn
    from uvic.kernels.ops import fused_attention

    monkeypatch.setattr(kattn, "_PLANS", {})
    kw = dict(kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 3, 300, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    if kw.pop("mask", False):
        kw["key_padding_mask"] = torch.rand(2, 300, device="cuda", generator=g) > 0.2
    fn = lambda q, k, v: fused_attention(q, k, v, **kw)
    first = _out_and_grads(fn, q, k, v)
    assert len(kattn._PLANS) == 2  # forward and backward
    for _ in range(2):
        for a, b in zip(first, _out_and_grads(fn, q, k, v)):
            assert torch.equal(a, b)
    q_off = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert q_off.data_ptr() % 16
    for _ in range(2):
        for a, b in zip(first, _out_and_grads(fn, q_off, k, v)):
            torch.testing.assert_close(a, b)
    assert len(kattn._PLANS) == 4


@pytest.mark.gpu
@requires_cuda
def test_uvic_block_in_cuda_graphs_matches_eager():
    """`torch.compile(mode="reduce-overhead")` over a U-ViC block (bf16 autocast, Cog attention through the fused
    kernel's custom ops, forward and backward) runs as CUDA graphs with no cudagraph skip, and gives bitwise what
    the same compile without CUDA graphs gives, and eager's values up to the rounding of Inductor's fusions."""
    from torch._dynamo.utils import counters

    from uvic.models.uvit import UViTBlock

    torch.manual_seed(0)
    block = UViTBlock(dim=512, num_heads=8, attention="cog").cuda()
    x = torch.randn(8, 257, 512, device="cuda")
    dy = torch.randn(8, 257, 512, device="cuda")

    def step(fn):
        """Output and parameter + input gradients of one forward + backward, cloned (CUDA graph outputs are reused
        by the next replay)."""
        torch.compiler.cudagraph_mark_step_begin()
        xs = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xs)
        grads = torch.autograd.grad(y, [xs, *block.parameters()], dy)
        return [y.detach().float().clone(), *(gr.float().clone() for gr in grads)]

    eager = step(block)
    torch._dynamo.reset()
    compiled = torch.compile(block)
    plain = [step(compiled) for _ in range(3)][-1]
    torch._dynamo.reset()
    counters.clear()
    graphed = torch.compile(block, mode="reduce-overhead")
    runs = [step(graphed) for _ in range(4)]  # warm-up, record, then replays
    torch._dynamo.reset()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for run in runs[1:]:
        for a, b in zip(run, plain):
            assert torch.equal(a, b)
    eps = torch.finfo(torch.bfloat16).eps
    for a, e in zip(plain, eager):
        assert (a - e).abs().max() <= 8 * eps * e.abs().max()
