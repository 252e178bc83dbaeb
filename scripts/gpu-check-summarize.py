#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The judging half of scripts/gpu-check.sh: reads a step's logs and prints its rows of the
summary, `step <TAB> result <TAB> detail`, one per line; and prints the summary as a table or as
Markdown. Standard library only (it runs on the GPU machine's python3).

    gpu-check-summarize.py test NAME LOG RC LIMIT CUT
    gpu-check-summarize.py sanitizer TOOL TEST LOG RC LIMIT CUT
    gpu-check-summarize.py example --tol-loss 1e-4 --tol-acc 0.005 --steps 10 --run ROLE LABEL JSONL LOG RC ...
    gpu-check-summarize.py parity JSONL ERRLOG RC --example LABEL LOG RC ...
    gpu-check-summarize.py train [--torch JSONL ERRLOG RC] --lockstep BATCH JSONL LOG RC ... [--graphs BATCH JSONL LOG RC]
    gpu-check-summarize.py bf16 [--torch JSONL ERRLOG RC] --train BATCH JSONL LOG RC --accuracy LOG RC [--goal 0.90] [--cut 1]
    gpu-check-summarize.py train-step LOG RC
    gpu-check-summarize.py syncbn BENCH_JSON TORCH_JSONL
    gpu-check-summarize.py table TSV          (the final table, for a terminal)
    gpu-check-summarize.py markdown TSV       (the same as a Markdown table)
    gpu-check-summarize.py --self-test

RC is a command's exit status, LIMIT the seconds its timeout allowed, CUT 1 when that limit was
what remained of the run's budget (so a time-out there means "not run (budget)", not a hang).
"""

import argparse
import json
import os
import re
import statistics
import sys

TIMED_OUT = (124, 137)


def emit(name, result, detail=""):
    detail = re.sub(r"\s+", " ", str(detail)).strip()
    print("%s\t%s\t%s" % (name, result, detail[:400]))


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail_line(text, pattern=None):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if pattern:
        lines = [l for l in lines if re.search(pattern, l)]
    return lines[-1] if lines else ""


def si(v):
    """57100 -> '57.1k'."""
    if v is None:
        return "?"
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return "%.1f%s" % (v / div, suffix)
    return "%.0f" % v


# ---- tests ------------------------------------------------------------------------------------

def count_checks(text):
    """What a GPU test checked: its final 'N passed, M failed' line; else its 'ok' lines (and
    'FAIL' lines); else test_gpu_bn_math's 'N mismatch(es) ... over M rows'. (passed, failed, how)."""
    m = re.findall(r"^\s*(\d+) passed, (\d+) failed\s*$", text, re.M)
    if m:
        return int(m[-1][0]), int(m[-1][1]), "reported"
    ok = len(re.findall(r"^ok\b", text, re.M))
    bad = len(re.findall(r"^FAIL\b", text, re.M))
    if ok or bad:
        return ok, bad, "ok/FAIL lines"
    m = re.findall(r"^(\d+) mismatch\(es\).* over (\d+) rows", text, re.M)
    if m:
        bad, rows = int(m[-1][0]), int(m[-1][1])
        return rows - bad, bad, "rows compared"
    return None, None, "nothing counted"


def judge_test(name, log, rc, limit, cut):
    text = read(log)
    passed, failed, how = count_checks(text)
    counted = "" if passed is None else "%d passed, %d failed" % (passed, failed)
    if how not in ("reported", "nothing counted"):
        counted += " (counted from %s)" % how
    if rc == 0 and not failed:
        emit(name, "pass", counted or "exit 0 (it printed no count)")
    elif rc == 77:
        emit(name, "skipped", "exit 77: no GPU seen by the test")
    elif rc in TIMED_OUT:
        emit(name, "not run (budget)" if cut else "FAIL",
             "stopped after %s s%s; %s" % (limit, " (what was left of the budget)" if cut else " (its time cap)",
                                          counted or "no count printed"))
    else:
        fails = [l.strip() for l in text.splitlines() if l.startswith("FAIL")][:2]
        emit(name, "FAIL", "exit %d: %s%s" % (rc, (counted + "; ") if counted else "",
                                              " | ".join(fails) or tail_line(text)))


# ---- compute-sanitizer -------------------------------------------------------------------------

UNAVAILABLE = re.compile(r"device not supported|not supported on this|unable to (attach|initialize)|"
                         r"no supported device|Internal Sanitizer Error", re.I)
NOT_AN_ERROR = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Program hit |"
                          r"Target application returned|Saved host backtrace|This tool is deprecated|"
                          r"Error: process didn't terminate|Error: Target application terminated|"
                          r"Error: Tool|Warning: (Unable|Tool)|Note:)")


def sanitizer_findings(text):
    """The errors (or hazards) a compute-sanitizer log reports, each (header, where), API errors
    left out; and the count of API errors it printed."""
    lines = text.splitlines()
    found, api = [], 0
    for i, line in enumerate(lines):
        m = re.match(r"^========= (\S.*)$", line)
        if not m:
            continue
        msg = m.group(1).strip()
        if msg.startswith("Program hit ") and "API call" in msg:
            api += 1
            continue
        if NOT_AN_ERROR.match(msg):
            continue
        where = ""
        for nxt in lines[i + 1:i + 4]:
            w = re.match(r"^=========\s+at (.*)$", nxt)
            if w:
                where = short_location(w.group(1))
                break
        if not where:  # racecheck names the places in the header and the line after it
            follow = lines[i + 1] if i + 1 < len(lines) and re.match(r"^=========\s+and ", lines[i + 1]) else ""
            loc = re.findall(r"in ([\w./-]+:\d+)", msg + " " + follow)
            where = " and ".join(dict.fromkeys(loc))
        found.append((re.sub(r"\s+at 0x[0-9a-f]+", "", msg).split(" in ")[0][:90], where))
    return found, api


def short_location(at):
    """'ns::Kind<float, (int)4>::store_partial(const P &, ...)+0x6c0 in bn_kernels.cuh:138' ->
    'store_partial in bn_kernels.cuh:138'."""
    m = re.search(r"\s+in ([\w./-]+:\d+)\s*$", at)
    sig = re.sub(r"\+0x[0-9a-fA-F]+$", "", (at[:m.start()] if m else at).strip())
    if sig.endswith(")"):  # the parameter list: the balanced (...) at the end
        depth = 0
        for i in range(len(sig) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(sig[i], 0)
            if depth == 0:
                sig = sig[:i]
                break
    prev = None
    while prev != sig:  # template arguments, innermost first
        prev, sig = sig, re.sub(r"<[^<>]*>", "", sig)
    fn = (sig.split("::")[-1].split() or ["?"])[-1]
    return "%s in %s" % (fn, m.group(1)) if m else fn[:80]


def judge_sanitizer(tool, test, log, rc, limit, cut):
    name = "%s %s" % (tool, test)
    text = read(log)
    rel = "logs/" + os.path.basename(log)
    if UNAVAILABLE.search(text):
        emit(name, "unavailable", tail_line(text, UNAVAILABLE.pattern)[:160])
        return
    found, api = sanitizer_findings(text)
    places = {}
    for header, where in found:
        key = "%s at %s" % (header, where) if where else header
        places[key] = places.get(key, 0) + 1
    summary = "; ".join("%s (%d)" % (k, v) for k, v in sorted(places.items(), key=lambda kv: -kv[1])[:2])
    if len(places) > 2:
        summary += "; %d more places" % (len(places) - 2)
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    test_note = ""
    if rc not in (0, 9) and rc not in TIMED_OUT:
        test_note = "; the test itself exited %d under it (see its own row)" % rc
    if race:
        hazards, errs, warns = (int(v) for v in race[-1])
        if errs:
            emit(name, "FAIL", "%d race errors, %d warnings: %s (%s)" % (errs, warns, summary, rel))
        else:
            emit(name, "pass", ("0 hazards" if not hazards else "0 errors, %d warnings: %s (%s)" % (warns, summary, rel))
                 + test_note)
        return
    if errors:
        total = int(errors[-1])
        kernel = max(0, total - api)  # API errors printed (no --report-api-errors no) are not kernel errors
        if kernel:
            emit(name, "FAIL", "%d errors: %s (%s)%s" % (kernel, summary or "not itemized in the log", rel, test_note))
        else:
            emit(name, "pass", "0 errors%s%s" % (" (%d API errors left out)" % api if api else "", test_note))
        return
    if rc in TIMED_OUT:
        if found:
            emit(name, "FAIL", "%d+ errors before it was stopped at %s s: %s (%s)" % (len(found), limit, summary, rel))
        else:
            emit(name, "not run (budget)" if cut else "timeout",
                 "stopped after %s s, %s; nothing found until then (%s)" %
                 (limit, "what was left of the budget" if cut else "its time cap", rel))
        return
    if rc == 77:
        emit(name, "skipped", "no GPU seen by the test")
        return
    if found:
        emit(name, "FAIL", "%d+ errors (exit %d, no ERROR SUMMARY: the log ends early): %s (%s)" % (len(found), rc, summary, rel))
        return
    emit(name, "no summary", "exit %d, no ERROR/RACECHECK SUMMARY: %s (%s)" %
         (rc, tail_line(text, r"(?i)error|unable|not supported")[:120] or tail_line(text)[:120], rel))


# ---- the example ------------------------------------------------------------------------------

def step_losses(path):
    out = {}
    for line in read(path).splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "step" and "loss" in r:
            out[int(r["step"])] = float(r["loss"])
    return [out[k] for k in sorted(out)]


def accuracy_of(log_text):
    m = re.findall(r"test accuracy ([0-9.]+)", log_text)
    return float(m[-1]) if m else None


def worst_rel(a, b, n):
    a, b = a[:n], b[:n]
    if len(a) < n or len(b) < n or not n:
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def judge_example(args):
    """Rows 'example 10 steps, 1 vs 4 replicas' (losses step by step) and 'example accuracy vs
    host' from the runs: role 'ref' (cuda, 1 replica), 'judge' (cuda, 4 replicas), 'host'."""
    runs = [dict(role=r, label=l, jsonl=j, log=g, rc=int(c)) for r, l, j, g, c in args.run]
    for r in runs:
        r["losses"] = step_losses(r["jsonl"])
        r["text"] = read(r["log"])
        r["acc"] = accuracy_of(r["text"])
        if r["acc"] is None:  # the metrics' last line with a test accuracy ("final" or "epoch")
            for line in read(r["jsonl"]).splitlines():
                try:
                    v = json.loads(line).get("test_accuracy")
                except (ValueError, AttributeError):
                    continue
                if v is not None:
                    r["acc"] = float(v)
    ref = next(r for r in runs if r["role"] == "ref")
    cudas = [r for r in runs if r["role"] in ("ref", "judge")]
    host = next((r for r in runs if r["role"] == "host"), None)
    n = args.steps
    name = "example %d steps, 1 vs 4 replicas" % n
    broken = [r for r in cudas if len(r["losses"]) < n]
    if broken:
        r = broken[0]
        emit(name, "FAIL", "%s: %d of %d step losses, exit %d: %s" % (r["label"], len(r["losses"]), n, r["rc"],
                                                                       tail_line(r["text"])[:200]))
    else:
        parts, ok = [], True
        for r in cudas:
            if r is ref:
                continue
            w = worst_rel(r["losses"], ref["losses"], n)
            ok = ok and w <= args.tol_loss
            parts.append("%s vs %s %.1e" % (r["label"], ref["label"], w))
            longer = min(len(r["losses"]), len(ref["losses"]))
            if longer > n:
                parts.append("over %d steps %.1e" % (longer, worst_rel(r["losses"], ref["losses"], longer)))
        if host and len(host["losses"]) >= n:
            parts.append("%s vs %s %.1e (not judged)" % (host["label"], ref["label"], worst_rel(host["losses"], ref["losses"], n)))
        emit(name, "pass" if ok else "FAIL", "worst relative loss difference: %s (allowed %.0e)" %
             (", ".join(parts), args.tol_loss))
    name = "example accuracy vs host"
    if host is None:
        return
    if host["acc"] is None:
        if host["rc"] in TIMED_OUT:
            emit(name, "not run (budget)" if args.cut else "FAIL",
                 "the host run was stopped after %d of %s steps" % (len(host["losses"]), args.train_steps or "?"))
        else:
            emit(name, "FAIL", "the host run gave no accuracy (exit %d): %s" % (host["rc"], tail_line(host["text"])[:200]))
        return
    parts, ok = [], True
    for r in cudas:
        if r["acc"] is None:
            ok = False
            parts.append("%s: no accuracy (exit %d: %s)" % (r["label"], r["rc"], tail_line(r["text"])[:120]))
        else:
            ok = ok and abs(r["acc"] - host["acc"]) <= args.tol_acc
            parts.append("%s %.4f" % (r["label"], r["acc"]))
    emit(name, "pass" if ok else "FAIL", "after %s steps: %s; %s %.4f (allowed difference %.3f%s)" % (
        args.train_steps or "?", ", ".join(parts), host["label"], host["acc"], args.tol_acc,
        ", %s" % args.note if args.note else ""))


# ---- PyTorch parity ---------------------------------------------------------------------------

def judge_parity(args):
    prefix = "PyTorch parity, %d steps" % args.steps
    results = {}
    for line in read(args.jsonl).splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        results[r.get("run")] = r
    err = read(args.errlog)
    if args.rc == 3 and not results:
        emit(prefix, "not run (no torch)", tail_line(err)[:200])
        return
    if not results and args.rc in TIMED_OUT:
        emit(prefix, "not run (budget)" if args.cut else "FAIL", "PyTorch's run was stopped after %s s" % args.limit)
        return
    if not results:
        emit(prefix, "FAIL", "torch_cuda_parity.py exit %d: %s" % (args.rc, tail_line(err)[:200]))
        return
    for label, log, rc in args.example or []:
        name = "%s: %s" % (prefix, label)
        r = results.get(label)
        rc = int(rc)
        if rc != 0 and (r is None or not r.get("pass")):
            emit(name, "FAIL", "the example exited %d: %s" % (rc, tail_line(read(log))[:200]))
            continue
        if r is None:
            emit(name, "FAIL", "no comparison printed for it")
            continue
        if "worst_param_rel" not in r:
            emit(name, "FAIL", "; ".join(r.get("problems", [])) or r.get("error", "?"))
            continue
        detail = "worst relative parameter error %.1e (%s; allowed %.0e)" % (
            r["worst_param_rel"], r["worst_param"], r["tolerance"])
        if r.get("loss_rel") is not None:
            detail += ", losses within %.1e" % r["loss_rel"]
        detail += "; updates %.1e, running stats %.1e" % (r["worst_update_rel"], r["worst_running_stat_rel"])
        if r.get("torch_vs_fp64") is not None:
            detail += "; vs fp64: lockstep %.1e, torch %.1e" % (r["lockstep_vs_fp64"], r["torch_vs_fp64"])
        detail += "; torch %s %s" % (r.get("torch", "?"), r.get("precision", ""))
        if r.get("problems"):
            detail += "; " + "; ".join(r["problems"][:2])
        emit(name, "pass" if r.get("pass") else "FAIL", detail)


# ---- training speed -----------------------------------------------------------------------------

def lockstep_median(path, skip=5):
    rates = []
    for line in read(path).splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "step" and int(r.get("step", 0)) > skip and "images_per_s" in r:
            rates.append(float(r["images_per_s"]))
    return (statistics.median(rates), len(rates)) if rates else (None, 0)


def torch_train_rows(spec):
    """bench/torch_cuda_train.py's lines by (batch, mode), and what to say when there are none."""
    torch_rows = {}
    torch_text = ""
    if spec:
        path, errlog, rc = spec
        for line in read(path).splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            torch_rows[(r["batch"], r["mode"])] = r
        torch_text = "exit %s: %s" % (rc, tail_line(read(errlog))[:120]) if not torch_rows else ""
    return torch_rows, torch_text


def judge_train(args):
    torch_rows, torch_text = torch_train_rows(args.torch)
    runs = [(spec, False) for spec in args.lockstep] + [(spec, True) for spec in (getattr(args, "graphs", None) or [])]
    for (batch, path, log, rc), graphs in runs:
        batch, rc = int(batch), int(rc)
        name = "training img/s, batch %d%s" % (batch, ", graphs" if graphs else "")
        ours, n = lockstep_median(path)
        if ours is None:
            emit(name, "FAIL", "the example gave no step rates (exit %d): %s" % (rc, tail_line(read(log))[:160]))
            continue
        detail = "lockstep %s (1 replica, math pytorch_default%s, median of %d steps)" % (
            si(ours), ", --graphs; goal vs PyTorch defaults >= 3" if graphs else "", n)
        parts = []
        for mode, label in (("default", "PyTorch defaults"), ("strict", "strict fp32"), ("bf16", "bf16 autocast")):
            r = torch_rows.get((batch, mode))
            if r:
                parts.append("%s %s: vs_torch %.2f (pipelined %s: %.2f)" % (
                    label, si(r["torch_images_per_s"]), ours / r["torch_images_per_s"],
                    si(r["torch_images_per_s_pipelined"]), ours / r["torch_images_per_s_pipelined"]))
        if parts:
            any_r = next(iter(torch_rows.values()))
            emit(name, "measured", "%s; %s; torch %s" % (detail, "; ".join(parts), any_r.get("torch", "?")))
        elif not args.torch:
            emit(name, "not run (no torch)", detail + "; no PyTorch to compare with")
        else:
            emit(name, "measured", "%s; PyTorch gave nothing (%s)" % (detail, torch_text or "no line for this batch"))


def judge_bf16(args):
    """Rows 'training img/s, batch B, bf16' (--precision bf16 against PyTorch's bf16 autocast, goal
    >= 1) and 'bf16 accuracy, 2 epochs' (the example's test accuracy, goal >= --goal)."""
    torch_rows, torch_text = torch_train_rows(args.torch)
    batch, path, log, rc = args.train
    batch, rc = int(batch), int(rc)
    name = "training img/s, batch %d, bf16" % batch
    ours, n = lockstep_median(path)
    budget = "not run (budget)"
    if ours is None and rc in TIMED_OUT and args.cut:
        emit(name, budget, "stopped by the run's budget (exit %d)" % rc)
    elif ours is None:
        emit(name, "FAIL", "the example gave no step rates (exit %d): %s" % (rc, tail_line(read(log))[:160]))
    else:
        detail = "lockstep %s (1 replica, --precision bf16, median of %d steps)" % (si(ours), n)
        parts = []
        for mode, label in (("bf16", "bf16 autocast (goal vs_torch >= 1)"), ("default", "PyTorch defaults")):
            r = torch_rows.get((batch, mode))
            if r:
                parts.append("%s %s: vs_torch %.2f" % (label, si(r["torch_images_per_s"]), ours / r["torch_images_per_s"]))
        if parts:
            emit(name, "measured", "%s; %s" % (detail, "; ".join(parts)))
        elif not args.torch:
            emit(name, "not run (no torch)", detail + "; no PyTorch to compare with")
        else:
            emit(name, "measured", "%s; PyTorch gave nothing (%s)" % (detail, torch_text or "no line for this batch"))
    log, rc = args.accuracy
    rc = int(rc)
    name = "bf16 accuracy, 2 epochs"
    acc = accuracy_of(read(log))
    if acc is None and rc in TIMED_OUT and args.cut:
        emit(name, budget, "stopped by the run's budget (exit %d)" % rc)
    elif acc is None or rc != 0:
        emit(name, "FAIL", "exit %d: %s" % (rc, tail_line(read(log))[:160]))
    else:
        emit(name, "pass" if acc >= args.goal else "FAIL", "test accuracy %.4f (goal >= %.2f; --precision bf16 --gradient-precision bf16, 2 replicas, batch 64)" %
             (acc, args.goal))


def judge_train_step(log, rc):
    text = read(log)
    got = False
    for n in (1, 2, 4):
        m = re.search(r"replicas:%d/\S*.*?images_per_s=([0-9.]+[kM]?)" % n, text)
        if m:
            got = True
            emit("images/s, %d replica(s) on cuda:0, batch 64 each" % n, "measured", m.group(1))
    ws = [l.strip() for l in text.splitlines() if l.startswith("weak_scaling 4")]
    if got:
        emit("weak scaling", "measured", ws[0] if ws else "not reported")
    else:
        emit("bench_cuda_train_step", "not run (budget)" if rc in TIMED_OUT and ARGS_CUT[0] else "FAIL",
             "exit %d: %s" % (rc, tail_line(text, r"(?i)error|skip")[:200] or tail_line(text)[:200]))


KERNELS_ROW = "kernel spills and vector accesses"


def judge_kernels(log, rc, arch, cut):
    """The static gate's run for this GPU's architecture (tests/cuda_static/gate.cmake): counts
    from check-kernel-resources.py's table (arch, regs, budget, smem, lmem, V, vst/vld, kernel)."""
    text = read(log)
    rows = []
    for line in text.splitlines():
        f = line.split()
        if f[:1] == ["--"]:
            f = f[1:]
        if len(f) >= 8 and re.fullmatch(r"sm_\d+", f[0]) and f[1].isdigit() and f[4].isdigit():
            rows.append(f)
    vec = [f for f in rows if f[5] != "1" and "/" in f[6]]
    loads = [f for f in vec if f[6].split("/")[1] != "0"]
    maps = [f for f in vec if f[7].startswith("map_kernel")]
    stores = [f for f in maps if f[6].split("/")[0] != "0"]
    lmem = sum(int(f[4]) for f in rows)
    figures = ("sm_%s: %d kernels, %d bytes of local memory; of the %d of vector width > 1, %d with vector loads, "
               "and %d of the %d map kernels with vector stores" % (arch, len(rows), lmem, len(vec), len(loads), len(stores),
                                                                   len(maps)))
    if rc == 0 and rows:
        emit(KERNELS_ROW, "ok", figures + "; no spills (ptxas -Werror)")
    elif rc in TIMED_OUT and cut:
        emit(KERNELS_ROW, "not run (budget)", "stopped by the run's budget (exit %d)" % rc)
    else:
        why = " ".join(l.strip() for l in text.splitlines() if re.search(r"FAILED|violation|spill|error", l))[:300]
        emit(KERNELS_ROW, "FAIL", "exit %d: %s" % (rc, why or tail_line(text)[:200]))


ARGS_CUT = [False]


def judge_syncbn(bench_json, torch_jsonl):
    try:
        runs = json.load(open(bench_json))["benchmarks"]
    except (OSError, ValueError, KeyError) as e:
        emit("SyncBN benchmark", "FAIL", "no results (%s)" % e)
        return
    torch = {}
    for l in read(torch_jsonl).splitlines():
        try:
            r = json.loads(l)
        except ValueError:
            continue
        if r.get("ms"):
            torch[(r["N"], r["C"], r["HW"], r["nhwc"], r["bf16"])] = (r["ms"], r["torch"])
    rows = 0
    for b in runs:
        if b.get("run_type") == "aggregate":
            continue
        m = re.search(r"N:(\d+)/C:(\d+)/HW:(\d+)/nhwc:(\d)/bf16:(\d)", b["name"])
        if not m:
            continue
        key = tuple(int(v) for v in m.groups())
        layout = ("NHWC" if key[3] else "NCHW") + (" bf16" if key[4] else " fp32")
        name = "SyncBN %dx%dx%dx%d %s" % (key[0], key[1], key[2], key[2], layout)
        rows += 1
        if "error_occurred" in b or b.get("error_occurred"):
            emit(name, "FAIL", b.get("error_message", "error"))
            continue
        ms = b["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
        parts = ["vs_floor %.2f" % b.get("vs_floor", 0)]
        if "vs_cudnn" in b:
            parts.append("vs_cudnn %.2f" % b["vs_cudnn"])
        if "vs_cudnn_persistent" in b:
            parts.append("vs_cudnn_persistent %.2f" % b["vs_cudnn_persistent"])
        if key in torch:
            parts.append("vs_torch %.2f (torch %s)" % (torch[key][0] / ms, torch[key][1]))
        emit(name, "measured", "%.3f ms; %s" % (ms, ", ".join(parts)))
    if not rows:
        emit("SyncBN benchmark", "FAIL", "no cases in %s" % os.path.basename(bench_json))


# ---- the summary ------------------------------------------------------------------------------

def read_rows(tsv):
    rows = []
    for line in read(tsv).splitlines():
        if not line.strip():
            continue
        r = (line.split("\t") + ["", ""])[:3]
        if r == ["step", "result", "detail"]:
            continue
        rows.append(r)
    return rows


def table(tsv):
    rows = read_rows(tsv)
    w0 = max([len(r[0]) for r in rows] + [4])
    w1 = max([len(r[1]) for r in rows] + [6])
    out = ["", "== gpu-check ==", "%-*s  %-*s  detail" % (w0, "step", w1, "result")]
    out += ["%-*s  %-*s  %s" % (w0, r[0], w1, r[1], r[2]) for r in rows]
    return "\n".join(out)


def markdown(tsv):
    def cell(s):
        return s.replace("\\", "\\\\").replace("|", "\\|").strip()
    out = ["| step | result | detail |", "|---|---|---|"]
    out += ["| %s | %s | %s |" % tuple(cell(c) for c in r) for r in read_rows(tsv)]
    return "\n".join(out) + "\n"


def verdict(tsv):
    results = [r[1] for r in read_rows(tsv) if r[0] != "total"]
    if any(r == "FAIL" for r in results):
        return "FAIL"
    if any(r not in ("ok", "pass", "measured") for r in results):
        return "incomplete"
    return "ok"


# ---- self-test ------------------------------------------------------------------------------

SAMPLE_MEMCHECK = """========= COMPUTE-SANITIZER
ok   Conv2d 3->8 k3 p1: forward
========= Invalid __global__ write of size 8 bytes
=========     at lockstep::kernels::device::layer_kernels::ChannelSumPlanes::store_partial(const lockstep::kernels::device::layer_kernels::ChannelSumParams &, const Where &, int, const Sum1 &)+0x6c0 in layer_kernels.cuh:568
=========     by thread (0,0,0) in block (0,0,0)
=========     Access to 0x7f6e0103fffc is misaligned
========= 
========= Invalid __global__ write of size 8 bytes
=========     at lockstep::kernels::device::bn_kernels::StatsChannelsFirst<float, 4>::store_partial(const P &)+0x10 in bn_kernels.cuh:138
=========     by thread (0,0,0) in block (0,1,0)
========= 
========= Program hit cudaErrorNoKernelImageForDevice (error 209) due to "no kernel image is available for execution on the device" on CUDA API call to cudaFuncGetAttributes.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: ncclInitKernelsForDevice(int, int, unsigned long*) in enqueue.cc:52 [0x6d9d3] in libnccl.so.2
========= 
========= Invalid __global__ write of size 8 bytes
=========     at lockstep::kernels::device::layer_kernels::ChannelSumPlanes::store_partial(const P &)+0x6c0 in layer_kernels.cuh:568
========= Target application returned an error
========= ERROR SUMMARY: 4 errors
"""
SAMPLE_API_ONLY = """========= COMPUTE-SANITIZER
========= Program hit cudaErrorInvalidDevice (error 101) due to "invalid device ordinal" on CUDA API call to cudaSetDevice.
=========     Saved host backtrace up to driver entry point at error
ok   LOCKSTEP_CUDA_CHECK throws DeviceError naming the failed call
3 passed, 0 failed
========= ERROR SUMMARY: 1 error
"""
SAMPLE_RACE_CLEAN = """ok   device tensor copy
0 failure(s)
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
SAMPLE_RACE_BAD = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x1a0 in bn_kernels.cuh:200:void reduce<float>(P)
=========     and Read access at 0x1c0 in bn_kernels.cuh:204:void reduce<float>(P) [8 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
SAMPLE_SYNC = """========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at void k(int)+0x70 in sync.cu:12
========= ERROR SUMMARY: 1 error
"""
SAMPLE_INIT_CLEAN = """========= COMPUTE-SANITIZER
12 passed, 0 failed
========= ERROR SUMMARY: 0 errors
"""


def self_test():
    import tempfile
    checks = []

    def check(cond, what):
        checks.append(bool(cond))
        print("%s %s" % ("ok  " if cond else "FAIL", what), file=sys.stderr)

    def rows_of(fn, *a):
        import io
        buf, real = io.StringIO(), sys.stdout
        sys.stdout = buf
        try:
            fn(*a)
        finally:
            sys.stdout = real
        return [l.split("\t") for l in buf.getvalue().splitlines()]

    with tempfile.TemporaryDirectory() as tmp:
        def put(name, text):
            p = os.path.join(tmp, name)
            with open(p, "w") as f:
                f.write(text)
            return p

        # tests
        r = rows_of(judge_test, "test_gpu_core", put("a.log", "ok   x\nok   y\n12 passed, 0 failed\n"), 0, 60, 0)
        check(r == [["test_gpu_core", "pass", "12 passed, 0 failed"]], "test: the 'N passed, M failed' line")
        r = rows_of(judge_test, "test_gpu_bn_math", put("b.log", "0 mismatch(es) between device and host batch-norm "
                                                                  "math over 4096 rows\n"), 0, 60, 0)
        check(r[0][1] == "pass" and r[0][2].startswith("4096 passed, 0 failed"), "test: bn_math's rows (%s)" % r[0][2])
        r = rows_of(judge_test, "t", put("c.log", "ok   a\nok   b\nok   c\n0 failure(s)\n"), 0, 60, 0)
        check(r[0][2].startswith("3 passed, 0 failed (counted from ok/FAIL lines)"), "test: fallback to ok lines")
        r = rows_of(judge_test, "t", put("d.log", "ok   a\nFAIL unexpected exception: CUDA error 716\n1 passed, 1 failed\n"),
                    1, 60, 0)
        check(r[0][1] == "FAIL" and "CUDA error 716" in r[0][2] and "1 passed, 1 failed" in r[0][2], "test: a failure")
        r = rows_of(judge_test, "t", put("e.log", "ok   a\n"), 124, 42, 1)
        check(r[0][1] == "not run (budget)", "test: stopped by the budget")
        r = rows_of(judge_test, "t", put("e2.log", "ok   a\n"), 124, 90, 0)
        check(r[0][1] == "FAIL" and "its time cap" in r[0][2], "test: over its own cap is a FAIL")

        # sanitizers
        r = rows_of(judge_sanitizer, "memcheck", "test_gpu_layers", put("m.log", SAMPLE_MEMCHECK), 9, 120, 0)
        check(r[0][1] == "FAIL" and r[0][2].startswith("3 errors") and "store_partial in layer_kernels.cuh:568 (2)" in r[0][2]
              and "bn_kernels.cuh:138 (1)" in r[0][2], "memcheck: kernel errors by place, the API error left out: %s" % r[0][2])
        r = rows_of(judge_sanitizer, "memcheck", "test_gpu_core", put("m2.log", SAMPLE_API_ONLY), 9, 120, 0)
        check(r[0][1] == "pass" and "1 API errors left out" in r[0][2], "memcheck: only a deliberate API error: pass")
        r = rows_of(judge_sanitizer, "racecheck", "test_gpu_core", put("r.log", SAMPLE_RACE_CLEAN), 0, 120, 0)
        check(r == [["racecheck test_gpu_core", "pass", "0 hazards"]], "racecheck: RACECHECK SUMMARY 0 hazards is a pass")
        r = rows_of(judge_sanitizer, "racecheck", "test_gpu_layers", put("r2.log", SAMPLE_RACE_BAD), 9, 120, 0)
        check(r[0][1] == "FAIL" and "bn_kernels.cuh:200" in r[0][2], "racecheck: a race error names its places: %s" % r[0][2])
        r = rows_of(judge_sanitizer, "racecheck", "test_gpu_data_parallel",
                    put("r3.log", SAMPLE_RACE_CLEAN.replace("0 failure(s)", "FAIL x")), 1, 120, 0)
        check(r[0][1] == "pass", "racecheck: a test failing under it is the test's row, not the sanitizer's")
        r = rows_of(judge_sanitizer, "synccheck", "t", put("s.log", SAMPLE_SYNC), 9, 120, 0)
        check(r[0][1] == "FAIL" and "sync.cu:12" in r[0][2], "synccheck: ERROR SUMMARY")
        r = rows_of(judge_sanitizer, "initcheck", "t", put("i.log", SAMPLE_INIT_CLEAN), 0, 120, 0)
        check(r[0][1] == "pass" and r[0][2] == "0 errors", "initcheck: clean")
        r = rows_of(judge_sanitizer, "initcheck", "t", put("i2.log", "========= COMPUTE-SANITIZER\nok a\n"), 124, 33, 1)
        check(r[0][1] == "not run (budget)", "a sanitizer stopped by the budget")
        r = rows_of(judge_sanitizer, "memcheck", "t", put("i3.log", SAMPLE_MEMCHECK.split("========= Target")[0]), 124, 33, 1)
        check(r[0][1] == "FAIL" and r[0][2].startswith("4+ errors") is False and "errors before it was stopped" in r[0][2],
              "errors found before a cut still fail")
        r = rows_of(judge_sanitizer, "memcheck", "t", put("u.log", "========= Error: Device not supported\n"), 1, 33, 0)
        check(r[0][1] == "unavailable", "an unsupported device: unavailable")

        # the example
        def metrics(name, losses, rate=50000.0):
            return put(name, "".join(json.dumps({"kind": "step", "step": i + 1, "epoch": 0, "loss": v,
                                                 "images_per_s": rate if i else 400.0}) + "\n"
                                     for i, v in enumerate(losses)) + json.dumps({"kind": "data"}) + "\n")
        base = [2.3 - 0.01 * i for i in range(200)]
        r1 = metrics("r1.jsonl", base)
        r4 = metrics("r4.jsonl", [v * (1 + 2e-6) for v in base])
        h = metrics("h.jsonl", [v * (1 + 3e-5) for v in base])
        l1 = put("r1.log", "test accuracy 0.7712 | replicas 1 | backend cuda | 200 steps\n")
        l4 = put("r4.log", "test accuracy 0.7690 | replicas 4 | backend cuda | 200 steps\n")
        lh = put("h.log", "test accuracy 0.7705 | replicas 8 | backend host | 200 steps\n")
        ns = argparse.Namespace(tol_loss=1e-4, tol_acc=0.005, steps=10, train_steps="200", note="2000 test images",
                                cut=0, run=[["ref", "cuda 1 replica", r1, l1, "0"], ["judge", "cuda 4 replicas", r4, l4, "0"],
                                            ["host", "host 8 replicas", h, lh, "0"]])
        r = rows_of(judge_example, ns)
        check(r[0][:2] == ["example 10 steps, 1 vs 4 replicas", "pass"] and "2.0e-06" in r[0][2], "example: losses 1 vs 4")
        check(r[1][:2] == ["example accuracy vs host", "pass"] and "0.7690" in r[1][2], "example: accuracy within 0.005")
        lbad = put("r4b.log", "test accuracy 0.1002 | replicas 4 | backend cuda\n")
        ns.run[1][3] = lbad
        r = rows_of(judge_example, ns)
        check(r[1][1] == "FAIL", "example: chance accuracy on CUDA fails")
        ns.run[1][2] = metrics("r4c.jsonl", base[:3])
        ns.run[1][4] = "2"
        ns.run[1][3] = put("r4c.log", "mnist: CUDA error 716 (cudaErrorMisalignedAddress)\n")
        r = rows_of(judge_example, ns)
        check(r[0][1] == "FAIL" and "716" in r[0][2], "example: a crashed run")

        # parity
        pj = put("parity.jsonl", json.dumps({"run": "cuda, 1 replica", "pass": True, "tolerance": 1e-3, "worst_param_rel": 1.4e-4,
                                             "worst_param": "bn1.bias", "loss_rel": 2e-7, "worst_update_rel": 3e-3,
                                             "worst_running_stat_rel": 1e-6, "lockstep_vs_fp64": 1e-4,
                                             "torch_vs_fp64": 9e-5, "torch": "2.11.0", "precision": "strict fp32",
                                             "problems": []}) + "\n")
        ns = argparse.Namespace(jsonl=pj, errlog=put("p.err", ""), rc=0, steps=3, cut=0, limit=60,
                                example=[["cuda, 1 replica", l1, "0"], ["cuda, 4 replicas", put("x.log", "mnist: boom\n"), "2"]])
        r = rows_of(judge_parity, ns)
        check(r[0][:2] == ["PyTorch parity, 3 steps: cuda, 1 replica", "pass"] and "1.4e-04" in r[0][2], "parity: pass")
        check(r[1][1] == "FAIL" and "boom" in r[1][2], "parity: the example's failure is named")
        ns = argparse.Namespace(jsonl=put("none.jsonl", ""), errlog=put("p2.err", "torch_cuda_parity: no PyTorch\n"), rc=3,
                                steps=3, cut=0, limit=60, example=[])
        check(rows_of(judge_parity, ns)[0][1] == "not run (no torch)", "parity: no torch")

        # training speed
        tj = put("t.jsonl", "".join(json.dumps({"batch": 64, "mode": m, "torch_images_per_s": v, "torch_images_per_s_pipelined":
                                                v * 1.5, "torch": "2.11.0"}) + "\n" for m, v in (("default", 25000.0),
                                                                                                ("strict", 20000.0))))
        ns = argparse.Namespace(torch=[tj, put("t.err", ""), "0"], lockstep=[["64", r1, l1, "0"]])
        r = rows_of(judge_train, ns)
        check(r[0][:2] == ["training img/s, batch 64", "measured"] and "vs_torch 2.00" in r[0][2] and
              "vs_torch 2.50" in r[0][2] and "lockstep 50.0k" in r[0][2], "train: vs_torch per mode: %s" % r[0][2])
        ns = argparse.Namespace(torch=None, lockstep=[["256", r1, l1, "0"]])
        check(rows_of(judge_train, ns)[0][1] == "not run (no torch)", "train: no torch")
        ns = argparse.Namespace(torch=[tj, put("t2.err", ""), "0"], lockstep=[["64", r1, l1, "0"]], graphs=[["64", r1, l1, "0"]])
        r = rows_of(judge_train, ns)
        check(len(r) == 2 and r[1][:2] == ["training img/s, batch 64, graphs", "measured"] and "--graphs" in r[1][2] and
              "vs_torch 2.00" in r[1][2], "train: the --graphs run gets its own row: %s" % (r[-1:],))

        # bf16
        tj16 = put("t16.jsonl", "".join(json.dumps({"batch": 256, "mode": m, "torch_images_per_s": v, "torch_images_per_s_pipelined":
                                                    v, "torch": "2.11.0"}) + "\n" for m, v in (("default", 100000.0),
                                                                                              ("bf16", 25000.0))))
        acc_log = put("acc16.log", "test accuracy 0.9071 | replicas 1 | backend cuda | 1876 steps\n")
        ns = argparse.Namespace(torch=[tj16, put("t16.err", ""), "0"], train=["256", r1, l1, "0"], accuracy=[acc_log, "0"],
                                goal=0.90, cut=0)
        r = rows_of(judge_bf16, ns)
        check(r[0][:2] == ["training img/s, batch 256, bf16", "measured"] and "vs_torch 2.00" in r[0][2] and
              "vs_torch 0.50" in r[0][2], "bf16: vs bf16 autocast and defaults: %s" % (r[:1],))
        check(r[1][:2] == ["bf16 accuracy, 2 epochs", "pass"] and "0.9071" in r[1][2], "bf16: accuracy >= 0.90 passes")
        ns.accuracy = [put("acc16b.log", "test accuracy 0.8712 | replicas 1\n"), "0"]
        check(rows_of(judge_bf16, ns)[1][1] == "FAIL", "bf16: accuracy below the goal fails")
        ns.accuracy = [put("acc16c.log", "mnist: boom\n"), "2"]
        check(rows_of(judge_bf16, ns)[1][1] == "FAIL", "bf16: no accuracy fails")
        ns.accuracy = [put("acc16d.log", "test accuracy 0.9100 | replicas 1\n"), "3"]
        check(rows_of(judge_bf16, ns)[1][1] == "FAIL", "bf16: an accuracy with a failed exit fails")
        ns.accuracy = [put("acc16e.log", ""), "124"]
        ns.train = ["256", put("none16.jsonl", ""), put("none16.log", ""), "124"]
        ns.cut = 1
        r = rows_of(judge_bf16, ns)
        check([x[1] for x in r] == ["not run (budget)", "not run (budget)"], "bf16: cut by the budget: %s" % (r,))

        # the kernels' static gate
        gate = ("arch  regs  budget  smem  lmem  V  vst/vld  kernel\n"
                "sm_90    26     255      0     0  1        -  map_kernel<bn_kernels::Centre>\n"
                "sm_90    37      64      0     0  4      2/4  map_kernel<bn_kernels::DxChannelsFirst<__half, 4> >\n"
                "sm_90    40      64      0     0  4      0/2  reduce_kernel<bn_kernels::StatsChannelsFirst<float, 4> >\n"
                "sm_90    30      64      0     0  4      0/0  map_kernel<Fill<4> >\n"
                "OK: no local memory\n")
        r = rows_of(judge_kernels, put("gate.log", gate), 0, "90", 0)
        check(r == [[KERNELS_ROW, "ok", "sm_90: 4 kernels, 0 bytes of local memory; of the 3 of vector width > 1, 2 with vector "
                                        "loads, and 1 of the 2 map kernels with vector stores; no spills (ptxas -Werror)"]],
              "kernels: the gate's counts: %s" % (r,))
        r = rows_of(judge_kernels, put("gate2.log", "FAILED: 1 violation(s)\n  sm_90 x: spills registers\n"), 1, "90", 0)
        check(r and r[0][1] == "FAIL" and "spills" in r[0][2], "kernels: a failed gate: %s" % (r,))

        # summary
        tsv = put("s.tsv", "step\tresult\tdetail\nbuild\tok\t60 s\ntest_gpu_core\tpass\t3 passed, 0 failed\n"
                           "memcheck x\tnot run (budget)\ta | b\n")
        md = markdown(tsv)
        check(md.splitlines()[0] == "| step | result | detail |" and "a \\| b" in md, "markdown, pipes escaped")
        check(verdict(tsv) == "incomplete" and "== gpu-check ==" in table(tsv), "verdict and table")

    failed = checks.count(False)
    print("%d passed, %d failed" % (len(checks) - failed, failed))
    return 1 if failed else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--self-test"]:
        return self_test()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("test")
    s.add_argument("name"); s.add_argument("log"); s.add_argument("rc", type=int)
    s.add_argument("limit"); s.add_argument("cut", type=int)
    s = sub.add_parser("sanitizer")
    s.add_argument("tool"); s.add_argument("test"); s.add_argument("log"); s.add_argument("rc", type=int)
    s.add_argument("limit"); s.add_argument("cut", type=int)
    s = sub.add_parser("example")
    s.add_argument("--tol-loss", type=float, default=1e-4); s.add_argument("--tol-acc", type=float, default=0.005)
    s.add_argument("--steps", type=int, default=10); s.add_argument("--train-steps", default="")
    s.add_argument("--note", default=""); s.add_argument("--cut", type=int, default=0)
    s.add_argument("--run", nargs=5, action="append", required=True, metavar=("ROLE", "LABEL", "JSONL", "LOG", "RC"))
    s = sub.add_parser("parity")
    s.add_argument("jsonl"); s.add_argument("errlog"); s.add_argument("rc", type=int)
    s.add_argument("--steps", type=int, default=3); s.add_argument("--cut", type=int, default=0)
    s.add_argument("--limit", default="?")
    s.add_argument("--example", nargs=3, action="append", metavar=("LABEL", "LOG", "RC"))
    s = sub.add_parser("train")
    s.add_argument("--torch", nargs=3, metavar=("JSONL", "ERRLOG", "RC"))
    s.add_argument("--lockstep", nargs=4, action="append", required=True, metavar=("BATCH", "JSONL", "LOG", "RC"))
    s.add_argument("--graphs", nargs=4, action="append", metavar=("BATCH", "JSONL", "LOG", "RC"))
    s = sub.add_parser("bf16")
    s.add_argument("--torch", nargs=3, metavar=("JSONL", "ERRLOG", "RC"))
    s.add_argument("--train", nargs=4, required=True, metavar=("BATCH", "JSONL", "LOG", "RC"))
    s.add_argument("--accuracy", nargs=2, required=True, metavar=("LOG", "RC"))
    s.add_argument("--goal", type=float, default=0.90)
    s.add_argument("--cut", type=int, default=0)
    s = sub.add_parser("train-step")
    s.add_argument("log"); s.add_argument("rc", type=int); s.add_argument("--cut", type=int, default=0)
    s = sub.add_parser("kernels")
    s.add_argument("log"); s.add_argument("rc", type=int); s.add_argument("arch"); s.add_argument("cut", type=int)
    s = sub.add_parser("syncbn")
    s.add_argument("bench_json"); s.add_argument("torch_jsonl")
    for name in ("table", "markdown", "verdict"):
        sub.add_parser(name).add_argument("tsv")
    a = p.parse_args(argv)
    if a.cmd == "test":
        judge_test(a.name, a.log, a.rc, a.limit, a.cut)
    elif a.cmd == "sanitizer":
        judge_sanitizer(a.tool, a.test, a.log, a.rc, a.limit, a.cut)
    elif a.cmd == "example":
        judge_example(a)
    elif a.cmd == "parity":
        judge_parity(a)
    elif a.cmd == "train":
        judge_train(a)
    elif a.cmd == "bf16":
        judge_bf16(a)
    elif a.cmd == "train-step":
        ARGS_CUT[0] = bool(a.cut)
        judge_train_step(a.log, a.rc)
    elif a.cmd == "kernels":
        judge_kernels(a.log, a.rc, a.arch, a.cut)
    elif a.cmd == "syncbn":
        judge_syncbn(a.bench_json, a.torch_jsonl)
    elif a.cmd == "table":
        print(table(a.tsv))
    elif a.cmd == "markdown":
        sys.stdout.write(markdown(a.tsv))
    elif a.cmd == "verdict":
        print(verdict(a.tsv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
