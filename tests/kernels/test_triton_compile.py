"""Ahead-of-time compile of every kernel config the autotuner can pick, for sm_80 and sm_90, with no GPU present.

Each (kernel, config, dtype, head dim, Cog/softmax mode) is compiled by triton for GPUTarget("cuda", 80 | 90, 32)
and measured with the ptxas shipped in the triton wheel (-v): no register spills and dynamic shared memory under
the 164 KB (A100) / 228 KB (H100) limits. Runs in spawned worker processes (see uvic.kernels.aot).
"""

import logging

import pytest

from uvic.kernels.aot import all_specs, compile_all, format_report
from uvic.kernels.configs import ARCHS, DTYPES, HEAD_DIMS, KERNELS, SMEM_LIMIT, SMEM_NEEDED, candidate_configs


logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def results():
    res = compile_all(all_specs(), workers=2)
    logger.info("\n%s", format_report(res))
    return res


def test_matrix_covers_every_candidate():
    specs = all_specs()
    for arch in ARCHS:
        for dtype in DTYPES:
            for hd in HEAD_DIMS:
                for kernel in KERNELS:
                    modes = {False} if kernel == "bwd_pre" else {True, False}
                    for c in candidate_configs(kernel, arch, dtype, hd):
                        got = {s.cog for s in specs if (s.kernel, s.arch, s.dtype, s.head_dim, s.config)
                               == (kernel, arch, dtype, hd, c)}  # fmt: skip
                        assert got == modes, (kernel, arch, dtype, hd, c)


@pytest.mark.slow
def test_every_config_compiles(results):
    assert len(results) == len(all_specs())
    assert all(r.registers > 0 for r in results)


@pytest.mark.slow
def test_no_register_spills(results):
    spills = [r for r in results if r.spills]
    assert not spills, "configs that spill:\n" + format_report(spills)


@pytest.mark.slow
def test_shared_memory_within_limits(results):
    over = [r for r in results if r.shared > SMEM_LIMIT[r.spec.arch]]
    assert not over, "configs over the shared memory limit:\n" + format_report(over)
    # the 16-bit configs really use shared memory (the numbers are read, not defaulted)
    assert max(r.shared for r in results if r.spec.kernel == "fwd") > 16 * 1024


@pytest.mark.slow
def test_shared_memory_within_what_config_arch_assumes(results):
    """`config_arch` gives a GPU a table only if the GPU grants SMEM_NEEDED[arch]: no candidate may need more."""
    for arch in ARCHS:
        need = max(r.shared for r in results if r.spec.arch == arch)
        assert need <= SMEM_NEEDED[arch], f"sm_{arch} candidates need {need} bytes: raise SMEM_NEEDED[{arch}]"
