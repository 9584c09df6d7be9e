"""Skip markers for hardware- or package-dependent tests."""

import pytest
import torch
import torch.distributed as dist

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
requires_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
requires_nccl = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs nccl and a GPU"
)
requires_mpi = pytest.mark.skipif(not dist.is_mpi_available(), reason="torch was built without MPI")
