"""AMD: load hsaco and launch through the HIP module API (hip-python), never through Triton."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from warploop.driver.base import DriverError, GpuDriver
from warploop.target import DeviceInfo


class HipDriver(GpuDriver):
    backend = "hip"

    def __init__(self, info: DeviceInfo):
        super().__init__(info)
        from hip import hip

        self.hip = hip
        self._call(hip.hipSetDevice(info.index), "hipSetDevice")
        self._modules: dict[bytes, Any] = {}

    def _call(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != 0:
            raise DriverError(f"{what} failed on {self.info.name}: {self.error_text(err)}")
        return values[0] if len(values) == 1 else (values or None)

    def error_text(self, code: Any) -> str:
        text = self.hip.hipGetErrorString(code)
        text = text[-1] if isinstance(text, tuple) else text
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{getattr(code, 'name', code)}: {text}"

    def load(self, image: bytes, fmt: str, entry: str, shared: int) -> Any:
        if fmt != "hsaco":
            raise DriverError(f"the HIP driver loads hsaco, not {fmt}")
        module = self._modules.get(image)
        if module is None:
            module = self._modules[image] = self._call(self.hip.hipModuleLoadData(image), "hipModuleLoadData")
        return self._call(self.hip.hipModuleGetFunction(module, entry.encode()), f"hipModuleGetFunction({entry})")

    def launch_api(self, num_ctas: int, cooperative: bool, pdl: bool) -> Callable[..., tuple]:
        if num_ctas > 1 or pdl:
            raise DriverError("clusters (num_ctas > 1) and PDL are not supported on HIP; export with num_ctas=1")
        if not cooperative:
            return self.hip.hipModuleLaunchKernel
        cooperative_launch = self.hip.hipModuleLaunchCooperativeKernel

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            return cooperative_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params)

        return launch

    def as_stream(self, stream: Any) -> Any:
        return int(getattr(stream, "cuda_stream", stream) or 0) or None

    def alloc(self, nbytes: int) -> int:
        self._bind()
        return int(self._call(self.hip.hipMalloc(max(nbytes, 1)), f"hipMalloc({nbytes})"))

    def free(self, address: int) -> None:
        self._bind()
        self._call(self.hip.hipFree(address), "hipFree")

    # As on CUDA, copies wait for every stream of the device, so they never race a kernel.
    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        self._call(self.hip.hipDeviceSynchronize(), "hipDeviceSynchronize")
        self._call(self.hip.hipMemcpyHtoD(dst, src, nbytes), f"hipMemcpyHtoD({nbytes} bytes)")

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        self._call(self.hip.hipDeviceSynchronize(), "hipDeviceSynchronize (a kernel before this copy failed)")
        self._call(self.hip.hipMemcpyDtoH(dst, src, nbytes), f"hipMemcpyDtoH({nbytes} bytes)")

    def _bind(self) -> None:
        """HIP's current device is per thread; memory calls act on it."""
        self._call(self.hip.hipSetDevice(self.info.index), "hipSetDevice")
