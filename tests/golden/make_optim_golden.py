#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Generates the golden reference of lockstep's optimizers and schedules: torch.optim.Adam and
AdamW (with a parameter group that has no weight decay) for five steps on fixed gradients, and
the learning rates of PyTorch's StepLR, SequentialLR(LinearLR, CosineAnnealingLR) and
OneCycleLR (with its momentum).

Writes tests/golden/optim.safetensors:
  init.weight, init.bias            a Linear(4, 3)'s parameters before the first step
  grad.<k>.weight, grad.<k>.bias    the gradients of step k (0..4)
  <cfg>.<k>.weight, <cfg>.<k>.bias  the parameters after step k, for cfg in adam, adamw
  <cfg>.state.<param>.exp_avg, .exp_avg_sq   the state after the last step
  __metadata__  JSON lists of the schedules' values, step 0 first: step_lr, cosine_warmup,
                onecycle_lr, onecycle_beta1; and each configuration's hyper-parameters

lockstep's test (tests/test_optim.cpp) feeds the same gradients to nn::Adam and nn::AdamW and
compares every step, and evaluates nn::StepLR, nn::CosineWithWarmup and nn::OneCycleLR.

Rerun from the repository root with the project's PyTorch (scripts/install-torch.sh):

    PYTHONPATH=.deps/torch-2.15.0 python3 tests/golden/make_optim_golden.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import write_safetensors  # noqa: E402

OUT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim.safetensors")
STEPS = 5

CONFIGS = {
    # Adam with an L2 weight decay on every parameter.
    "adam": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled": False},
    # AdamW, decoupled weight decay on the weight only (the bias in a group without decay).
    "adamw": {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05, "decoupled": True},
}


def main():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    tensors = {"init.weight": lin.weight.detach().clone(), "init.bias": lin.bias.detach().clone()}
    grads = [(torch.randn(3, 4), torch.randn(3)) for _ in range(STEPS)]
    for k, (gw, gb) in enumerate(grads):
        tensors[f"grad.{k}.weight"], tensors[f"grad.{k}.bias"] = gw, gb
    for cfg, h in CONFIGS.items():
        w = torch.nn.Parameter(tensors["init.weight"].clone())
        b = torch.nn.Parameter(tensors["init.bias"].clone())
        common = {"lr": h["lr"], "betas": h["betas"], "eps": h["eps"]}
        if h["decoupled"]:
            opt = torch.optim.AdamW([{"params": [w], "weight_decay": h["weight_decay"]},
                                     {"params": [b], "weight_decay": 0.0}], **common)
        else:
            opt = torch.optim.Adam([w, b], weight_decay=h["weight_decay"], **common)
        for k, (gw, gb) in enumerate(grads):
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
            tensors[f"{cfg}.{k}.weight"], tensors[f"{cfg}.{k}.bias"] = w.detach().clone(), b.detach().clone()
        for name, p in (("weight", w), ("bias", b)):
            st = opt.state[p]
            assert int(st["step"]) == STEPS
            tensors[f"{cfg}.state.{name}.exp_avg"] = st["exp_avg"].clone()
            tensors[f"{cfg}.state.{name}.exp_avg_sq"] = st["exp_avg_sq"].clone()

    def lrs(make, n, beta1=False):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.Adam([p], lr=0.1)
        sched = make(opt)
        values, betas = [], []
        for step in range(n):
            values.append(opt.param_groups[0]["lr"])
            betas.append(opt.param_groups[0]["betas"][0])
            if step + 1 < n:
                opt.step()
                sched.step()
        return (values, betas) if beta1 else values

    lr_sched = torch.optim.lr_scheduler
    metadata = {
        "step_lr": json.dumps(lrs(lambda o: lr_sched.StepLR(o, step_size=3, gamma=0.5), 12)),
        "cosine_warmup": json.dumps(lrs(lambda o: lr_sched.SequentialLR(
            o, [lr_sched.LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=5),
                lr_sched.CosineAnnealingLR(o, T_max=15, eta_min=1e-4)], milestones=[5]), 20)),
        "configs": json.dumps(CONFIGS),
    }
    one_lr, one_beta = lrs(lambda o: lr_sched.OneCycleLR(o, max_lr=0.1, total_steps=20), 20, beta1=True)
    metadata["onecycle_lr"], metadata["onecycle_beta1"] = json.dumps(one_lr), json.dumps(one_beta)
    metadata["torch_version"] = torch.__version__
    write_safetensors(OUT_PATH, tensors, metadata)
    print(f"wrote {OUT_PATH}")


if __name__ == "__main__":
    main()
