# SPDX-License-Identifier: MIT
"""What bench/torch_cuda_parity.py and bench/torch_cuda_train.py share: the example network
(examples/mnist/net.hpp) in PyTorch with the checkpoint's names, the example's batches read from
the IDX files as the example reads them (examples/mnist/train.hpp, make_batch), safetensors
reading and writing without the safetensors or numpy packages, and PyTorch's precision switches.

Only the standard library and torch; imported by those scripts from this folder."""

import ctypes
import gzip
import json
import os
import struct

import torch
import torch.nn.functional as F

# The example's training defaults (examples/mnist/train.hpp, Options; nn::SgdOptions;
# nn::SyncBatchNormOptions: PyTorch's BatchNorm2d defaults, momentum 0.1, eps 1e-5).
LR = 0.01
MOMENTUM = 0.9
BN_MOMENTUM = 0.1
BN_EPS = 1e-5


class Net(torch.nn.Module):
    """conv1 (1->32, 3x3, pad 1) -> bn1 -> ReLU -> conv2 (32->64, 3x3, pad 1) -> bn2 -> ReLU ->
    MaxPool2d(2) -> Flatten -> fc1 (12544->128) -> ReLU -> fc2 (128->10): examples/mnist/net.hpp,
    whose attribute names its checkpoints use, as this module's state_dict() does."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(32, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(64, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.fc1 = torch.nn.Linear(64 * 14 * 14, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


def _has(obj, name):
    try:  # torch.backends.cuda.matmul raises AssertionError, not AttributeError, for a name it lacks
        getattr(obj, name)
        return obj is not None
    except Exception:  # noqa: BLE001
        return False


def precision(mode):
    """'strict': true FP32 everywhere (no TF32 in cuDNN convolutions or cuBLAS matmuls:
    torch.backends.cudnn.allow_tf32 = False, torch.backends.cuda.matmul.allow_tf32 = False; or
    their successors, fp32_precision = "ieee", where this PyTorch has them, since it refuses a mix
    of the two), deterministic cuDNN algorithms; 'default': PyTorch's own defaults (TF32 in
    convolutions, not in matmuls). Returns a description of what it set."""
    if mode not in ("strict", "default"):
        raise ValueError("precision mode must be 'strict' or 'default', got %r" % (mode,))
    strict = mode == "strict"
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if _has(matmul, "fp32_precision") and _has(getattr(cudnn, "conv", None), "fp32_precision"):
        matmul.fp32_precision = "ieee"
        cudnn.conv.fp32_precision = "ieee" if strict else "tf32"
        how = "matmul %s, conv %s" % (matmul.fp32_precision, cudnn.conv.fp32_precision)
    else:
        matmul.allow_tf32 = False
        cudnn.allow_tf32 = not strict
        how = "matmul allow_tf32=%s, cudnn allow_tf32=%s" % (matmul.allow_tf32, cudnn.allow_tf32)
    cudnn.deterministic = strict
    cudnn.benchmark = False
    return how


# ---- IDX files, as include/lockstep/data/idx.hpp reads them -------------------------------------------

def find_file(data_dir, name):
    """`name` or `name.gz` in `data_dir`, whichever exists (train.hpp, find_file)."""
    for candidate in (os.path.join(data_dir, name), os.path.join(data_dir, name + ".gz")):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError("%s[.gz]: missing in the data directory" % os.path.join(data_dir, name))


def read_idx(path, limit=None):
    """(dims, payload bytes) of an IDX file of unsigned bytes, gzipped or not; with `limit`, only
    the first `limit` items' bytes."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) != 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
            raise ValueError("%s: not an IDX file of unsigned bytes" % path)
        rank = head[3]
        dims = list(struct.unpack(">%dI" % rank, f.read(4 * rank)))
        item = 1
        for d in dims[1:]:
            item *= d
        count = dims[0] if limit is None else min(dims[0], limit)
        payload = f.read(count * item)
        if len(payload) != count * item:
            raise ValueError("%s: truncated (%d of %d bytes)" % (path, len(payload), count * item))
    return dims, payload


def load_rows(data_dir, count, split="train"):
    """The first `count` images of the training (or test) set as a float32 (count, 1, 28, 28)
    tensor scaled to [0, 1] by /255 in float32, as make_batch does, and their int64 labels."""
    prefix = "train" if split == "train" else "t10k"
    dims, px = read_idx(find_file(data_dir, prefix + "-images-idx3-ubyte"), count)
    _, lab = read_idx(find_file(data_dir, prefix + "-labels-idx1-ubyte"), count)
    if dims[1:] != [28, 28]:
        raise ValueError("images are %s, the network takes 28x28" % (dims[1:],))
    n = len(lab)
    if n < count or len(px) != n * 784:
        raise ValueError("%s holds %d images, fewer than the %d asked for" % (data_dir, n, count))
    x = torch.frombuffer(bytearray(px), dtype=torch.uint8).reshape(n, 1, 28, 28).to(torch.float32)
    x = x / torch.tensor(255.0, dtype=torch.float32)
    y = torch.frombuffer(bytearray(lab), dtype=torch.uint8).to(torch.int64)
    return x, y


def example_batches(data_dir, batch, steps):
    """The batches of the example's first `steps` steps with --no-shuffle: the order is the file
    order (epoch_order without shuffling) and step k takes rows [k*batch, (k+1)*batch)
    (batch_starts), within the first epoch."""
    x, y = load_rows(data_dir, batch * steps)
    return [(x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]) for k in range(steps)]


def write_idx(path, dims, payload, compress=False):
    """An IDX file of unsigned bytes (for the self-tests)."""
    blob = bytes([0, 0, 0x08, len(dims)]) + struct.pack(">%dI" % len(dims), *dims) + bytes(payload)
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(blob)


# ---- safetensors, as nn::Checkpoint writes and reads them (F32 and I64) ----------------------

_DTYPES = {torch.float32: "F32", torch.int64: "I64"}
_TORCH = {"F32": torch.float32, "I64": torch.int64}


def tensor_bytes(t):
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def write_safetensors(path, tensors, metadata=None):
    """u64 little-endian header length, the JSON header padded with spaces to 8 bytes, then the
    tensors' little-endian bytes back to back in name order; atomic (a temporary, then rename)."""
    header = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError("%s: dtype %s; lockstep's checkpoints hold F32 and I64" % (name, t.dtype))
        data = tensor_bytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
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


def read_safetensors(path):
    """({name: CPU tensor}, metadata) of a safetensors file of F32 and I64 tensors."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError("%s: not a safetensors file (%d bytes)" % (path, len(blob)))
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length].decode("utf-8"))
    base = 8 + length
    metadata = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        if e["dtype"] not in _TORCH:
            raise ValueError("%s: tensor %s has dtype %s" % (path, name, e["dtype"]))
        begin, end = e["data_offsets"]
        raw = bytearray(blob[base + begin:base + end])
        t = torch.frombuffer(raw, dtype=_TORCH[e["dtype"]]) if raw else torch.empty(0, dtype=_TORCH[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out, metadata


def state_tensors(net):
    return {name: t.detach().to("cpu").clone() for name, t in net.state_dict().items()}


def torch_info(device):
    info = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cudnn"] = torch.backends.cudnn.version()
    return info
