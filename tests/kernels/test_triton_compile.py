"""Ahead-of-time compile of the kernels for sm_80 and sm_90, with no GPU present.

A (kernel, config, dtype, head dim, Cog/softmax mode) is compiled by triton for GPUTarget("cuda", 80 | 90, 32)
and measured with the ptxas shipped in the triton wheel (-v): no register spills and dynamic shared memory within
what `configs.config_arch` assumes its table needs (at most the 164 KB (A100) / 228 KB (H100) limits). Runs in
spawned worker processes (see uvic.kernels.aot).

This module compiles the representative subset `representative_specs()` (every kernel at every head dim, on every
arch and dtype, plain and windowed/softcapped); `make aot-full` (`python -m uvic.kernels.aot`) compiles every
candidate, the full matrix, and runs before any change to kernels/ lands.
"""

import logging

import pytest

from uvic.kernels import SUPPORTED_HEAD_DIMS
from uvic.kernels.aot import (
    SASS_EQUAL_CLASSES,
    SASS_RATIO_TARGET,
    all_specs,
    compile_all,
    format_report,
    format_sass_mix,
    parse_sass,
    representative_specs,
    sass_mix_all,
    sass_pairs,
    sass_specs,
    sass_target_failures,
)
from uvic.kernels.configs import (
    ARCHS,
    DTYPES,
    HEAD_DIMS,
    KERNELS,
    SMEM_LIMIT,
    SMEM_NEEDED,
    TABLE_HEAD_DIMS,
    candidate_configs,
    head_dim_chunks,
    padded_width,
    stride_unit,
    table_head_dim,
)


logger = logging.getLogger(__name__)


# The module's first test compiles the representative subset (128 specs), in a cold triton cache 115 s on a
# 2-core machine (docs/kernel_math.md); loaded, that can take longer than the suite-wide --timeout, so this module
# gets its own limit.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def results():
    res = compile_all(representative_specs(), workers=2)
    logger.info("\n%s", format_report(res))
    return res


def test_matrix_covers_every_candidate():
    """Every (kernel, arch, dtype, head dim) has candidates, plain and banded, and each is compiled in both modes:
    the plain ones as causal + key padding, the banded ones as sliding window + softcap + key padding."""
    variants: dict[tuple, set] = {}
    for s in all_specs():
        banded = s.window and s.softcap
        assert s.window == banded and s.causal == (not banded and s.kernel != "bwd_pre"), s
        variants.setdefault((s.kernel, s.arch, s.dtype, s.head_dim, s.config, banded), set()).add(s.cog)
    assert {hd for _, _, _, hd, _, _ in variants} == set(SUPPORTED_HEAD_DIMS)
    for arch in ARCHS:
        for dtype in DTYPES:
            for hd in HEAD_DIMS:
                for kernel in KERNELS:
                    for banded in (False, True) if kernel != "bwd_pre" else (False,):
                        configs = candidate_configs(kernel, arch, dtype, hd, banded=banded)
                        assert configs, (kernel, arch, dtype, hd, banded)
                        for c in configs:
                            modes = {False} if kernel == "bwd_pre" else {True, False}
                            assert variants.get((kernel, arch, dtype, hd, c, banded)) == modes, (kernel, arch, dtype,
                                                                                                 hd, c, banded)


def test_representative_subset_covers_every_kernel_head_dim_arch_and_dtype():
    """`make test` compiles `representative_specs()`, a rule-chosen part of the full matrix: every kernel at every
    head dim, every kernel on every (arch, dtype) pair, and every kernel but the preprocess in both modes and both
    the plain (causal + key padding) and the banded (window + softcap + key padding) variant."""
    subset, full = representative_specs(), set(all_specs())
    assert all(s in full for s in subset) and len(set(subset)) == len(subset)
    assert {(s.kernel, s.head_dim) for s in subset} == {(k, hd) for k in KERNELS for hd in SUPPORTED_HEAD_DIMS}
    assert {(s.kernel, s.arch, s.dtype) for s in subset} == {(k, a, d) for k in KERNELS for a in ARCHS for d in DTYPES}
    attention = [k for k in KERNELS if k != "bwd_pre"]
    assert {(s.kernel, s.cog, s.window and s.softcap) for s in subset if s.kernel != "bwd_pre"} == {
        (k, cog, banded) for k in attention for cog in (True, False) for banded in (True, False)
    }
    assert len(subset) == len(KERNELS) * len(SUPPORTED_HEAD_DIMS) < len(full) / 10


def test_head_dim_chunks():
    """Every supported head dim splits into power-of-two chunks of at least 16 (a 16-bit tl.dot's reduction),
    largest first, whose sum is the head dim rounded up to a multiple of 16: at most 8 padding columns, in the last
    chunk. Powers of two from 16 are one chunk (their kernels are those of before the split)."""
    assert SUPPORTED_HEAD_DIMS == tuple(range(8, 257, 8))
    for hd in SUPPORTED_HEAD_DIMS:
        chunks = head_dim_chunks(hd)
        assert all(c >= 16 and c & (c - 1) == 0 for c in chunks), (hd, chunks)
        assert list(chunks) == sorted(set(chunks), reverse=True), (hd, chunks)
        assert padded_width(hd) == sum(chunks) == -(-hd // 16) * 16 and sum(chunks[:-1]) < hd, (hd, chunks)
    assert {hd: head_dim_chunks(hd) for hd in (8, 24, 40, 72, 80, 96, 104, 160, 232, 248)} == {
        8: (16,), 24: (32,), 40: (32, 16), 72: (64, 16), 80: (64, 16), 96: (64, 32), 104: (64, 32, 16),
        160: (128, 32), 232: (128, 64, 32, 16), 248: (256,),
    }  # fmt: skip
    assert all(head_dim_chunks(hd) == (hd,) for hd in TABLE_HEAD_DIMS)


def test_table_head_dim_and_stride_unit():
    """A head dim takes the tiles of the narrowest table head dim that holds its padded width; the launcher's
    stride unit is 8 exactly for the strides of contiguous head dims that are odd multiples of 8."""
    assert [table_head_dim(hd) for hd in (8, 16, 24, 40, 64, 72, 120, 128, 136, 248, 256)] == [
        16, 16, 32, 64, 64, 128, 128, 128, 256, 256, 256]  # fmt: skip
    for bad in (0, 12, 264):
        with pytest.raises(ValueError, match="head dim"):
            table_head_dim(bad)
    for hd in SUPPORTED_HEAD_DIMS:
        contiguous = (3 * 257 * hd, 257 * hd, hd)  # (B, nh, L, hd) with nh = 3, L = 257
        assert stride_unit(contiguous) == (8 if hd % 16 else 1), hd
    assert stride_unit((0, 0, 0)) == 1 and stride_unit((144, 72, 3)) == 1  # all of 16; a row stride of 3


@pytest.mark.slow
def test_every_config_compiles(results):
    assert len(results) == len(representative_specs())
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


# --- SASS instruction mix (the static stand-in for GPU timings, docs/kernel_math.md) -----------------------------


def test_parse_sass_counts_base_opcodes():
    text = """
        /*0070*/                   FSETP.NEU.AND P2, PT, R24, RZ, PT ;             /* 0x000000ff1800720b */
        /*0080*/              @!P3 FSEL R48, -R48, RZ, !P4 ;                        /* 0x000000ff30308208 */
        /*0090*/                   LOP3.LUT R98, R98, 0x80000000, R25, 0xb8, !PT ;  /* 0x8000000062627812 */
        /*00a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;
        .L_x_1:
        /*00b0*/                   FSEL R22, |R56|, -INF , P5 ;
    """
    assert parse_sass(text) == {"FSETP": 1, "FSEL": 2, "LOP3": 1, "HGMMA": 1}
    assert parse_sass(text, modifiers=True) == {"FSETP.NEU.AND": 1, "FSEL": 2, "LOP3.LUT": 1,
                                                "HGMMA.64x64x16.F32.BF16": 1}  # fmt: skip


@pytest.fixture(scope="module")
def sass_mix_pairs():
    """sm_90 bf16 head dim 64, no mask, the first candidate config of each kernel, Cog and softmax mode; and under
    "fwd_clamp" the forward with its sign step as the clamp (the form of the sm_80 table) instead of the PTX."""
    specs = sass_specs(dtypes=("bf16",), head_dims=(64,))
    clamp = sass_specs(dtypes=("bf16",), head_dims=(64,), kernels=("fwd",), sign_ptx=False)[0]
    assert clamp.cog and clamp.sign_ptx is False
    mixes = sass_mix_all(specs + [clamp], workers=2)
    pairs = sass_pairs(mixes[:-1])
    logger.info("\n%s", format_sass_mix(pairs))
    out = {cog.spec.kernel: (cog, soft) for cog, soft in pairs}
    out["fwd_clamp"] = (mixes[-1], out["fwd"][1])
    return out


def _score_sites(spec) -> int:
    """Score sites of a forward kernel: fp32 scores held by one thread in one of its two loop bodies (unmasked and
    masked), 2 * BLOCK_M * BLOCK_N / (32 * num_warps)."""
    cfg = spec.config
    return 2 * cfg.block_m * cfg.block_n // (32 * cfg.num_warps)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["bwd_dkdv", "bwd_dq"])
def test_sass_mix_backward_meets_targets(sass_mix_pairs, kernel):
    """Read from the compiled cubins: Cog/softmax total instructions within the target, MUFU and MMA equal."""
    cog, soft = sass_mix_pairs[kernel]
    assert cog.counts()["mma"] > 0 and cog.counts()["mufu"] > 0  # the classes are really found
    assert sass_target_failures([(cog, soft)]) == []
    assert cog.counts()["total"] <= SASS_RATIO_TARGET[kernel] * soft.counts()["total"]


@pytest.mark.slow
def test_sass_mix_forward_exp_and_mma_equal(sass_mix_pairs):
    cog, soft = sass_mix_pairs["fwd"]
    for cls in SASS_EQUAL_CLASSES:
        assert cog.counts()[cls] == soft.counts()[cls] > 0, cls


@pytest.mark.slow
def test_sass_mix_forward_sign_costs_one_per_score(sass_mix_pairs):
    """The forward's Cog mode on sm_90 pays q.k * 2**127 (one FMUL, where softmax mode multiplies by the scale
    instead), its conversion to the input dtype (one F2FP per pair of scores) and one `min.xorsign.abs` per pair
    (HMNMX2.BF16_V2.XORSIGN): at most one more instruction per score site than softmax mode, within 1.05
    ("Zero scores and masked entries" in docs/kernel_math.md)."""
    cog, soft = sass_mix_pairs["fwd"]
    sites = _score_sites(cog.spec)
    extra = cog.counts()["total"] - soft.counts()["total"]
    assert 0 < extra <= sites, (extra, sites)
    assert cog.variants.get("HMNMX2.BF16_V2.XORSIGN", 0) == cog.opcodes["HMNMX2"] == sites // 2
    assert sass_target_failures([(cog, soft)]) == []


@pytest.mark.slow
def test_sass_mix_forward_clamp_costs_at_most_one_and_a_half_per_score(sass_mix_pairs):
    """The clamp form of the sign step (the sm_80 table's): two packed HMNMX2 per pair in place of the one
    `min.xorsign.abs`, so at most 1.5 instructions per score site over softmax mode, and the same MUFU and MMA."""
    cog, soft = sass_mix_pairs["fwd_clamp"]
    sites = _score_sites(cog.spec)
    extra = cog.counts()["total"] - soft.counts()["total"]
    assert 0 < extra <= 1.5 * sites, (extra, sites)
    assert cog.opcodes.get("HMNMX2", 0) == sites and "HMNMX2.BF16_V2.XORSIGN" not in cog.variants
    assert cog.counts()["total"] > sass_mix_pairs["fwd"][0].counts()["total"]  # the PTX form is the shorter
    assert all(cog.counts()[c] == soft.counts()[c] for c in SASS_EQUAL_CLASSES)


@pytest.mark.slow
def test_sass_mix_banded_kernels_meet_targets():
    """The sliding-window + softcap kernels (with key padding: the most code a banded launch has, and the very
    specs the spill check compiles) against the same targets, sm_90 bf16 head dim 64: Cog/softmax totals within
    1.05 / 1.10, MUFU (exp2 and the softcap's tanh) and MMA counts equal."""
    specs = sass_specs(dtypes=("bf16",), head_dims=(64,), has_kpm=True, window=True, softcap=True)
    assert all(s in all_specs(archs=(90,), dtypes=("bf16",), head_dims=(64,)) for s in specs)
    pairs = sass_pairs(sass_mix_all(specs, workers=2))
    logger.info("\n%s", format_sass_mix(pairs))
    assert {cog.spec.kernel for cog, _ in pairs} == set(SASS_RATIO_TARGET)
    assert all(cog.counts()["mufu"] > 0 and cog.counts()["mma"] > 0 for cog, _ in pairs)
    assert sass_target_failures(pairs) == []
