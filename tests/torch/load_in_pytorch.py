#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Loads a checkpoint written by lockstep::torch into PyTorch (issue #44's "checkpoints that
PyTorch in Python loads into the same architecture"). Runs test_torch's export case (argv[1]: the
test_torch program) into a temporary folder, reads model.safetensors by hand (the safetensors
layout: u64 header length, JSON header, bytes), load_state_dict's it strictly into the Python twin
of the network (tests/golden/make_torch_golden.py's ResNet), and compares the network's eval output
on the exported input with lockstep's. Exits non-zero on any difference."""

import json
import os
import struct
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden"))
from make_torch_golden import ResNet  # noqa: E402

DTYPES = {"F32": torch.float32, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def main():
    program = sys.argv[1]
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, LOCKSTEP_TORCH_EXPORT=folder)
        subprocess.run([program, "-w", "NoTests", "torch checkpoint for PyTorch: a trained model with an input and its eval output"],
                       env=env, check=True)
        state = read_safetensors(os.path.join(folder, "model.safetensors"))
        io = read_safetensors(os.path.join(folder, "io.safetensors"))
    model = ResNet()
    model.load_state_dict(state, strict=True)  # every name, shape and dtype of the architecture
    model.eval()
    with torch.no_grad():
        y = model(io["x"])
    err = (y - io["y"]).abs().max().item()
    scale = io["y"].abs().max().item()
    print(f"PyTorch {torch.__version__} loaded {len(state)} tensors; max |y_pytorch - y_lockstep| = {err:.3g} (|y| <= {scale:.3g})")
    if not err <= 1e-5 * max(scale, 1.0):
        sys.exit("the outputs differ")
    if int(state["bn.num_batches_tracked"]) != 2:
        sys.exit("num_batches_tracked is not the 2 steps trained")


if __name__ == "__main__":
    main()
