"""CuPy glue: torch owns the memory, CuPy only compiles and launches.

Each kernels/*.cu file is compiled with NVRTC once per device (inside that CuPy device, so a
rank's kernels land on its own GPU), and every launch goes onto torch's current stream for the
tensor's device, so kernels, torch ops and NCCL are ordered with each other.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError, cupy_missing_message

_modules: dict[tuple[int, str], object] = {}
# Kernel files written for one GPU generation's own instructions: file -> (compute capability it
# runs on, the NVRTC architecture it is compiled for). The others compile for whatever GPU runs them.
ARCH_SPECIFIC = {"fused_hopper_attention.cu": ((9, 0), "sm_90a"), "fused_ws_attention.cu": ((9, 0), "sm_90a"),
                 "fused_ws_dims.cu": ((9, 0), "sm_90a"), "fused_ws_paged.cu": ((9, 0), "sm_90a"), "fused_ws_fp8.cu": ((9, 0), "sm_90a"),
                 "tiled_hopper_attention.cu": ((9, 0), "sm_90a"), "fused_hopper_backward.cu": ((9, 0), "sm_90a")}
_functions: dict[tuple[int, str, str], object] = {}
GRID_YZ_MAX = 65535
GRID_X_MAX = 2**31 - 1


def kernel_dir() -> Path:
    """kernels/ beside the package in a source tree, tpattn/kernels/ once installed."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "naive_attention.cu").is_file():
            return cand
    raise FileNotFoundError(f"kernels/*.cu not found beside {here}; reinstall tpattn")


def kernel_sources() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ConfigError(cupy_missing_message()) from exc
    return cupy


def get_function(filename: str, name: str, device_index: int):
    key = (device_index, filename, name)
    fn = _functions.get(key)
    if fn is None:
        cupy = _cupy()
        with cupy.cuda.Device(device_index):
            mod = _modules.get((device_index, filename))
            if mod is None:
                mod = _compile(cupy, filename, kernel_source(filename))
                _modules[(device_index, filename)] = mod
            fn = mod.get_function(name)  # compiles on first use, for this device's architecture
        _functions[key] = fn
    return fn


_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^#pragma once[ \t]*\n", re.M)


def kernel_source(filename: str, _seen: set[str] | None = None) -> str:
    """kernels/`filename` with each local `#include "x.cuh"` replaced by that header's text (once per
    header), so NVRTC needs no include path and CuPy's compile cache keys on the headers too."""
    seen = set() if _seen is None else _seen

    def inline(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _PRAGMA_ONCE.sub("", kernel_source(name, seen))  # the seen set does its work now
    return _INCLUDE.sub(inline, (kernel_dir() / filename).read_text())


def _compile(cupy, filename: str, src: str):
    """A module of kernels/`filename` for the current CuPy device. Arch-specific files (sm_90a: wgmma)
    go through NVRTC directly, since CuPy's RawModule picks the plain architecture (sm_90) itself."""
    spec = ARCH_SPECIFIC.get(filename)
    if spec is None:
        return cupy.RawModule(code=src, options=("--std=c++17",))
    from cupy.cuda import nvrtc

    cubin = hasattr(nvrtc, "getCUBIN")  # CuPy 9+; before it, PTX that the driver compiles on load
    arch = spec[1] if cubin else spec[1].replace("sm_", "compute_")
    prog = nvrtc.createProgram(src, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, ["--std=c++17", f"--gpu-architecture={arch}"])
        except Exception as exc:
            raise RuntimeError(f"NVRTC could not compile kernels/{filename} for {arch}: {exc}; the portable "
                               "kernels avoid it: TPATTN_FUSED_CFG=fused2_{suf}_d{d}_w4_m1_c64 for --kernel fused, "
                               f"TPATTN_TILED_IMPL=mma for --kernel tiled\n{nvrtc.getProgramLog(prog)}") from exc
        if cubin:
            image = nvrtc.getCUBIN(prog)
        else:
            image = nvrtc.getPTX(prog)
            image = (image.encode() if isinstance(image, str) else bytes(image)).rstrip(b"\0") + b"\0"
    finally:
        nvrtc.destroyProgram(prog)
    mod = cupy.cuda.function.Module()
    mod.load(bytes(image))
    return mod


def ptr(t: torch.Tensor, rows_before: int = 0) -> np.uint64:
    """t's address as a kernel parameter; rows_before: the address that many rows (dimension 2) before
    t, for a kernel told t's first row is row rows_before (TensorMap's rows_before)."""
    return np.uint64(t.data_ptr() - (rows_before * t.stride(2) * t.element_size() if rows_before else 0))


class TensorMap:
    """A TMA tensor map (CUtensorMap, 128 bytes) over a 16-bit (or e4m3: bytes) [B, H, N, D] tensor or
    strided view whose rows are contiguous: dimensions (D, N, H, B) innermost first, the byte strides of rows, heads and
    batches, a box of `box` = (columns, rows), 128-byte swizzle (the layout wgmma reads), zeros where the
    box reaches past N. A kernel parameter `const __grid_constant__ tw_tmap`; encoded by the driver
    (cuTensorMapEncodeTiled) when launched, once per distinct tensor."""

    SWIZZLE_BYTES = 128

    def __init__(self, t: torch.Tensor, box: tuple[int, int] = (64, 128), rows_before: int = 0):
        b, h, n, d = t.shape
        el = t.element_size()
        if t.dtype not in _DTYPE_CODE or t.stride(3) != 1:
            raise ValueError(f"a tensor map needs 16-bit or e4m3 values in contiguous rows (dtype {t.dtype}, strides {t.stride()})")
        # rows_before: t holds rows [rows_before, rows_before + n) of the map's rows, which start that many
        # rows before t (a kernel given rows from rows_before on never reads those)
        self.address = t.data_ptr() - rows_before * t.stride(2) * el
        n += rows_before
        self.dtype = t.dtype
        self.dims = (d, n, h, b)
        # a dimension of extent 1 is never stepped over: any legal stride does
        self.strides = tuple(s * el if size > 1 else 16 for s, size in ((t.stride(2), n), (t.stride(1), h), (t.stride(0), b)))
        self.box = box
        bad = [s for s in self.strides if s % 16 or s >= 2**40]
        if self.address % 16 or bad or box[0] * el > self.SWIZZLE_BYTES:
            raise ValueError(f"TMA needs a 16-byte aligned start and strides that are multiples of 16 bytes "
                             f"(address {self.address:#x}, strides {self.strides} bytes, box {box})")

    def key(self) -> tuple:
        return (self.address, self.dtype, self.dims, self.strides, self.box)


_tmaps: dict[tuple, ctypes.Array] = {}
_encode_tiled = None  # libcuda's cuTensorMapEncodeTiled, looked up on first use
# CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16, _UINT8 (e4m3 bytes: the map only moves them)
_DTYPE_CODE = {torch.float16: 6, torch.bfloat16: 9, torch.float8_e4m3fn: 0}


def _encode(tm: TensorMap) -> ctypes.Array:
    """A buffer holding tm's encoded 128 bytes at its first 64-byte aligned address (_aligned), cached per
    tensor description. Whoever points a kernel parameter into it keeps a reference to the buffer: the
    cache may drop its own (it is bounded) while a packed launch still uses it."""
    buf = _tmaps.get(tm.key())
    if buf is None:
        global _encode_tiled
        u32, u64 = ctypes.c_uint32, ctypes.c_uint64
        if _encode_tiled is None:
            _encode_tiled = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
            _encode_tiled.restype = ctypes.c_int
            _encode_tiled.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64),
                                      ctypes.POINTER(u64), ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn = _encode_tiled
        buf = ctypes.create_string_buffer(128 + 64)
        rc = fn(_aligned(buf), _DTYPE_CODE[tm.dtype], 4, tm.address, (u64 * 4)(*tm.dims), (u64 * 3)(*tm.strides),
                (u32 * 4)(tm.box[0], tm.box[1], 1, 1), (u32 * 4)(1, 1, 1, 1),
                0, 3, 2, 0)  # no interleave, 128-byte swizzle, L2 promotion 128 B, zeros out of bounds
        if rc != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {tm.dims}, byte strides "
                               f"{tm.strides}, box {tm.box}; the wgmma kernel without TMA avoids it at head dims 64 "
                               "and 128 (TPATTN_FUSED_CFG=fusedh_{suf}_d{d}), --kernel triton at the others")
        if len(_tmaps) >= 256:
            _tmaps.clear()
        _tmaps[tm.key()] = buf
    return buf


def _aligned(buf: ctypes.Array) -> int:
    return (ctypes.addressof(buf) + 63) & ~63


_CTYPE = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.float32: ctypes.c_float}


def pack_params(args) -> tuple[list, ctypes.Array]:
    """cuLaunchKernel's parameter array for args (numpy scalars, TensorMap objects), and the objects it
    points into, which must outlive every launch made with it."""
    keep, ptrs = [], []
    for a in args:
        if isinstance(a, TensorMap):
            buf = _encode(a)
            keep.append(buf)
            ptrs.append(_aligned(buf))
        else:
            v = _CTYPE[type(a)](a.item())
            keep.append(v)
            ptrs.append(ctypes.addressof(v))
    return keep, (ctypes.c_void_p * len(args))(*ptrs)


class Prepared:
    """A launch with everything but the stream worked out once: the function, grid, block, shared memory
    and the kernel's parameters packed for cuLaunchKernel (tensor maps encoded). Calling it launches on
    torch's current stream of the device: a kernel called again with the same tensors costs a dict
    lookup and the driver call. Needed for kernels taking tensor maps by value, which CuPy's argument
    packing does not pass."""

    def __init__(self, filename: str, name: str, device: torch.device, grid, block, args, shared_mem: int = 0):
        self.cupy = _cupy()
        self.idx = device.index if device.index is not None else torch.cuda.current_device()
        self.fn = get_function(filename, name, self.idx)
        if shared_mem > 0:  # (as launch: the 48 KiB a launch may take unasked count static shared memory too)
            _allow_shared_mem(self.cupy, self.fn, (self.idx, filename, name), shared_mem)
        _check_grid(grid)
        self.dims = (*grid, *block, shared_mem)
        self.keep, self.params = pack_params(args)  # self.keep: what the parameter array points into

    def __call__(self) -> None:
        stream = _raw_stream(self.idx)
        with self.cupy.cuda.Device(self.idx):
            self.cupy.cuda.driver.launchKernel(self.fn.ptr, *self.dims, stream, ctypes.addressof(self.params), 0)
            if os.environ.get("TPATTN_SYNC_LAUNCHES"):
                self.cupy.cuda.runtime.streamSynchronize(stream)


def _check_grid(grid) -> None:
    for g in grid[1:]:
        assert 1 <= g <= GRID_YZ_MAX, f"grid {grid} beyond the y/z limit"
    assert 1 <= grid[0] <= GRID_X_MAX, f"grid {grid} beyond the x limit"


def launch(filename: str, name: str, device: torch.device, grid, block, args, shared_mem: int = 0) -> None:
    """Launch kernel `name` of kernels/`filename` on torch's current stream of `device`, with
    `shared_mem` bytes of dynamic shared memory (the function's limit raised to it once).
    args: numpy scalars (pointers as uint64); a kernel taking tensor maps goes through Prepared."""
    cupy = _cupy()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    fn = get_function(filename, name, idx)
    if shared_mem > 0:  # (the 48 KiB a launch may take unasked count the kernel's static shared memory too)
        _allow_shared_mem(cupy, fn, (idx, filename, name), shared_mem)
    _check_grid(grid)
    with cupy.cuda.Device(idx):
        ext = _external_stream(cupy, _raw_stream(idx), idx)
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem, stream=ext)  # raises on a failed launch
        if os.environ.get("TPATTN_SYNC_LAUNCHES"):  # debugging: surface asynchronous faults here
            ext.synchronize()


_smem_limits: dict[tuple[int, str, str], int] = {}


def _allow_shared_mem(cupy, fn, key, nbytes: int) -> None:
    """cudaFuncSetAttribute(MaxDynamicSharedMemorySize), once per function and size."""
    if _smem_limits.get(key, 0) >= nbytes:
        return
    with cupy.cuda.Device(key[0]):
        try:
            fn.max_dynamic_shared_size_bytes = nbytes
        except AttributeError:
            drv = cupy.cuda.driver
            drv.funcSetAttribute(fn.ptr, getattr(drv, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8), nbytes)
    _smem_limits[key] = nbytes


_resident: dict[tuple[int, str, str, int, int], int] = {}


def resident_blocks(filename: str, name: str, device: torch.device, threads: int, shared_mem: int = 0) -> int:
    """How many blocks of `threads` threads of kernel `name` (with `shared_mem` bytes of dynamic shared
    memory) one SM holds at once, as the driver computes it from the kernel's registers and shared
    memory (cuOccupancyMaxActiveBlocksPerMultiprocessor); 0 where it cannot say (or CuPy is missing).
    Once a kernel and size."""
    try:
        import cupy
    except ImportError:  # (no kernel launches here either)
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, filename, name, threads, shared_mem)
    if key not in _resident:
        fn = get_function(filename, name, idx)
        if shared_mem > 0:  # (the function's limit raised first, as a launch of that size does)
            _allow_shared_mem(cupy, fn, (idx, filename, name), shared_mem)
        n = ctypes.c_int(0)
        try:
            with cupy.cuda.Device(idx):  # (a RawKernel's handle is the current device's)
                handle = getattr(getattr(fn, "kernel", fn), "ptr", None)  # RawModule's RawKernel, or a Function
                err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(n), ctypes.c_void_p(int(handle)), ctypes.c_int(threads), ctypes.c_size_t(shared_mem))
        except (OSError, AttributeError, TypeError):
            err = 1
        _resident[key] = n.value if err == 0 else 0
    return _resident[key]


_streams: dict[tuple[int, int], object] = {}
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(idx: int) -> int:
    """The address of torch's current stream on device idx (cudaStream_t), without building a
    torch.cuda.Stream object: what every launch asks, tens of microseconds a training step less."""
    if _current_raw_stream is not None:
        return _current_raw_stream(idx)
    return torch.cuda.current_stream(idx).cuda_stream


def _external_stream(cupy, stream: int, idx: int):
    """A CuPy view of torch's stream at address `stream` on device idx (made once per stream)."""
    key = (idx, stream)
    ext = _streams.get(key)
    if ext is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # (CuPy 14: what supersedes ExternalStream)
            ext = cupy.cuda.Stream.from_external(_StreamHandle(stream))
        else:
            ext = cupy.cuda.ExternalStream(stream, idx)
        _streams[key] = ext
    return ext


class _StreamHandle:
    """A raw stream address behind the CUDA stream protocol (__cuda_stream__: version 0, the handle)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)
