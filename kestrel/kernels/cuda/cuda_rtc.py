"""CUDA C++ kernels compiled at run time: NVRTC builds a cubin, the driver API loads and launches it (ctypes, no
build step, no nvcc). Launches take the two Hopper attributes Triton's launcher does not give us together:
programmatic dependent launch (PDL, kestrel/kernels/triton/pdl.py) and a thread-block cluster shape.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel that CUDA builds of torch depend on (or a CUDA toolkit); it needs no
GPU, so CPU machines with the wheel can compile (tests/test_cluster_decode.py checks registers and spills).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.envs import cache_home, switches

CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("dims", ctypes.c_uint * 3), ("flag", ctypes.c_int), ("pad", ctypes.c_char * 64)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def nvrtc() -> ctypes.CDLL:
    """libnvrtc: the loader's path first, then the nvidia-* wheels beside torch, then CUDA_HOME."""
    candidates = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]")))
    candidates += sorted(glob.glob(os.path.join(switches().cuda_home, "lib64", "libnvrtc.so*")))
    for name in candidates:
        if "builtins" in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("NVRTC not found: install the nvidia-cuda-nvrtc wheel or a CUDA toolkit")


def nvrtc_available() -> bool:
    try:
        nvrtc()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    ptx: str
    log: str            # NVRTC's log (ptxas -v: registers, spills, shared memory)
    defines: tuple[tuple[str, int], ...] = ()

    def registers(self) -> int:
        found = re.search(r"Used (\d+) registers", self.log)
        return int(found.group(1)) if found else -1

    def shared_bytes(self) -> int:
        """Static shared memory a block of this kernel takes (0 when ptxas reports none)."""
        found = re.search(r"(\d+) bytes smem", self.log)
        return int(found.group(1)) if found else 0

    def spill_bytes(self) -> int:
        found = re.findall(r"(\d+) bytes spill (?:stores|loads)", self.log)
        return sum(int(n) for n in found)


COMMON_HEADER = Path(__file__).with_name("kestrel_cuda.cuh")   # what the kernels share; #include "kestrel_cuda.cuh"


def cache_dir() -> Path:
    """Where compiled cubins are kept between runs (as Triton keeps its kernels): $XDG_CACHE_HOME/kestrel/nvrtc."""
    return cache_home() / "kestrel" / "nvrtc"


def compile_cubin(source: str, name: str, arch: str, defines: dict[str, int]) -> Compiled:
    """Compile `source` for `arch` (e.g. "sm_90") with -D defines, or take the cubin an earlier compile of the same
    source, header, defines and NVRTC version left in cache_dir(); raises with NVRTC's log on errors."""
    version = nvrtc_version()
    key = hashlib.sha256(repr((source, COMMON_HEADER.read_text(), name, arch, sorted(defines.items()),
                               version)).encode()).hexdigest()
    path = cache_dir() / f"{name}-{key[:32]}.pkl"
    try:
        compiled = pickle.loads(path.read_bytes())
        if isinstance(compiled, Compiled):
            return compiled
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
        pass   # not cached (or unreadable): compile
    compiled = _compile(source, name, arch, defines)
    try:   # written whole, then renamed: a reader never sees half a file (other processes compile alongside)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(compiled))
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only home: compile again next time
    return compiled


def nvrtc_version() -> tuple[int, int]:
    lib = nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    return major.value, minor.value


def _compile(source: str, name: str, arch: str, defines: dict[str, int]) -> Compiled:
    lib = nvrtc()
    prog = ctypes.c_void_p()
    header = (ctypes.c_char_p * 1)(COMMON_HEADER.read_bytes())
    include_name = (ctypes.c_char_p * 1)(COMMON_HEADER.name.encode())
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 1,
                                             header, include_name))
    try:
        options = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v"]
        options += [f"-D{key}={value}" for key, value in defines.items()]
        array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != 0:
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode()}")
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cubin))
        _nvrtc_check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetPTX(prog, ptx))
        return Compiled(cubin.raw, ptx.value.decode(), log.value.decode(), tuple(defines.items()))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status).decode()}")


def device_arch(device: int) -> str:
    """The NVRTC architecture of a CUDA device, e.g. "sm_90"."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    return lib


def device_attribute(device: int, attribute: int) -> int:
    """cuDeviceGetAttribute (e.g. 13: the SM clock rate in kHz)."""
    value = ctypes.c_int()
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "cuDeviceGetAttribute")
    return value.value


def _check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {status} ({(text.value or b'?').decode()})")


def _make_primary_context_current(device_index: int) -> None:
    """The module must load into the context torch launches in: the device's primary context. A thread that has
    not touched the device through the runtime yet has no current context, so set it (no sync: this may run
    while a stream is capturing)."""
    current = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(_driver().cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(_driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    _check(_driver().cuCtxSetCurrent(context), "cuCtxSetCurrent")


_loaded: list["Kernel"] = []   # every kernel loaded in this process, for benchmarks that report what ran


def loaded_kernels() -> list["Kernel"]:
    return list(_loaded)


class Kernel:
    """A loaded kernel (in the device's primary context, the one torch uses) and its launch."""

    def __init__(self, compiled: Compiled, name: str, device: torch.device, non_portable_cluster: bool = False):
        with torch.cuda.device(device):
            _make_primary_context_current(device.index)
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_driver().cuModuleLoadData(ctypes.byref(module), compiled.cubin), "cuModuleLoadData")
            _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                   "cuModuleGetFunction")
            if non_portable_cluster:
                _check(_driver().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                                    1), "cuFuncSetAttribute")
        self.module, self.function, self.compiled, self.name = module, function, compiled, name
        _loaded.append(self)

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        _check(_driver().cuFuncGetAttribute(ctypes.byref(value), attribute, self.function), "cuFuncGetAttribute")
        return value.value

    def launch(self, grid: tuple[int, int, int], block: int, args: list, stream: torch.cuda.Stream,
               cluster: int = 1, pdl: bool = False) -> None:
        """Launch on `stream` (captured like any launch when the stream is capturing). args: ctypes values in
        the kernel's parameter order."""
        attrs = (_LaunchAttribute * 2)()
        count = 0
        if cluster > 1:
            attrs[count].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attrs[count].value.dims[:] = [cluster, 1, 1]
            count += 1
        if pdl:
            attrs[count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[count].value.flag = 1
            count += 1
        config = _LaunchConfig()
        config.grid[:] = list(grid)
        config.block[:] = [block, 1, 1]
        config.stream = stream.cuda_stream
        config.attrs = attrs
        config.num_attrs = count
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        _check(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None), "cuLaunchKernelEx")
