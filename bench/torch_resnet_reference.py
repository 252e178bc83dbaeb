#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Trains the residual example's network (examples/resnet/net.hpp) in PyTorch on the CPU, as
bench_resnet_step does in lockstep: batch 128 of 1x28x28 images, AdamW (no weight decay on norms
and biases), 2 threads. Prints one line: images_per_s=<float> torch=<version> threads=<n>.

Usage: python3 bench/torch_resnet_reference.py [--steps N] [--threads T] [--width W]
(scripts/bench-resnet.sh alternates it with bench_resnet_step.)
"""

import argparse
import time

import torch
import torch.nn as nn


class Residual(nn.Module):
    """relu(branch(x) + shortcut(x)), as nn::Residual."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.branch = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.branch(x) + self.shortcut(x))


def build_net(w):
    return nn.Sequential(
        nn.Conv2d(1, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
        Residual(w, w, 1), Residual(w, 2 * w, 2), Residual(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    net = build_net(args.width).train()
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    x = torch.rand(args.batch, 1, 28, 28)
    labels = torch.arange(args.batch) % 10

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
    print("images_per_s=%.1f torch=%s threads=%d" % (args.batch * args.steps / seconds, torch.__version__,
                                                      torch.get_num_threads()))


if __name__ == "__main__":
    main()
