#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Images per second of the MNIST example's network trained in PyTorch on a GPU (SGD, lr 0.01,
momentum 0.9, one process, fp32 parameters), at batch 64, 256 and 1024, with PyTorch's defaults
("default": cuDNN, TF32 convolutions), in strict FP32 ("strict": no TF32 anywhere) and in bf16
mixed precision ("bf16": the defaults with forward and loss under torch.autocast(bfloat16), fp32
parameters and gradients), compared with lockstep's images/s at the same batch: one JSON line per
batch and mode.

    torch_cuda_train.py [--batches 64,256,1024] [--modes default,strict,bf16]
                        [--lockstep 64=r64.jsonl --lockstep 256=51234 ...]

A PyTorch step is timed as the example times its own (examples/mnist/train.hpp, the per-step
"images_per_s" of --metrics): the host batch copied to the GPU, forward, loss, backward, SGD step,
and the loss read back to the host (`loss.item()`, as `DataParallel::train_step` returns it);
`torch_images_per_s` is that, over about --min-time seconds after a warm-up.
`torch_images_per_s_pipelined` is PyTorch's best case beside it: the batch already on the GPU and
no read-back, one synchronization at the end.

--lockstep BATCH=FILE takes the example's --metrics file of a run at that batch (its per-step
images/s, the median after the first --skip steps); --lockstep BATCH=NUMBER a figure. Each line
then has `lockstep_images_per_s`, `vs_torch` (lockstep / torch_images_per_s) and
`vs_torch_pipelined`. Without a GPU (or with --device cpu) it runs on the CPU, for trying it out;
`--self-test` checks the parsing and the arithmetic on the CPU at a tiny batch.
Exit codes: 0 measured, 2 bad input, 3 no PyTorch or no GPU.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch_cuda_train: no PyTorch in this python3", file=sys.stderr)
    sys.exit(3)

import torch_cuda_common as common  # noqa: E402


def lockstep_rate(spec, skip):
    """images/s from a number, or the median per-step images_per_s of an example's --metrics file
    after its first `skip` steps (the first steps pay for allocations and kernel loading)."""
    try:
        return float(spec), "given"
    except ValueError:
        pass
    rates = []
    with open(spec) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("kind") == "step" and "images_per_s" in r and int(r.get("step", 0)) > skip:
                rates.append(float(r["images_per_s"]))
    if not rates:
        raise ValueError("%s: no step after the first %d with images_per_s" % (spec, skip))
    return statistics.median(rates), "median of %d steps" % len(rates)


def parse_lockstep(items):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError("--lockstep takes BATCH=FILE or BATCH=IMAGES_PER_S, got %r" % item)
        b, spec = item.split("=", 1)
        out[int(b)] = spec
    return out


def precision_of(mode):
    """Sets the flags of `mode` and says what it set ('bf16': the defaults, under autocast)."""
    if mode == "bf16":
        return "bf16 autocast; " + common.precision("default")
    return common.precision(mode)


def measure(batch, mode, device, min_time, warmup, seed=1):
    """(images/s as the example times a step, images/s pipelined, steps timed)."""
    precision_of(mode)  # flags of the CUDA backends: nothing changes on the CPU
    amp = mode == "bf16"
    torch.manual_seed(seed)
    net = common.Net().to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=common.LR, momentum=common.MOMENTUM)
    gen = torch.Generator().manual_seed(3)
    x_host = torch.rand(batch, 1, 28, 28, generator=gen)
    y_host = torch.arange(batch, dtype=torch.int64) % 10
    x_dev, y_dev = x_host.to(device), y_host.to(device)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def as_example():
        return step(x_host.to(device), y_host.to(device)).item()

    for _ in range(warmup):
        as_example()
    sync()
    t0 = time.perf_counter()
    probe = 3
    for _ in range(probe):
        as_example()
    per_step = (time.perf_counter() - t0) / probe
    steps = max(10, min(5000, int(min_time / max(per_step, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(steps):
        as_example()
    example_rate = batch * steps / (time.perf_counter() - t0)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x_dev, y_dev)
    sync()
    pipelined_rate = batch * steps / (time.perf_counter() - t0)
    return example_rate, pipelined_rate, steps


def run(args, out=sys.stdout):
    try:
        lockstep = parse_lockstep(args.lockstep)
        batches = [int(b) for b in args.batches.split(",") if b]
        modes = [m for m in args.modes.split(",") if m]
        for m in modes:
            if m not in ("default", "strict", "bf16"):
                raise ValueError("--modes: 'default', 'strict' or 'bf16', got %r" % m)
        rates = {b: lockstep_rate(spec, args.skip) for b, spec in lockstep.items()}
    except (OSError, ValueError) as e:
        print("torch_cuda_train: %s" % e, file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_cuda_train: PyTorch sees no GPU (--device cpu to try it on the CPU)", file=sys.stderr)
        return 3
    device = torch.device(args.device)
    info = common.torch_info(device)
    for b in batches:
        for mode in modes:
            ex, pipe, steps = measure(b, mode, device, args.min_time, args.warmup)
            r = {"batch": b, "mode": mode, "precision": precision_of(mode), "torch_images_per_s": round(ex, 1),
                 "torch_images_per_s_pipelined": round(pipe, 1), "steps": steps}
            if b in rates:
                ours, how = rates[b]
                r.update({"lockstep_images_per_s": round(ours, 1), "lockstep_source": how,
                          "vs_torch": round(ours / ex, 3), "vs_torch_pipelined": round(ours / pipe, 3)})
            r.update(info)
            print(json.dumps(r), file=out, flush=True)
    return 0


def self_test():
    checks = []

    def check(cond, what):
        checks.append(bool(cond))
        print("%s %s" % ("ok  " if cond else "FAIL", what), file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        with open(metrics, "w") as f:
            for s, v in enumerate([10.0, 500.0, 1000.0, 1100.0, 900.0, 1000.0, 3000.0], start=1):
                f.write(json.dumps({"kind": "step", "step": s, "epoch": 0, "loss": 2.0, "images_per_s": v}) + "\n")
            f.write(json.dumps({"kind": "epoch", "epoch": 0, "test_accuracy": 0.5}) + "\n")
        rate, how = lockstep_rate(metrics, 2)
        check(rate == 1000.0 and how == "median of 5 steps", "median of the steps after the first 2 (%s)" % rate)
        check(lockstep_rate("57100", 5)[0] == 57100.0, "a number is taken as it is")
        check(parse_lockstep(["64=a", "256=1.5"]) == {64: "a", 256: "1.5"}, "BATCH=SPEC pairs")
        try:
            lockstep_rate(metrics, 100)
            check(False, "a metrics file without enough steps is refused")
        except ValueError:
            check(True, "a metrics file without enough steps is refused")
        out_path = os.path.join(tmp, "out.jsonl")
        args = build_parser().parse_args(["--device", "cpu", "--batches", "4", "--modes", "default,strict,bf16",
                                          "--min-time", "0.05", "--warmup", "1", "--lockstep", "4=" + metrics,
                                          "--skip", "2"])
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        with open(out_path, "w") as f:
            rc = run(args, f)
        lines = [json.loads(l) for l in open(out_path)]
        check(rc == 0 and [(l["batch"], l["mode"]) for l in lines] == [(4, "default"), (4, "strict"), (4, "bf16")],
              "one line per batch and mode")
        check(lines[2]["precision"].startswith("bf16 autocast") and lines[2]["torch_images_per_s"] > 0,
              "bf16 autocast measured (%s)" % lines[2]["precision"])
        l0 = lines[0]
        check(l0["torch_images_per_s"] > 0 and l0["steps"] >= 10, "PyTorch measured (%.0f img/s on the CPU)" %
              l0["torch_images_per_s"])
        check(abs(l0["vs_torch"] - 1000.0 / l0["torch_images_per_s"]) < 1e-2 * max(1.0, l0["vs_torch"]) and
              l0["lockstep_images_per_s"] == 1000.0, "vs_torch = lockstep / torch (%.3f)" % l0["vs_torch"])
        bad = build_parser().parse_args(["--device", "cpu", "--modes", "fast"])
        check(run(bad, open(os.devnull, "w")) == 2, "an unknown mode is refused")
    failed = checks.count(False)
    print("%d passed, %d failed" % (len(checks) - failed, failed))
    return 1 if failed else 0


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--modes", default="default,strict,bf16")
    parser.add_argument("--lockstep", action="append", metavar="BATCH=FILE|IMAGES_PER_S",
                        help="lockstep's rate at that batch: the example's --metrics file, or a number")
    parser.add_argument("--skip", type=int, default=5, help="steps of a metrics file left out as warm-up")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds timed per case and protocol")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--self-test", action="store_true")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.self_test:
        return self_test()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
