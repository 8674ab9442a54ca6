"""NVIDIA: load cubin/PTX and launch through the CUDA driver API (cuda.bindings), never through Triton."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from warploop.driver.base import DriverError, GpuDriver
from warploop.target import DeviceInfo

_STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory


class CudaDriver(GpuDriver):
    backend = "cuda"

    def __init__(self, info: DeviceInfo):
        super().__init__(info)
        from cuda.bindings import driver as cu

        self.cu = cu
        self._call(cu.cuInit(0), "cuInit")
        device = self._call(cu.cuDeviceGet(info.index), "cuDeviceGet")
        # The primary context is the one torch and Triton use, so pointers and streams are shared.
        self.context = self._call(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        self._call(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._modules: dict[tuple[str, bytes], Any] = {}
        self._streams: dict[int, Any] = {}
        self._keep: list[Any] = []

    def _call(self, result: tuple, what: str) -> Any:
        err, *values = result
        if err != 0:
            raise DriverError(f"{what} failed on {self.info.name}: {self.error_text(err)}")
        return values[0] if len(values) == 1 else (values or None)

    def error_text(self, code: Any) -> str:
        err, text = self.cu.cuGetErrorString(code)
        name = getattr(code, "name", str(code))
        return f"{name}: {text.decode() if err == 0 and text else 'unknown error'}"

    def load(self, image: bytes, fmt: str, entry: str, shared: int) -> Any:
        cu = self.cu
        key = (fmt, image)
        module = self._modules.get(key)
        if module is None:
            data = image + b"\0" if fmt == "ptx" else image  # the driver JITs PTX; it must be NUL-terminated
            err, module = cu.cuModuleLoadData(data)
            if err != 0:
                hint = (" (the driver is too old to JIT this PTX: update it, or rebuild the bundle with "
                        f"-t cuda:{self.info.target.arch})") if fmt == "ptx" else ""
                raise DriverError(f"cuModuleLoadData({fmt}) failed on {self.info.name}: "
                                  f"{self.error_text(err)}{hint}")
            self._modules[key] = module
        function = self._call(cu.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})")
        if shared > _STATIC_SMEM_LIMIT:
            attr = cu.CUfunction_attribute
            static = self._call(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
                                "cuFuncGetAttribute")
            self._call(cu.cuFuncSetCacheConfig(function, cu.CUfunc_cache.CU_FUNC_CACHE_PREFER_SHARED),
                       "cuFuncSetCacheConfig")
            self._call(cu.cuFuncSetAttribute(function, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             self.info.shared_mem_optin - static), "cuFuncSetAttribute")
        return function

    def launch_api(self, num_ctas: int, cooperative: bool, pdl: bool) -> Callable[..., tuple]:
        cu = self.cu
        if num_ctas == 1 and not cooperative and not pdl:
            return cu.cuLaunchKernel
        ids = cu.CUlaunchAttributeID
        attrs = []
        if pdl:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if cooperative:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if num_ctas > 1:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = num_ctas, 1, 1
            attrs.append(a)
        config = cu.CUlaunchConfig()
        config.attrs, config.numAttrs = attrs, len(attrs)
        default_stream = cu.CUstream(0)
        launch_ex = cu.cuLaunchKernelEx
        self._keep.append((config, attrs))

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            # Triton's convention: the grid counts clusters; the driver wants blocks.
            config.gridDimX, config.gridDimY, config.gridDimZ = gx * num_ctas, gy, gz
            config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
            config.sharedMemBytes = shared
            config.hStream = default_stream if stream is None else stream
            return launch_ex(config, f, params, 0)

        return launch

    def _stream_object(self, handle: int) -> Any:
        stream = self._streams[handle] = self.cu.CUstream(handle)
        return stream

    def as_stream(self, stream: Any) -> Any:
        handle = int(getattr(stream, "cuda_stream", stream) or 0)
        return None if handle == 0 else (self._streams.get(handle) or self._stream_object(handle))

    def alloc(self, nbytes: int) -> int:
        self._bind()
        return int(self._call(self.cu.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes})"))

    def free(self, address: int) -> None:
        self._bind()
        self._call(self.cu.cuMemFree(address), "cuMemFree")

    # Copies synchronize the whole context first: torch's streams do not wait for the legacy
    # default stream that cuMemcpy uses, and a simple array must never race a kernel.
    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        self._call(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        self._call(self.cu.cuMemcpyHtoD(dst, src, nbytes), f"cuMemcpyHtoD({nbytes} bytes)")

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        self._call(self.cu.cuCtxSynchronize(), "cuCtxSynchronize (a kernel before this copy failed)")
        self._call(self.cu.cuMemcpyDtoH(dst, src, nbytes), f"cuMemcpyDtoH({nbytes} bytes)")

    def _bind(self) -> None:
        """Memory calls act on the calling thread's current context, which may not be ours yet."""
        self._call(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def recover(self, code: Any) -> bool:
        """A thread with no current context gets CUDA_ERROR_INVALID_CONTEXT: bind ours, then retry."""
        if code == self.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            return self.cu.cuCtxSetCurrent(self.context)[0] == 0
        return False
