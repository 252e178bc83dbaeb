#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Trains the example network (examples/mnist/net.hpp) in PyTorch on the CPU, as bench_train_step
does in lockstep: batch 64 of 1x28x28 images, SGD (lr 0.01, momentum 0.9), 2 threads. Prints one
line: images_per_s=<float> torch=<version> threads=<n>.

Usage: python3 bench/torch_cpu_reference.py [--steps N] [--threads T]
(scripts/bench-vs-pytorch.sh alternates it with bench_train_step.)
"""

import argparse
import time

import torch


def build_net():
    # The seed's conv-net with batch norm: PyTorch's default initialization, as lockstep's.
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(64 * 14 * 14, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    net = build_net().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.rand(64, 1, 28, 28)
    labels = torch.arange(64) % 10

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), labels)
        loss.backward()
        opt.step()

    for _ in range(3):  # warm-up: allocations, oneDNN primitives
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - t0
    print("images_per_s=%.1f torch=%s threads=%d" % (64.0 * args.steps / seconds, torch.__version__, torch.get_num_threads()))


if __name__ == "__main__":
    main()
