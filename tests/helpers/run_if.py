"""Skip markers for hardware- or package-dependent tests."""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
requires_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
requires_nccl = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs nccl and a GPU"
)
requires_mpi = pytest.mark.skipif(not dist.is_mpi_available(), reason="torch was built without MPI")


def gpu_test(count: int = 1) -> Callable[[Callable], Callable]:
    """Mark a test ``gpu`` (so ``pytest -m gpu`` selects it) and skip it unless ``count`` CUDA GPUs are visible."""
    enough = torch.cuda.device_count() >= count
    skip = pytest.mark.skipif(not enough, reason=f"needs {count} CUDA GPU(s), {torch.cuda.device_count()} visible")

    def mark(test: Callable) -> Callable:
        return pytest.mark.gpu(skip(test))

    return mark
