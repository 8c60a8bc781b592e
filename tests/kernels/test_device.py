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
