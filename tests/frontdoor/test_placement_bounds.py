"""A config's place in the scheduler's terms is as large as a machine, never as large as a config says."""

from __future__ import annotations

from manager.frontdoor.front_door import placement_of
from manager.planner.gpus import GPU, NoGPU
from manager.schemas.common import MAX_GPU_ID
from manager.schemas.model_config import ModelConfig

H100 = GPU("NVIDIA H100 80GB HBM3", 80 << 30, "NVML", count=8)


def test_without_gpu_ids_a_worker_takes_the_first_gpus_its_parallel_sizes_need():
    assert placement_of(ModelConfig(name="m", model="org/m", tensor_parallel_size=2), H100).gpus == (0, 1)
    piped = ModelConfig(name="m", model="org/m", tensor_parallel_size=2, extra_args=["-pp", "2"])
    assert placement_of(piped, H100).gpus == (0, 1, 2, 3)
    listed = ModelConfig(name="m", model="org/m", tensor_parallel_size=2, gpu_ids=[5, 7])
    assert placement_of(listed, H100).gpus == (5, 7)


def test_a_large_parallel_size_is_bounded_by_the_machine():
    wide = ModelConfig(name="m", model="org/m", tensor_parallel_size=1024)
    assert placement_of(wide, H100).gpus == tuple(range(8))
    assert placement_of(wide, NoGPU("no NVML")).gpus == tuple(range(MAX_GPU_ID + 1))
    # As a database written by hand could hold it: it costs what the machine's size costs, at once.
    stored = ModelConfig(name="m", model="org/m", tensor_parallel_size=2**31 - 1, extra_args=["-pp", "2147483647"])
    assert placement_of(stored, H100).gpus == tuple(range(8))
