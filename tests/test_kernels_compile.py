"""Every kernels/*.cu compiles for sm_80 and sm_90 with nvcc (NVRTC compiles the same source on the GPU)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tpattn.config import ConfigError
from tpattn.cuda import ARCH_SPECIFIC, kernel_dir, kernel_source, kernel_sources

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def test_there_are_kernels():
    names = [p.name for p in kernel_sources()]
    assert "naive_attention.cu" in names


def _targets():
    """(file, arch): every file for sm_80 and sm_90, an arch-specific one (wgmma) for its own arch only."""
    for src in kernel_sources():
        spec = ARCH_SPECIFIC.get(src.name)
        for arch in ([spec[1]] if spec else ["sm_80", "sm_90"]):
            yield pytest.param(src, arch, id=f"{src.name}-{arch}")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler here (.ci/run installs one in CI)")
@pytest.mark.parametrize("src,arch", list(_targets()))
def test_kernel_compiles(src, arch, tmp_path):
    gencode = f"arch={arch.replace('sm_', 'compute_')},code={arch}"
    inlined = tmp_path / src.name  # the source as NVRTC gets it: local headers inlined
    inlined.write_text(kernel_source(src.name))
    r = subprocess.run([NVCC, "-gencode", gencode, "-Werror", "all-warnings", "-Xptxas", "-v", "-c", str(inlined),
                        "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # ptxas says so when it has to serialize wgmma (a pipeline the kernel relies on, lost)
    assert "serialized" not in r.stderr, r.stderr
    syms = subprocess.run(["nm", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
    if src.name == "naive_attention.cu":
        for k in ("qkKernel", "softmaxKernel", "pvKernel"):
            for suf in ("f16", "bf16", "f32"):
                assert f"{k}_{suf}" in syms


def test_the_backward_runs_on_wgmma_on_hopper_only(monkeypatch):
    from tpattn.attention.fused import HOPPER_BWD_SOURCE, bwd_kernels
    assert ARCH_SPECIFIC[HOPPER_BWD_SOURCE][0] == (9, 0)
    monkeypatch.delenv("TPATTN_FUSED_BWD", raising=False)
    assert bwd_kernels((9, 0)) == "wgmma" and bwd_kernels((8, 0)) == bwd_kernels((12, 0)) == "mma"
    monkeypatch.setenv("TPATTN_FUSED_BWD", "mma")
    assert bwd_kernels((9, 0)) == "mma"
    monkeypatch.setenv("TPATTN_FUSED_BWD", "wgmma")
    with pytest.raises(ConfigError, match="compute capability 9.0"):
        bwd_kernels((8, 9))
    monkeypatch.setenv("TPATTN_FUSED_BWD", "fast")
    with pytest.raises(ConfigError, match="use mma or wgmma"):
        bwd_kernels((9, 0))


def test_the_five_product_kernel_is_chosen_by_head_dim_and_fits(monkeypatch):
    """The warp-specialized five-product kernel at d = 128 and for strided operands, the red.global.add one
    at d = 64 on contiguous ones (measured),
    TPATTN_FUSED_BWD5 overriding either, anything else refused in one line; hbwd5w_kv's shared memory
    (its layout in fused_hopper_backward.cu) within the 227 KB a block may have on 9.0, and its symbols
    in the source for both dtypes and head dims."""
    from tpattn.attention.fused import HOPPER_BWD_SOURCE, bwd5_kernel, bwd5w_shared_mem
    monkeypatch.delenv("TPATTN_FUSED_BWD5", raising=False)
    assert bwd5_kernel(128) == "ws" and bwd5_kernel(64) == "red"
    assert bwd5_kernel(64, strided=True) == bwd5_kernel(128, strided=True) == "ws"
    monkeypatch.setenv("TPATTN_FUSED_BWD5", "red")
    assert bwd5_kernel(128) == "red"
    monkeypatch.setenv("TPATTN_FUSED_BWD5", "ws")
    assert bwd5_kernel(64) == "ws"
    monkeypatch.setenv("TPATTN_FUSED_BWD5", "bulk")
    with pytest.raises(ConfigError, match="use ws or red"):
        bwd5_kernel(128)
    assert bwd5w_shared_mem(64) < bwd5w_shared_mem(128) <= 227 * 1024
    src = (kernel_dir() / HOPPER_BWD_SOURCE).read_text()
    assert "hbwd5w_kv_##SUF##_d##D" in src and "setmaxnreg" in src


def test_hopper_kernels_exist_and_are_refused_elsewhere(monkeypatch):
    from tpattn.attention.fused import HOPPER_SOURCE, WS_SOURCE, kernel_for
    for src in (HOPPER_SOURCE, WS_SOURCE):
        assert src in ARCH_SPECIFIC and ARCH_SPECIFIC[src][0] == (9, 0)
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    assert kernel_for(128, "f16", (9, 0)).source == WS_SOURCE
    assert kernel_for(128, "f16", (9, 0)).threads == 384  # a producer and two consumer warpgroups
    assert kernel_for(128, "f16", (9, 0), wide=False).source not in (HOPPER_SOURCE, WS_SOURCE)  # too few tiles
    assert kernel_for(128, "f16", (8, 0)).source not in (HOPPER_SOURCE, WS_SOURCE)
    for name in ("fusedh_{suf}_d{d}", "fusedw_{suf}_d{d}"):
        monkeypatch.setenv("TPATTN_FUSED_CFG", name)
        with pytest.raises(ConfigError, match="compute capability 9.0"):
            kernel_for(64, "bf16", (8, 9))



def test_fusedw_shared_memory_matches_its_stages(monkeypatch):
    """fusedw's shared memory: QS Q stages of 128 rows, 2 x KVS K/V stages of BC keys (the .cu file's
    and the host's QS, KVS and BC agree), barriers and tile numbers; within the 227 KB a block may have
    on 9.0, at every head dim it is built for (192 and 256: tiles of 64 keys, one Q stage at 256; 32,
    80, 96 and 160 on the kernel of the next of 64, 128 and 192, in fused_ws_dims.cu)."""
    from tpattn.attention.fused import (HEAD_DIMS, OTHER_HEAD_DIMS, PAGED_HEAD_DIMS, WS_DIMS_SOURCE, WS_KEY_TILE,
                                        WS_KV_STAGES, WS_PAGED_SOURCE, WS_Q_STAGES, WS_SOURCE, WS_TILE_DIM, kernel_for)
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    src = kernel_source("fused_ws_attention.cu")
    assert "BC = D > 128 ? 64 : 128" in src and WS_KEY_TILE == {64: 128, 128: 128, 192: 64, 256: 64}
    assert "QS = D == 256 ? 1 : 2, KVS = D == 64 || F8 ? 4 : 2" in src
    # the FP8 build (fused_ws_fp8.cu): 16-bit-sized Q stages (O is staged there), four K and four V stages
    # of 128 x 128 bytes; the host's launch asks for exactly that
    from tpattn.attention import fp8_ws
    assert "#define TW_FP8" in kernel_source(fp8_ws.SOURCE) and ARCH_SPECIFIC[fp8_ws.SOURCE] == ((9, 0), "sm_90a")
    assert "QB = BR * D * 2, KB = BC * D * EL" in src
    assert fp8_ws.SHARED == (2 * 128 * 128 * 2 + 2 * 4 * 128 * 128) + 1280 <= 232448
    for suf, bf in (("f16", "false"), ("bf16", "true")):
        assert f"TW_DEFINE_F8({suf}, {bf})" in src.split("#elif defined(TW_FP8)")[1].split("#elif")[0]
    assert WS_Q_STAGES == {64: 2, 128: 2, 192: 2, 256: 1} and WS_KV_STAGES == {64: 4, 128: 2, 192: 2, 256: 2}
    paged, rest = src.split("#if defined(TW_PAGED)")[1].split("#elif !defined(TW_OTHER_DIMS)")
    main, dims = rest.split("#else")
    assert "#define TW_OTHER_DIMS" in kernel_source(WS_DIMS_SOURCE)
    # fused_ws_paged.cu: the paged build (K/V through a block table) at d = 64 and 128, fusedw's tiles
    assert "#define TW_PAGED" in kernel_source(WS_PAGED_SOURCE) and PAGED_HEAD_DIMS == (64, 128)
    for d in PAGED_HEAD_DIMS:
        for suf, bf in (("f16", "false"), ("bf16", "true")):
            assert f"TW_DEFINE_PG(fusedw, {suf}, {bf}, {d}, 2)" in paged
    for d in HEAD_DIMS:
        t = WS_TILE_DIM.get(d, d)
        assert t in (64, 128, 192, 256) and d <= t and d % 8 == 0
        built = f"TW_DEFINE(fusedw, bf16, true, {d}, 2)" if t == d else f"TW_DEFINE_DS(fusedw, bf16, true, {t}, 2, {d})"
        assert built in (dims if d in OTHER_HEAD_DIMS else main)
        ch = kernel_for(d, "bf16", (9, 0))
        assert ch.name == f"fusedw_bf16_d{d}" and ch.source == (WS_DIMS_SOURCE if d in OTHER_HEAD_DIMS else WS_SOURCE)
        assert ch.shared == (WS_Q_STAGES[t] * 128 + 2 * WS_KV_STAGES[t] * WS_KEY_TILE[t]) * t * 2 + 1280
        assert ch.shared <= 232448
    # fusedw3 (d = 64): two Q stages of 192 rows, three consumer warpgroups
    ch = kernel_for(64, "bf16", (9, 0), rows=4096)
    assert ch.name == "fusedw3_bf16_d64" and (ch.threads, ch.rows) == (512, 192)
    assert ch.shared == (2 * 192 + 2 * WS_KV_STAGES[64] * 128) * 64 * 2 + 1280 <= 232448
    # the producer warpgroup (the loader and the three O writer warps) at 32, the consumers at 160: 64 K registers
    assert "setmaxnreg.inc.sync.aligned.u32 160" in src and "setmaxnreg.dec.sync.aligned.u32 32" in src
    assert 32 * 128 + 160 * 384 <= 65536


@pytest.mark.parametrize("n,w3", [(64, False), (197, False), (257, True), (300, True), (640, False), (1024, True),
                                  (4096, True), (16384, True)])
def test_fusedw3_where_192_row_tiles_pad_little(monkeypatch, n, w3):
    """At d = 64 the three-consumer kernel (192-row tiles) where its rows are at most W3_PAD times the
    128-row kernel's: N = 197 stays on 128-row tiles (384 rows against 256); d = 128 always does."""
    from tpattn.attention.fused import kernel_for
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    assert kernel_for(64, "f16", (9, 0), rows=n).name == ("fusedw3_f16_d64" if w3 else "fusedw_f16_d64")
    assert kernel_for(128, "f16", (9, 0), rows=n).name == "fusedw_f16_d128"
    assert kernel_for(64, "f16", (8, 0), rows=n).name.startswith("fused2_")
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedw3_{suf}_d{d}")
    with pytest.raises(ConfigError, match="fusedw3 is for head dim 64 only .* use fusedw_"):
        kernel_for(128, "f16", (9, 0), rows=n)

class _FakeNvrtc:
    """Stands in for cupy.cuda.nvrtc: records the options, returns a PTX string or fails."""
    def __init__(self, fail=False, cubin=True):
        self.fail, self.options, self.destroyed = fail, None, False
        if cubin:
            self.getCUBIN = lambda prog: b"CUBIN"

    def createProgram(self, src, name, headers, include_names):
        self.src = src
        return 1

    def compileProgram(self, prog, options):
        self.options = options
        if self.fail:
            raise RuntimeError("NVRTC_ERROR_COMPILATION (6)")

    def getPTX(self, prog):
        return ".target sm_90a"

    def getProgramLog(self, prog):
        return "kern.cu(1): error: something"

    def destroyProgram(self, prog):
        self.destroyed = True


def _fake_cupy(monkeypatch, nvrtc):
    import sys
    import types
    loaded = []
    module = types.SimpleNamespace(load=loaded.append, get_function=lambda name: name)
    cuda = types.SimpleNamespace(nvrtc=nvrtc, function=types.SimpleNamespace(Module=lambda: module))
    cupy = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nvrtc", nvrtc)
    return cupy, loaded


@pytest.mark.parametrize("cubin", [True, False])
def test_hopper_files_compile_for_sm_90a_through_nvrtc(monkeypatch, cubin):
    from tpattn import cuda
    nv = _FakeNvrtc(cubin=cubin)
    cupy, loaded = _fake_cupy(monkeypatch, nv)
    cuda._compile(cupy, "fused_hopper_attention.cu", "// source")
    assert f"--gpu-architecture={'sm_90a' if cubin else 'compute_90a'}" in nv.options and nv.destroyed
    assert loaded == [b"CUBIN" if cubin else b".target sm_90a\0"]


def test_hopper_compile_failure_names_the_portable_kernels(monkeypatch):
    from tpattn import cuda
    nv = _FakeNvrtc(fail=True)
    cupy, _ = _fake_cupy(monkeypatch, nv)
    with pytest.raises(RuntimeError, match="TPATTN_TILED_IMPL=mma") as e:
        cuda._compile(cupy, "tiled_hopper_attention.cu", "// source")
    assert "error: something" in str(e.value) and nv.destroyed


def test_kernel_source_inlines_the_local_headers_once():
    src = kernel_source("fused_hopper_attention.cu")
    assert '#include "' not in src
    # hopper_common.cuh and tc_common.cuh, each once, before the kernel that uses them
    assert src.count("struct __attribute__((aligned(16))) tc_u4") == 1
    assert src.index("hw_desc(tc_u32 addr") < src.index("extern \"C\" __global__")
    assert kernel_source("naive_attention.cu") == (kernel_dir() / "naive_attention.cu").read_text()
