#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""(b) of bench/bench_torch_train_step.cpp: PyTorch DDP in Python with gloo, 2 processes on the
CPU, one intra-op thread each, training the example network (examples/torch_mnist/net.hpp) with
SGD (lr 0.01, momentum 0.9) on a global batch split in two. Its batch norm is nn.BatchNorm2d
(nn.SyncBatchNorm refuses CPU tensors), which makes no collective: this side does less work than
lockstep's. Prints one line: images_per_s=<float> torch=<version> batch=<n>.

Usage: python3 bench/torch_ddp_reference.py [--batch 64] [--steps 5]
(scripts/bench-torch.sh alternates it with bench_torch_train_step.)
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def build_net():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 14 * 14, 128), nn.ReLU(), nn.Linear(128, 10))


def worker(rank, batch, steps, queue):
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = nn.parallel.DistributedDataParallel(build_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    local = batch // 2 + (batch % 2 if rank == 0 else 0)
    x, y = torch.rand(local, 1, 28, 28), torch.randint(0, 10, (local,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        queue.put((time.perf_counter() - t0) / steps)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.batch, args.steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = queue.get()
    for p in procs:
        p.join()
    print(f"images_per_s={args.batch / seconds:.1f} torch={torch.__version__} batch={args.batch}")


if __name__ == "__main__":
    main()
