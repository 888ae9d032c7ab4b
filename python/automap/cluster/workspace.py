"""The memory a device's math libraries hold through the whole training step,
outside the tensors the generated program makes: on CUDA, torch gives every
cuBLAS handle (one per thread and stream: the forward's thread and autograd's
backward thread each take one) a workspace from its caching allocator, and a
cuBLASLt workspace beside it. They count in ``torch.cuda.max_memory_allocated``
and stay allocated, so a plan's peak must hold them (the first GPU run measured
65-66 MiB of them on an H200 above every plan's peak, and every budgeted plan
over its budget). CPUs hold none.

Measured where the process sees the GPU (``measure_library_workspace_bytes``:
the allocation a first forward and backward of a linear layer leaves behind,
after torch's workspaces are cleared), carried in a cluster file
(``Device.library_workspace_bytes``, written by ``automap detect``), else
modelled from torch's defaults and the environment variables that override
them (``modelled_library_workspace_bytes``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import torch

KIB = 1024

#: The threads that run matmuls in a training step, each with a handle and its
#: workspaces: the caller's (forward, optimizer) and autograd's device thread.
MATMUL_THREADS = 2

#: The compute capability a CUDA device planned without a GPU or a cluster
#: file's figure is taken to have (``device.GPU_FALLBACK``'s A100 class).
FALLBACK_CAPABILITY = (8, 0)


#: Device names of compute capability 9.0 (Hopper), where torch's cuBLAS
#: workspace default differs (32 MiB); every other GPU takes the other default.
_HOPPER_NAME = re.compile(r"\b(GH200|H100|H200|H800|H20)\b", re.IGNORECASE)


def capability_of_names(names: Iterable[str]) -> tuple[int, int] | None:
    """The compute capability the devices' names tell where it matters to the
    workspaces: (9, 0) when every name is a Hopper GPU's, else None (unknown)."""
    names = list(names)
    if names and all(_HOPPER_NAME.search(name or "") for name in names):
        return (9, 0)
    return None


def _cublas_workspace_bytes(capability: tuple[int, int], environ: Mapping[str, str]) -> int:
    """One cuBLAS handle's workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT``
    pairs, summed) where it parses, else torch's default: 32 MiB on sm90,
    ``:4096:2:16:8`` (8 MiB + 128 KiB) elsewhere."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * KIB * int(count) for size, count in pairs)
    return 32 * 2**20 if capability == (9, 0) else 4096 * KIB * 2 + 16 * KIB * 8


def _cublaslt_workspace_bytes(cublas_bytes: int, environ: Mapping[str, str]) -> int:
    """One cuBLASLt workspace: ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1 MiB),
    at most the cuBLAS workspace (torch caps it so); none where
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` makes it share cuBLAS's."""
    if environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("1", "true", "on"):
        return 0
    try:
        size = int(environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * KIB
    except ValueError:
        size = 1024 * KIB
    return min(size, cublas_bytes)


def modelled_library_workspace_bytes(capability: tuple[int, int] = FALLBACK_CAPABILITY,
                                     environ: Mapping[str, str] | None = None) -> int:
    """The workspaces a CUDA device of ``capability`` holds in training, from
    torch's defaults and the overrides in ``environ`` (default: this process's
    environment): a cuBLAS and a cuBLASLt workspace per matmul thread."""
    environ = os.environ if environ is None else environ
    cublas = _cublas_workspace_bytes(tuple(capability), environ)  # type: ignore[arg-type]
    return MATMUL_THREADS * (cublas + _cublaslt_workspace_bytes(cublas, environ))


def measure_library_workspace_bytes(device: str | torch.device) -> int:
    """What the math libraries keep allocated on CUDA ``device`` after a
    training step's kinds of matmul (a linear layer with a bias, forward and
    backward, in float32 and, where supported, bfloat16), measured from a clean start: torch's
    cached cuBLAS workspaces are released first. 0 on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        if clear is not None:
            clear()
        before = torch.cuda.memory_allocated(device)
        dtypes = (torch.float32, torch.bfloat16) if torch.cuda.is_bf16_supported() else \
            (torch.float32,)
        for dtype in dtypes:
            weight = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
            bias = torch.zeros(64, device=device, dtype=dtype, requires_grad=True)
            x = torch.randn(16, 64, device=device, dtype=dtype, requires_grad=True)
            out = torch.nn.functional.linear(x, weight, bias) + x @ weight
            out.sum().backward()
            del weight, bias, x, out
        torch.cuda.synchronize()
        return max(0, torch.cuda.memory_allocated(device) - before)


_measured: dict[str, int] = {}


def library_workspace_bytes(kind: str, known: Mapping | None = None,
                            device: str | torch.device | None = None) -> int:
    """The bytes each device of ``kind`` holds for its libraries through a
    step: 0 on CPUs; on CUDA ``known["library_workspace_bytes"]`` (a cluster
    file's), else, for devices no cluster file describes (``known`` None),
    this process's GPU (``device``, default the current one) measured once,
    else the model of torch's defaults (``known["compute_capability"]``, else
    ``FALLBACK_CAPABILITY``): a cluster file's devices are not necessarily
    this process's GPU."""
    if kind != "cuda":
        return 0
    given = (known or {}).get("library_workspace_bytes")
    if given is not None:
        return int(given)
    if known is None and torch.cuda.is_available():
        device = torch.device(device) if device is not None and torch.device(device).type == \
            "cuda" else torch.device("cuda", torch.cuda.current_device())
        if str(device) not in _measured:
            _measured[str(device)] = measure_library_workspace_bytes(device)
        return _measured[str(device)]
    capability = (known or {}).get("compute_capability") or FALLBACK_CAPABILITY
    return modelled_library_workspace_bytes(tuple(capability))
