#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch's BatchNorm2d training forward + backward on a GPU, on the shapes of
bench_cuda_batch_norm (N, C, H = W; NCHW or channels-last; fp32 or bf16 input with fp32
parameters), as JSON lines: the baseline of `vs_torch` in scripts/gpu-check.sh."""
import json
import sys

try:
    import torch
except ImportError:
    print("torch_cuda_batch_norm: no PyTorch in this python3", file=sys.stderr)
    sys.exit(3)

SHAPES = [(64, 64, 28), (32, 256, 14), (64, 128, 28), (256, 64, 56), (128, 256, 28), (256, 1024, 7)]


def time_case(n, c, hw, nhwc, bf16, iters=50):
    dev = torch.device("cuda")
    bn = torch.nn.BatchNorm2d(c).to(dev)
    x = torch.randn(n, c, hw, hw, device=dev)
    if bf16:
        x = x.to(torch.bfloat16)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    for _ in range(10):
        bn(x).backward(dy)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        bn(x).backward(dy)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    if not torch.cuda.is_available():
        print("torch_cuda_batch_norm: PyTorch sees no GPU", file=sys.stderr)
        sys.exit(3)
    for n, c, hw in SHAPES:
        for nhwc in (0, 1):
            for bf16 in (0, 1):
                try:
                    ms = time_case(n, c, hw, nhwc, bf16)
                except RuntimeError as e:  # a layout or type this PyTorch refuses
                    ms = None
                    print(f"torch_cuda_batch_norm: {n}x{c}x{hw} nhwc={nhwc} bf16={bf16}: {e}", file=sys.stderr)
                print(json.dumps({"N": n, "C": c, "HW": hw, "nhwc": nhwc, "bf16": bf16, "ms": ms,
                                  "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
