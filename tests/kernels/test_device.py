"""Which GPUs the fused kernel accepts and which tiles they get, checked on CPU with faked device properties.

The CUDA side of `uvic.kernels.unsupported_reason` and of the launcher (`_arch`, `_on_device`) never runs on a
CPU-only machine; these tests run the same functions on the values a GPU would report, including under
torch.compile(fullgraph=True) with torch.cuda's internals faked (the public torch.cuda functions stay the real
ones, so Dynamo applies its real rules to them).
"""

import contextlib
import operator
import types

import pytest
import torch

import uvic.kernels as K
import uvic.kernels.attention as kattn
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


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda.get_device_properties answers from `gpu.props` (and records its calls); the device info cache
    starts empty. Only torch.cuda's private helpers are replaced."""
    gpu = types.SimpleNamespace(props=types.SimpleNamespace(major=12, minor=0, shared_memory_per_block_optin=RTX_SM86),
                                queries=[])  # fmt: skip

    def get_props(index):
        gpu.queries.append(index)
        return gpu.props

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_get_device_properties", get_props, raising=False)
    monkeypatch.setattr(K, "_CUDA_DEVICE_INFO", {})
    return gpu


def test_cuda_device_info_queries_each_device_once(fake_gpu):
    assert K.cuda_device_info(1) == (12, 0, RTX_SM86, False)
    assert K.cuda_device_info(1) == (12, 0, RTX_SM86, False)
    assert fake_gpu.queries == [1]
    fake_gpu.props.major = 9
    assert K.cuda_device_info(0)[0] == 9 and fake_gpu.queries == [1, 0]


def test_cuda_device_info_rocm(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    info = K.cuda_device_info(0)
    assert info[3] is True and "ROCm" in config_arch(*info)[1]
    assert fake_gpu.queries == []  # no property is read (ROCm torch may lack the shared memory opt-in)


def test_cuda_device_info_without_smem_optin_asks_triton(fake_gpu, monkeypatch):
    """torch 2.4-2.6 has no shared_memory_per_block_optin; triton's driver reports the same CUDA attribute."""
    import triton.runtime

    fake_gpu.props = types.SimpleNamespace(major=8, minor=6)
    utils = types.SimpleNamespace(get_device_properties=lambda index: {"max_shared_mem": RTX_SM86})
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=types.SimpleNamespace(utils=utils)))
    assert K.cuda_device_info(0) == (8, 6, RTX_SM86, False)


def test_constant_marker_is_the_one_torch_compiler_sets():
    """cuda_device_info sets assume_constant_result's attribute by hand; fail loudly if torch renames it."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    attrs = [a for a in vars(marked) if a.startswith("_dynamo")]
    assert attrs == ["_dynamo_marked_constant"]
    assert K.cuda_device_info._dynamo_marked_constant is True


def test_device_query_is_a_constant_under_torch_compile(fake_gpu):
    """fullgraph=True (a graph break would raise): the query runs once, at trace time, and leaves no graph node."""

    def f(x):
        arch, why = config_arch(*K.cuda_device_info(1))
        return x + arch if why is None else x

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        assert compiled(torch.zeros(2)).tolist() == [80.0, 80.0]
        assert compiled(torch.zeros(2)).tolist() == [80.0, 80.0]
    finally:
        torch._dynamo.reset()
    assert fake_gpu.queries == [1]
    assert len(graphs) == 1
    assert [n.target for n in graphs[0].graph.nodes if n.op == "call_function"] == [operator.add]


def test_launcher_arch_follows_config_arch(fake_gpu):
    assert kattn._arch(torch.device("cuda", 1)) == 80
    fake_gpu.props = types.SimpleNamespace(major=12, minor=0, shared_memory_per_block_optin=48 * KB)
    with pytest.raises(RuntimeError, match="cuda:0.*sm_80 tiles need"):
        kattn._arch(torch.device("cuda", 0))


def test_launches_happen_on_the_tensors_gpu():
    """Triton launches on the current CUDA device: the launcher makes q's device current (CPU: nothing to do)."""
    assert isinstance(kattn._on_device(torch.zeros(1)), contextlib.nullcontext)
    fake_cuda_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    guard = kattn._on_device(fake_cuda_tensor)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
