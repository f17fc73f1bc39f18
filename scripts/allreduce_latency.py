"""The latency of a decode step's all-reduce (one token's hidden state: 4096 bf16 values, 8 KB) between the GPUs of
one host, in a CUDA graph, as tensor parallelism runs it: NCCL's all-reduce (what ``gpt_fast.parallel.tensor_parallel``
uses) against PyTorch's one-shot all-reduce over symmetric memory (``torch.ops.symm_mem.one_shot_all_reduce``: each
rank reads its partners' buffers directly and adds them). Each is timed as a chain of 64 all-reduces, each followed by a
small elementwise kernel as in a decode step, captured once and replayed 50 times; µs per all-reduce, rank 0's.

    torchrun --standalone --nproc_per_node 2 scripts/allreduce_latency.py

Where NVLink multicast is unavailable, set ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

VALUES, CHAIN, REPLAYS = 4096, 64, 50


def graph_us_per_call(body: Callable[[], None]) -> float:
    """Capture ``body`` (after three warm-up runs on a side stream) and time its replays: µs per all-reduce."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / REPLAYS / CHAIN


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    nccl_buffer = torch.randn(VALUES, device="cuda", dtype=torch.bfloat16)  # [4096]

    def nccl_chain() -> None:
        for _ in range(CHAIN):
            dist.all_reduce(nccl_buffer)
            nccl_buffer.mul_(0.5)

    symm_buffer = symm_mem.empty(VALUES, dtype=torch.bfloat16, device="cuda")  # [4096], mapped by every rank
    symm_mem.rendezvous(symm_buffer, group)
    symm_buffer.normal_()

    def symm_chain() -> None:
        for _ in range(CHAIN):
            summed = torch.ops.symm_mem.one_shot_all_reduce(symm_buffer, "sum", group)
            symm_buffer.copy_(summed.mul_(0.5))

    for name, chain in (("NCCL all_reduce", nccl_chain), ("symmetric-memory one_shot_all_reduce", symm_chain)):
        us = graph_us_per_call(chain)
        if dist.get_rank() == 0:
            print(
                f"{name}, {VALUES * 2 // 1024} KB, {dist.get_world_size()} GPUs: {us:.2f} µs per all-reduce", flush=True
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
