#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Generates lockstep's golden reference for a tiny conv net trained with SGD + momentum.

Writes tests/golden/tiny_net.safetensors: the network's state (parameters and BatchNorm
buffers) before and after three training steps, the SGD momentum buffers after them, the
three input batches and labels, and the per-step losses (in the header's __metadata__).
lockstep's tests replay the same training from init.* and the stored data and compare.

Rerun from the repository root with Debian's PyTorch (package python3-torch):

    /usr/bin/python3 tests/golden/make_golden.py

The output is deterministic: fixed seeds, one thread, float32, deterministic algorithms.
"""

import copy
import json
import os
import struct

import torch

INIT_SEED = 1234   # network initialisation (PyTorch defaults)
DATA_SEED = 5678   # the generator the batches and labels are drawn from
BATCH = 7
CHANNELS_IN = 2
SIDE = 4
CLASSES = 4
STEPS = 3
LR = 0.1
MOMENTUM = 0.9
TIE_MARGIN = 1e-4  # minimum distance from a ReLU kink or a max-pool tie

OUT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_net.safetensors")


def build_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(CHANNELS_IN, 3, 3, padding=1),
        torch.nn.BatchNorm2d(3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(12, CLASSES),
    )


def draw_batch(gen):
    """One batch: x ~ N(0.5, 1) plus 3*c on input channel c, labels uniform in [0, CLASSES)."""
    x = torch.randn(BATCH, CHANNELS_IN, SIDE, SIDE, generator=gen, dtype=torch.float32) + 0.5
    x = x + 3.0 * torch.arange(CHANNELS_IN, dtype=torch.float32).view(1, CHANNELS_IN, 1, 1)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen, dtype=torch.int64)
    return x, labels


def far_from_ties(net, x):
    """True when another implementation's rounding (~1e-7 relative) cannot flip a ReLU or a
    max-pool choice for this batch: every BatchNorm output (training mode, batch statistics)
    has |value| >= TIE_MARGIN, and in every 2x2 pooling window of the ReLU output the largest
    value is 0 or beats the second largest by TIE_MARGIN. Runs on a copy, so the network's
    running statistics are left as they are."""
    probe = copy.deepcopy(net)
    probe.train()
    with torch.no_grad():
        y = probe[1](probe[0](x))
        if bool((y.abs() < TIE_MARGIN).any()):
            return False
        r = torch.relu(y)
        n, c, h, w = r.shape
        windows = r.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(-1, 4)
        top2 = windows.topk(2, dim=1).values
        largest, second = top2[:, 0], top2[:, 1]
        ok = (largest == 0) | (largest - second >= TIE_MARGIN)
        return bool(ok.all())


def state_tensors(prefix, net):
    return {prefix + name: t.detach().clone() for name, t in net.state_dict().items()}


def write_safetensors(path, tensors, metadata):
    """Writes the safetensors layout: u64 little-endian header length, a JSON header padded
    with spaces to an 8-byte boundary, then each tensor's little-endian bytes back to back."""
    dtypes = {torch.float32: ("F32", "<f4"), torch.int64: ("I64", "<i8")}
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        tag, np_dtype = dtypes[t.dtype]
        data = t.numpy().astype(np_dtype, copy=False).tobytes()
        header[name] = {"dtype": tag, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)

    torch.manual_seed(INIT_SEED)
    net = build_net()
    net.train()
    tensors = state_tensors("init.", net)

    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(DATA_SEED)
    losses = []
    redraws = []
    for k in range(STEPS):
        # Draw (continuing the same generator) until the batch is clear of ties for the
        # network as it stands before this step.
        tries = 0
        while True:
            x, labels = draw_batch(gen)
            if far_from_ties(net, x):
                break
            tries += 1
        redraws.append(tries)
        tensors["data.x.%d" % k] = x.clone()
        tensors["data.labels.%d" % k] = labels.clone()

        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))

    tensors.update(state_tensors("final.", net))
    for name, p in net.named_parameters():
        tensors["final.optimizer.%s.momentum_buffer" % name] = \
            opt.state[p]["momentum_buffer"].detach().clone()

    metadata = {
        "losses": "[" + ", ".join(repr(v) for v in losses) + "]",
        "torch": torch.__version__,
        "description": "Tiny Conv2d-BatchNorm2d-ReLU-MaxPool2d-Linear net trained 3 steps with "
                       "SGD (lr 0.1, momentum 0.9) on the stored batches: initial and final "
                       "state, momentum buffers, data and per-step losses.",
    }
    write_safetensors(OUT_PATH, tensors, metadata)
    print("wrote %s (%d bytes)" % (OUT_PATH, os.path.getsize(OUT_PATH)))
    print("losses:", metadata["losses"])
    print("redraws per batch:", redraws)


if __name__ == "__main__":
    main()
