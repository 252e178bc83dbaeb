#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Generates the golden reference of lockstep::torch: PyTorch DDP (gloo, 2 processes, CPU)
training the residual network of tests/torch/torch_models.hpp with synchronized batch norm.

Writes tests/golden/torch_resnet.safetensors:
  init.<name>   the network's state_dict before training (PyTorch's initialisation)
  final.<name>  after three SGD steps (lr 0.1, momentum 0.9, weight decay 1e-4)
  x.<k>, y.<k>  the global batch of step k (11 images 1x8x8, 11 labels); process 0 trains on its
                first 6 rows, process 1 on the last 5
  __metadata__  the three global losses
lockstep's test (tests/torch/test_torch.cpp, "... matches PyTorch DDP ...") loads init.*, trains 2 replicas on the same
batches and compares every tensor with final.*.

nn.SyncBatchNorm refuses CPU tensors, so the processes' batch norm here is a synchronized batch
norm written with torch.distributed.all_reduce: the global batch's sum, sum of squares and
count forward; the sums of dy and dy*(x-mean) backward (what nn.SyncBatchNorm computes on GPUs).
DDP averages the processes' gradients; with uneven shards each process's mean loss is weighted
by world * n_p / N, so the average is the gradient of the global batch's mean loss.

Rerun from the repository root with the project's PyTorch (scripts/install-torch.sh):

    PYTHONPATH=.deps/torch-2.15.0 python3 tests/golden/make_torch_golden.py
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import write_safetensors  # noqa: E402

OUT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_resnet.safetensors")
BATCH, FIRST, STEPS, CHANNELS = 11, 6, 3, 6


class SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        dims = [0] + list(range(2, x.dim()))
        xd = x.double()
        stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims), torch.tensor([float(x.numel() // x.size(1))], dtype=torch.float64)])
        dist.all_reduce(stats)
        c = x.size(1)
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean.float())
            running_var.mul_(1 - momentum).add_(momentum * (var * n / (n - 1)).float())
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = (xd - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.n = n
        return (xhat * weight.double().view(shape) + bias.double().view(shape)).float()

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, xhat.dim()))
        c = xhat.size(1)
        shape = [1, c] + [1] * (xhat.dim() - 2)
        dyd = dy.double()
        local = torch.cat([dyd.sum(dims), (dyd * xhat).sum(dims)])
        sums = local.clone()
        dist.all_reduce(sums)
        mean_dy, mean_dy_xhat = sums[:c] / ctx.n, sums[c:] / ctx.n
        dx = (dyd - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * (invstd * weight.double()).view(shape)
        return dx.float(), local[c:].float(), local[:c].float(), None, None, None, None


class BatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked += 1
        return SyncBN.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.momentum, self.eps)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = BatchNorm(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = BatchNorm(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class ResNet(nn.Module):
    def __init__(self, c=CHANNELS):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn = BatchNorm(c)
        self.block1 = Block(c)
        self.block2 = Block(c)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        y = F.relu(self.bn(self.stem(x)))
        return self.fc(self.block2(self.block1(y)).mean((2, 3)))


def batches():
    g = torch.Generator().manual_seed(4321)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def worker(rank, init, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = ResNet()
    model.load_state_dict(init)
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    rows = slice(0, FIRST) if rank == 0 else slice(FIRST, BATCH)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x[rows]), y[rows])
        n = loss.new_tensor(float(y[rows].numel()))
        (loss * 2 * n / BATCH).backward()  # DDP averages over the 2 processes
        total = (loss.detach() * n).double()
        dist.all_reduce(total)
        losses.append(total.item() / BATCH)
        opt.step()
    if rank == 0:  # plain lists: shared tensors would not outlive this process
        queue.put(({k: (v.dtype, v.shape, v.flatten().tolist()) for k, v in model.state_dict().items()}, losses))
    dist.barrier()
    dist.destroy_process_group()


def main():
    torch.manual_seed(2024)
    init = {k: v.clone() for k, v in ResNet().state_dict().items()}
    os.environ["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, init, queue)) for r in range(2)]
    for p in procs:
        p.start()
    state, losses = queue.get()
    final = {k: torch.tensor(values, dtype=dtype).reshape(shape) for k, (dtype, shape, values) in state.items()}
    for p in procs:
        p.join()
        assert p.exitcode == 0, "a DDP process failed"
    tensors = {f"init.{k}": v for k, v in init.items()}
    tensors.update({f"final.{k}": v for k, v in final.items()})
    for k, (x, y) in enumerate(batches()):
        tensors[f"x.{k}"] = x
        tensors[f"y.{k}"] = y
    write_safetensors(OUT_PATH, tensors, {"losses": json.dumps(losses), "torch": torch.__version__})
    print(f"wrote {OUT_PATH}: losses {losses}")


if __name__ == "__main__":
    main()
