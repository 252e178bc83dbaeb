#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch parity of the MNIST example's training: the same network, from the same initial
checkpoint, trained the same SGD steps on the same batches in PyTorch on the same GPU, in strict
FP32 (no TF32), compared with the checkpoints the example saved after those steps.

    # 1. the initial weights, written by PyTorch (the example's --steps 0 means "no limit", so the
    #    example cannot write an untrained checkpoint); the example loads them with --init
    torch_cuda_parity.py init --out init.safetensors [--seed 7]
    # 2. the example: 3 steps from it, in file order, batch 64
    mnist --init init.safetensors --no-shuffle --seed 7 --batch 64 --lr 0.01 --momentum 0.9 \
          --steps 3 --save r1.safetensors --metrics r1.jsonl --backend cuda --devices 0
    # 3. PyTorch's 3 steps and the comparison, one JSON line per run compared
    torch_cuda_parity.py compare --data DIR --init init.safetensors --batch 64 --steps 3 \
          --run "cuda, 1 replica" r1.safetensors r1.jsonl [--run LABEL CKPT METRICS ...] [--fp64]

Why the batches are the same: with --no-shuffle the example's order is the file order
(train.hpp, epoch_order) and step k trains on rows [k*batch, (k+1)*batch) of the training set
(batch_starts), each pixel byte / 255 in float32 (make_batch), the loss being the mean cross
entropy over the global batch (nn::SoftmaxCrossEntropy). SGD is PyTorch's (momentum buffer = the
first gradient, then mu*v + g; no dampening, no weight decay) and batch norm PyTorch's defaults
(momentum 0.1, eps 1e-5, unbiased running variance); across several replicas SyncBatchNorm's
statistics are those of the global batch, so one PyTorch process is the reference for any number
of replicas. The first loss (same weights, same batch) tells whether the batches agree.

A run passes when the worst relative error ||a - b|| / ||b|| over the parameters (weights and
biases, not the batch-norm buffers) is at most --tolerance (1e-3) and every step's loss is within
--tolerance of PyTorch's. Also reported, not judged: the errors of the updates (a - init against
b - init, which magnify rounding), of the batch-norm running statistics and of the momentum
buffers, and with --fp64 both sides against a float64 CPU reference.

`--self-test` runs the whole comparison on the CPU on a small made-up data set (no GPU needed).
Exit codes: 0 all runs pass, 1 a run fails, 2 bad input, 3 no PyTorch or no GPU.
"""

import argparse
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch_cuda_parity: no PyTorch in this python3", file=sys.stderr)
    sys.exit(3)

import torch_cuda_common as common  # noqa: E402


def make_init(seed):
    torch.manual_seed(seed)
    return common.state_tensors(common.Net())


def train(init_state, batches, device, dtype=torch.float32, lr=common.LR, momentum=common.MOMENTUM):
    """PyTorch's training from `init_state` on `batches`: (state, momentum buffers, losses), on the CPU."""
    net = common.Net()
    net.load_state_dict(init_state)
    net = net.to(device=device, dtype=dtype).train()  # dtype converts the floating tensors only
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x.to(device=device, dtype=dtype)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    state = common.state_tensors(net)
    buffers = {"optimizer.%s.momentum_buffer" % name: opt.state[p]["momentum_buffer"].detach().to("cpu").clone()
               for name, p in net.named_parameters() if p in opt.state}
    return state, buffers, losses


# An update (or momentum times the learning rate) under this fraction of its parameter is
# rounding noise, not a step.
NEGLIGIBLE = 1e-6
LR_SCALE = common.LR


def rel(a, b):
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)), 1e-30)


def read_losses(path, steps):
    """Per-step losses of an example's --metrics file (JSON lines; "kind": "step")."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("kind", "step") == "step" and "loss" in r and "step" in r:
                out[int(r["step"])] = float(r["loss"])
    return [out.get(k) for k in range(1, steps + 1)]


def compare(label, lockstep, ref_state, ref_momentum, ref_losses, init_state, tolerance, lockstep_losses=None,
            fp64_state=None, steps=None):
    """One JSON-ready verdict: `lockstep` ({name: tensor} of the example's checkpoint) against
    PyTorch's state and momentum after the same steps."""
    problems = []
    params = [n for n in ref_state if not n.startswith(("bn1.running", "bn2.running")) and
              not n.endswith("num_batches_tracked")]
    bufs = [n for n in ref_state if n not in params]
    worst = (0.0, None)
    worst_update = (0.0, None)
    for name in params:
        if name not in lockstep:
            problems.append("missing %s" % name)
            continue
        a, b = lockstep[name], ref_state[name]
        if tuple(a.shape) != tuple(b.shape):
            problems.append("%s has shape %s, PyTorch's %s" % (name, list(a.shape), list(b.shape)))
            continue
        e = rel(a, b)
        if not math.isfinite(e):
            e = float("inf")
        if worst[1] is None or e >= worst[0]:
            worst = (e, name)
        # A bias that batch norm follows (conv1.bias, conv2.bias) has no gradient in exact
        # arithmetic: its update is rounding noise on both sides, left out of these figures.
        d_ref = b.to(torch.float64) - init_state[name].to(torch.float64)
        if float(torch.linalg.vector_norm(d_ref)) > NEGLIGIBLE * float(torch.linalg.vector_norm(b.to(torch.float64))):
            u = rel(a.to(torch.float64) - init_state[name].to(torch.float64), d_ref)
            if u >= worst_update[0]:
                worst_update = (u, name)
    worst_buffer = (0.0, None)
    for name in bufs:
        if name not in lockstep:
            problems.append("missing %s" % name)
            continue
        if name.endswith("num_batches_tracked"):
            if int(lockstep[name].reshape(-1)[0]) != int(ref_state[name].reshape(-1)[0]):
                problems.append("%s is %d, PyTorch's %d" % (name, int(lockstep[name].reshape(-1)[0]),
                                                            int(ref_state[name].reshape(-1)[0])))
            continue
        e = rel(lockstep[name], ref_state[name])
        if e >= worst_buffer[0]:
            worst_buffer = (e, name)
    worst_momentum = (0.0, None)
    for name, b in ref_momentum.items():
        param = name[len("optimizer."):-len(".momentum_buffer")]
        scale = float(torch.linalg.vector_norm(ref_state[param].to(torch.float64))) if param in ref_state else 0.0
        if name in lockstep and float(torch.linalg.vector_norm(b.to(torch.float64))) * LR_SCALE <= NEGLIGIBLE * scale:
            continue  # a gradient that is rounding noise (above)
        if name in lockstep:
            e = rel(lockstep[name], b)
            if e >= worst_momentum[0]:
                worst_momentum = (e, name)
        else:
            problems.append("missing %s" % name)
    loss_err = None
    if lockstep_losses is not None:
        if any(v is None for v in lockstep_losses):
            problems.append("the metrics hold %d of the %d step losses" %
                            (sum(v is not None for v in lockstep_losses), len(lockstep_losses)))
        else:
            loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(lockstep_losses, ref_losses))
    passed = (not problems and worst[1] is not None and worst[0] <= tolerance and
              (loss_err is None or loss_err <= tolerance))
    out = {
        "run": label, "pass": passed, "tolerance": tolerance, "steps": steps,
        "worst_param_rel": worst[0], "worst_param": worst[1],
        "worst_update_rel": worst_update[0], "worst_update": worst_update[1],
        "worst_running_stat_rel": worst_buffer[0], "worst_running_stat": worst_buffer[1],
        "worst_momentum_rel": worst_momentum[0], "worst_momentum": worst_momentum[1],
        "loss_rel": loss_err, "losses_torch": ref_losses, "losses_lockstep": lockstep_losses,
        "problems": problems,
    }
    if fp64_state is not None:
        out["lockstep_vs_fp64"] = max((rel(lockstep[n], fp64_state[n]) for n in params if n in lockstep), default=None)
        out["torch_vs_fp64"] = max(rel(ref_state[n], fp64_state[n]) for n in params)
    return out


def describe(r):
    text = "%s: %s: worst relative parameter error %.2e (%s; allowed %.0e)" % (
        r["run"], "pass" if r["pass"] else "FAIL", r["worst_param_rel"], r["worst_param"], r["tolerance"])
    if r["loss_rel"] is not None:
        text += ", losses within %.1e" % r["loss_rel"]
    text += "; updates %.1e, running stats %.1e, momentum %.1e" % (
        r["worst_update_rel"], r["worst_running_stat_rel"], r["worst_momentum_rel"])
    if r.get("torch_vs_fp64") is not None and r.get("lockstep_vs_fp64") is not None:
        text += "; vs fp64: lockstep %.1e, torch %.1e" % (r["lockstep_vs_fp64"], r["torch_vs_fp64"])
    if r["problems"]:
        text += "; " + "; ".join(r["problems"][:3])
    return text


def cmd_init(args):
    state = make_init(args.seed)
    common.write_safetensors(args.out, state, {"format": "pt", "made_by": "bench/torch_cuda_parity.py",
                                               "torch": torch.__version__, "torch_seed": str(args.seed)})
    print("torch_cuda_parity: wrote %s (PyTorch's default initialization, seed %d)" % (args.out, args.seed),
          file=sys.stderr)
    return 0


def pick_device(name):
    if name == "cuda" and not torch.cuda.is_available():
        print("torch_cuda_parity: PyTorch sees no GPU (use --device cpu for a CPU reference)", file=sys.stderr)
        sys.exit(3)
    return torch.device(name), common.precision("strict")


def cmd_compare(args):
    device, how = pick_device(args.device)
    try:
        init_state, _ = common.read_safetensors(args.init)
        batches = common.example_batches(args.data, args.batch, args.steps)
    except (OSError, ValueError) as e:
        print("torch_cuda_parity: %s" % e, file=sys.stderr)
        return 2
    init_state = {k: v for k, v in init_state.items() if not k.startswith("optimizer.")}
    state, momentum, losses = train(init_state, batches, device, lr=args.lr, momentum=args.momentum)
    fp64 = None
    if args.fp64:
        fp64, _, _ = train(init_state, batches, torch.device("cpu"), torch.float64, lr=args.lr, momentum=args.momentum)
    info = common.torch_info(device)
    worst_rc = 0
    for label, ckpt, metrics in args.run:
        try:
            lockstep, _ = common.read_safetensors(ckpt)
            lockstep_losses = read_losses(metrics, args.steps) if metrics not in ("", "-") else None
        except (OSError, ValueError, KeyError) as e:
            r = {"run": label, "pass": False, "error": str(e), "problems": [str(e)]}
            print(json.dumps(dict(r, **info)), flush=True)
            print("torch_cuda_parity: %s: FAIL: %s" % (label, e), file=sys.stderr)
            worst_rc = 1
            continue
        r = compare(label, lockstep, state, momentum, losses, init_state, args.tolerance, lockstep_losses, fp64,
                    args.steps)
        r.update(info)
        r["precision"] = ("strict fp32 (%s)" % how) if device.type == "cuda" else "fp32 (cpu)"
        print(json.dumps(r), flush=True)
        print("torch_cuda_parity: " + describe(r), file=sys.stderr)
        if not r["pass"]:
            worst_rc = 1
    return worst_rc


# ---- self-test: the whole comparison on the CPU, on made-up data -----------------------------

def self_test():
    torch.manual_seed(0)
    checks = []

    def check(cond, what):
        checks.append((bool(cond), what))
        print("%s %s" % ("ok  " if cond else "FAIL", what), file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        os.mkdir(data)
        n, batch, steps = 40, 8, 3
        px = torch.randint(0, 256, (n * 784,), dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8)
        common.write_idx(os.path.join(data, "train-images-idx3-ubyte.gz"), [n, 28, 28], common.tensor_bytes(px), True)
        common.write_idx(os.path.join(data, "train-labels-idx1-ubyte"), [n], common.tensor_bytes(labels))
        batches = common.example_batches(data, batch, steps)
        check(len(batches) == steps and tuple(batches[0][0].shape) == (batch, 1, 28, 28), "three batches of 8")
        k = 1
        direct = px.reshape(n, 1, 28, 28)[k * batch:(k + 1) * batch]
        check(torch.equal((batches[k][0] * 255).round().to(torch.uint8), direct) and
              torch.equal(batches[k][1], labels[k * batch:(k + 1) * batch].to(torch.int64)),
              "step 2 takes rows 8..15 in file order, pixels / 255, labels as int64")
        check(batches[0][0].dtype == torch.float32 and float(batches[0][0].max()) <= 1.0, "pixels in [0, 1], float32")

        init_path = os.path.join(tmp, "init.safetensors")
        check(main(["init", "--out", init_path, "--seed", "7"]) == 0, "init writes a checkpoint")
        init_state, meta = common.read_safetensors(init_path)
        expect = make_init(7)
        check(sorted(init_state) == sorted(expect) and all(torch.equal(init_state[k], expect[k]) for k in expect),
              "the checkpoint reads back bit for bit, state_dict names (%d tensors)" % len(expect))
        check(tuple(init_state["bn1.num_batches_tracked"].shape) == () and
              init_state["bn1.num_batches_tracked"].dtype == torch.int64, "num_batches_tracked is an I64 scalar")
        check(tuple(init_state["fc1.weight"].shape) == (128, 12544), "fc1.weight is [128, 12544]")

        cpu = torch.device("cpu")
        state, mom, losses = train(init_state, batches, cpu)

        def save_run(name, st, mo, ls):
            ck = os.path.join(tmp, name + ".safetensors")
            common.write_safetensors(ck, dict(st, **mo), {"step": str(steps)})
            mt = os.path.join(tmp, name + ".jsonl")
            with open(mt, "w") as f:
                for i, v in enumerate(ls):
                    f.write(json.dumps({"kind": "step", "step": i + 1, "epoch": 0, "loss": v, "images_per_s": 1.0}) + "\n")
                f.write(json.dumps({"kind": "data", "images_used": 1}) + "\n")
            return ck, mt

        # the same training again: identical
        same = save_run("same", *train(init_state, batches, cpu))
        # float64 training rounded to float32: a realistic other implementation
        s64, m64, l64 = train(init_state, batches, cpu, torch.float64)
        other = save_run("fp64", {k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in s64.items()},
                         {k: v.to(torch.float32) for k, v in m64.items()}, l64)
        # a wrong update: fc1.weight off by 1 %
        bad_state = dict(state)
        bad_state["fc1.weight"] = state["fc1.weight"] * 1.01
        bad = save_run("bad", bad_state, mom, losses)
        # a tensor missing
        missing_state = {k: v for k, v in state.items() if k != "bn1.running_var"}
        missing = save_run("missing", missing_state, mom, losses)
        # other batches (the rows one further on): the losses tell. (A permutation within a batch
        # would be the same training: the loss is a mean.)
        later = common.example_batches(data, batch, steps + 1)
        shifted = [(torch.cat([x[1:], later[k + 1][0][:1]]), torch.cat([y[1:], later[k + 1][1][:1]]))
                   for k, (x, y) in enumerate(later[:steps])]
        moved = save_run("shifted", *train(init_state, shifted, cpu))

        out_path = os.path.join(tmp, "out.jsonl")
        argv = ["compare", "--device", "cpu", "--data", data, "--init", init_path, "--batch", str(batch),
                "--steps", str(steps), "--fp64"]
        for label, (ck, mt) in (("same", same), ("fp64", other), ("bad", bad), ("missing", missing),
                                ("shifted", moved)):
            argv += ["--run", label, ck, mt]
        real_stdout = sys.stdout
        with open(out_path, "w") as f:
            sys.stdout = f
            try:
                rc = main(argv)
            finally:
                sys.stdout = real_stdout
        check(rc == 1, "compare exits 1 when a run fails")
        results = {r["run"]: r for r in (json.loads(l) for l in open(out_path))}
        check(results["same"]["pass"] and results["same"]["worst_param_rel"] == 0.0 and
              results["same"]["loss_rel"] == 0.0, "the same training: pass, error 0")
        check(results["fp64"]["pass"] and 0 < results["fp64"]["worst_param_rel"] < 1e-4,
              "float64 training rounded: pass with a rounding-sized error (%.1e)" % results["fp64"]["worst_param_rel"])
        check(results["fp64"]["lockstep_vs_fp64"] < 1e-6 and results["fp64"]["torch_vs_fp64"] < 1e-4,
              "the fp64 reference is reported for both sides")
        check(not results["bad"]["pass"] and results["bad"]["worst_param"] == "fc1.weight" and
              abs(results["bad"]["worst_param_rel"] - 0.01) < 1e-4, "fc1.weight off by 1 %: FAIL naming it")
        check(not results["missing"]["pass"] and any("bn1.running_var" in p for p in results["missing"]["problems"]),
              "a missing tensor: FAIL naming it")
        check(not results["shifted"]["pass"] and results["shifted"]["loss_rel"] > 1e-3,
              "other batches: FAIL on the losses (%.1e)" % results["shifted"]["loss_rel"])
        check(all("FAIL" in describe(results[k]) for k in ("bad", "missing", "shifted")) and
              describe(results["same"]).startswith("same: pass"), "the one-line descriptions")
        # the example's own metrics format: kind "step" lines among "epoch" and "data" lines
        check(read_losses(same[1], steps) == losses, "losses read from a metrics file")

    failed = [w for ok, w in checks if not ok]
    print("%d passed, %d failed" % (len(checks) - len(failed), len(failed)))
    return 1 if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="check the comparison on the CPU on made-up data")
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("init", help="write PyTorch's initial weights as a checkpoint the example reads with --init")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    p = sub.add_parser("compare", help="train in PyTorch and compare with the example's checkpoints")
    p.add_argument("--data", required=True, help="directory with the example's IDX files")
    p.add_argument("--init", required=True, help="the checkpoint both started from")
    p.add_argument("--run", nargs=3, action="append", required=True, metavar=("LABEL", "CHECKPOINT", "METRICS"),
                   help="an example run: its label, its --save checkpoint, its --metrics file (or -)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=common.LR)
    p.add_argument("--momentum", type=float, default=common.MOMENTUM)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--fp64", action="store_true", help="also train a float64 CPU reference and report both sides against it")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.cmd == "init":
        return cmd_init(args)
    if args.cmd == "compare":
        return cmd_compare(args)
    parser.print_usage(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
