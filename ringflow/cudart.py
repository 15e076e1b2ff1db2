"""The CUDA runtime through cuda-python, for the few calls torch does not expose."""

from __future__ import annotations

from ringflow.errors import KernelError


def runtime():
    """cuda-python's runtime module (``cuda.bindings.runtime``; ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        from cuda import cudart as rt
    return rt


def checked(name: str, result, error: type[Exception], hint: str):
    """The values of a cuda-python call's result tuple, or ``error`` naming the call and ``hint``."""
    rt = runtime()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise error(f"cuda-python {name} failed with {err}; {hint}")
    return rest[0] if len(rest) == 1 else rest


def _pinned_host(ptr: int):
    """``ptr``'s pointer attributes if it addresses pinned host memory, else None."""
    rt = runtime()
    attrs = checked("cudaPointerGetAttributes", rt.cudaPointerGetAttributes(ptr), KernelError,
                    "the pointer is not one CUDA knows")
    return attrs if attrs.type == rt.cudaMemoryType.cudaMemoryTypeHost else None


def in_host_memory(ptr: int) -> bool:
    """Whether ``ptr`` (a CUDA tensor's ``data_ptr()``, say) addresses pinned host memory that
    the GPU reads across the host link, as vLLM's UVA offloader leaves its parameters."""
    return _pinned_host(ptr) is not None


def host_address(ptr: int) -> int:
    """The host's address of the pinned host memory a CUDA pointer ``ptr`` addresses (the same
    number under unified addressing), for reading it on the CPU."""
    attrs = _pinned_host(ptr)
    if attrs is None:
        raise KernelError(f"pointer {ptr:#x} is not pinned host memory")
    return int(attrs.hostPointer)


def device_address(ptr: int) -> int:
    """The device's address of pinned host memory at host address ``ptr`` (a pinned CPU
    tensor's ``data_ptr()``), for the GPU to read or write it."""
    rt = runtime()
    return int(checked("cudaHostGetDevicePointer", rt.cudaHostGetDevicePointer(ptr, 0),
                       KernelError, "the memory must be pinned by CUDA (pin_memory())"))


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes`` from ``src`` to ``dst`` on ``stream`` (a handle), the
    direction read from the pointers (unified addressing): a copy engine's DMA between device
    memory and pinned host memory, also where the host side is a CUDA view of pinned memory
    (vLLM's UVA offloader's parameters), which torch would copy as device-to-device."""
    rt = runtime()
    checked("cudaMemcpyAsync", rt.cudaMemcpyAsync(dst, src, nbytes,
                                                  rt.cudaMemcpyKind.cudaMemcpyDefault, stream),
            KernelError, "both sides must be device memory or pinned host memory")
