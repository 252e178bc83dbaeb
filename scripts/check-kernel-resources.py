#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The static gate of lockstep's CUDA kernels (CTest label `cuda-static`).

Reads what ptxas printed under `nvcc --resource-usage` (on stderr, one block per kernel and
architecture) and the PTX of the same translation unit, and checks for every kernel on every
architecture:
  - no local memory: stack frame, cumulative stack size and lmem 0, no spill stores or loads;
  - registers within the budget of the kernel's launch bounds: `__launch_bounds__(T, B)` becomes
    `.maxntid T` and `.minnctapersm B` in the PTX, and B blocks of T threads fit on a
    multiprocessor (65536 registers) only if each thread has at most
    min(255, floor(65536 / (T * B)) rounded down to a multiple of 8) registers;
  - a `__launch_bounds__` at all (a kernel without one has no occupancy to keep);
  - vector accesses where a kernel has a vector width: the width V is an `int` template argument
    of the kernel's body (`map_kernel<bn_kernels::NormalizeChannelsFirst<float, 4>>`,
    `map_kernel<layer_kernels::ChannelMajor<4, float, float>>`), read from the mangled name
    (`Li4E`; no body has another `int` argument, and a `bool` one mangles as `Lb`). A kernel with
    V > 1 reads and writes its tensors in packs of V elements (`load_pack`, `store_pack`), each of
    which must be one instruction. In its PTX, for every architecture:
      - a kernel with any global load has at least one pack load, `ld.global[...].v2/.v4/.v8`;
      - a map kernel (`map_kernel<...>`: it writes its output in packs) has at least one pack
        store, `st.global[...].v2/.v4/.v8`. A reducing kernel stores only its per-block partials
        and per-channel results, which are no packs, so only its loads are checked.
    A pack of two 16-bit values (V = 2 and a `__half` or `__nv_bfloat16` argument: 4 bytes) is
    `.v2.u16` in PTX for sm_75 to sm_90 but one `.u32` for sm_100 on, so a 32-bit integer access
    (`.u32`, `.b32`, `.s32`) counts as its pack access too. In the PTX for sm_90, where their
    packs are `.v2.u16`, these kernels load no 32-bit integer, and store one only in a reducing
    kernel (its ticket counter, whose stores are not checked).
    A pack split into element accesses is V times the memory instructions, and the compiler
    does that silently (the channels-first SyncBatchNorm passes once stored no vector at all).
Prints a table (architecture, registers, budget, shared memory, local memory, vector width,
vector stores / loads in the PTX, kernel) and exits non-zero on any violation; a gate that finds
no kernel at all fails.

Usage:
  check-kernel-resources.py --resource-usage STDERR.txt --ptx A.compute_75.ptx [--ptx ...]
                            [--expect-arch sm_75 ...]
(`-` reads the resource usage from stdin). The PTX of each architecture is matched by its
`.target`; where an architecture has no PTX of its own, the launch bounds of any given PTX are
used (they do not depend on the architecture).

ptxas's format (CUDA 13; older releases print `N bytes lmem` on the `Used` line instead):
  ptxas info    : Compiling entry function '_Z...' for 'sm_90'
  ptxas info    : Function properties for _Z...
      0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
  ptxas info    : Used 64 registers, used 1 barriers, 4097 bytes smem, 456 bytes cmem[0]
"""

import argparse
import re
import shutil
import subprocess
import sys

REGISTER_FILE = 65536  # 32-bit registers per multiprocessor, sm_50 to sm_120
MAX_REGISTERS = 255  # per thread
GRANULE = 8  # registers per thread are allocated in multiples of 8 (256 per warp)

ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
PROPS_RE = re.compile(r"Function properties for (\S+)")
FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED_RE = re.compile(r"ptxas info\s*: Used (\d+) registers")
BYTES_RE = re.compile(r"(\d+) bytes ([A-Za-z_]+(?:\[\d+\])?)")
STACK_RE = re.compile(r"(\d+) bytes cumulative stack size")
ERROR_RE = re.compile(r"ptxas (?:error|fatal)\s*:(.*)")


class Kernel:
    def __init__(self, name, arch):
        self.name, self.arch = name, arch
        self.registers = None
        self.smem = 0
        self.lmem = 0  # the largest of every local-memory figure ptxas gives (stack frame, lmem)
        self.spill_stores = self.spill_loads = 0

    def local_memory(self, n):
        self.lmem = max(self.lmem, n)


def parse_resource_usage(text):
    """The kernels of each architecture, in the order ptxas compiled them, and ptxas's errors."""
    kernels, errors = [], []
    current = None  # the entry whose block we are in
    props_for = None  # the function the next "stack frame" line belongs to
    others = {}  # non-entry functions with a frame of their own: (name, arch) -> Kernel
    arch = None
    for line in text.splitlines():
        m = ENTRY_RE.search(line)
        if m:
            current = Kernel(m.group(1), m.group(2))
            arch = current.arch
            kernels.append(current)
            props_for = None
            continue
        m = PROPS_RE.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = FRAME_RE.search(line)
        if m and props_for is not None:
            frame, stores, loads = (int(g) for g in m.groups())
            if current is not None and props_for == current.name:
                target = current
            else:  # a device function compiled on its own (not inlined)
                target = others.setdefault((props_for, arch), Kernel(props_for, arch or "?"))
            target.local_memory(frame)
            target.spill_stores = max(target.spill_stores, stores)
            target.spill_loads = max(target.spill_loads, loads)
            props_for = None
            continue
        m = USED_RE.search(line)
        if m and current is not None:
            current.registers = int(m.group(1))
            for n, what in BYTES_RE.findall(line):
                if what == "smem":
                    current.smem = int(n)
                elif what == "lmem":
                    current.local_memory(int(n))
            s = STACK_RE.search(line)
            if s:
                current.local_memory(int(s.group(1)))
            continue
        m = ERROR_RE.search(line)
        if m:
            errors.append(m.group(1).strip())
    functions = [f for f in others.values() if f.lmem or f.spill_stores or f.spill_loads]
    return kernels, functions, errors


PTX_TARGET_RE = re.compile(r"^\s*\.target\s+(\w+)", re.M)
PTX_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(")
PTX_DIRECTIVE_RE = re.compile(r"\.(maxntid|reqntid|minnctapersm|maxnreg)\s+([\d\s,]+)")


# Global loads and stores, and the vector ones among them (`st.global.v4.f32`, `ld.global.nc.v2.u32`,
# `st.global.L1::no_allocate.v4.b32`): the qualifiers sit between `.global` and `.vN`.
PTX_LD_RE = re.compile(r"\bld\.global\b")
PTX_ST_RE = re.compile(r"\bst\.global\b")
PTX_VLD_RE = re.compile(r"\bld\.global[\w.:]*?\.v[248]\.")
PTX_VST_RE = re.compile(r"\bst\.global[\w.:]*?\.v[248]\.")
PTX_WLD_RE = re.compile(r"\bld\.global[\w.:]*?\.[bus]32\b")  # a 32-bit integer (a 16-bit pair, sm_100 on)
PTX_WST_RE = re.compile(r"\bst\.global[\w.:]*?\.[bus]32\b")
WIDTH_RE = re.compile(r"Li(\d+)E")  # an int template argument in an Itanium mangled name
HALF_RE = re.compile(r"6__half|13__nv_bfloat16")  # a 16-bit type argument


class Access:
    """A kernel's global memory instructions in the PTX."""

    def __init__(self, body):
        self.loads, self.stores = len(PTX_LD_RE.findall(body)), len(PTX_ST_RE.findall(body))
        self.vector_loads, self.vector_stores = len(PTX_VLD_RE.findall(body)), len(PTX_VST_RE.findall(body))
        self.word_loads, self.word_stores = len(PTX_WLD_RE.findall(body)), len(PTX_WST_RE.findall(body))


def body_of(text, start):
    """The text of the `{ ... }` block that opens at or after `start` (braces nest in PTX)."""
    i = text.find("{", start)
    if i < 0:
        return ""
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i: j + 1]
    return text[i:]


def vector_width(mangled):
    """The kernel's vector width: the largest int template argument in its name, 1 without one."""
    return max((int(v) for v in WIDTH_RE.findall(mangled)), default=1)


def is_map_kernel(mangled):
    return re.search(r"\d+map_kernelI", mangled) is not None


def pack_accesses(mangled, a):
    """(loads, stores) of `a` that may be the kernel's packs (see the module's docstring)."""
    if vector_width(mangled) == 2 and HALF_RE.search(mangled):
        return a.vector_loads + a.word_loads, a.vector_stores + a.word_stores
    return a.vector_loads, a.vector_stores


def parse_ptx(text):
    """(architecture, {entry: (threads or None, min blocks, maxnreg or None)}, {entry: Access})
    of one PTX file."""
    t = PTX_TARGET_RE.search(text)
    arch = t.group(1) if t else None
    bounds, access = {}, {}
    entries = list(PTX_ENTRY_RE.finditer(text))
    for i, m in enumerate(entries):
        # The performance directives sit between the parameter list and the body's `{`.
        end = entries[i + 1].start() if i + 1 < len(entries) else len(text)
        body = text.find("{", m.end())
        header = text[m.end(): body if 0 <= body < end else end]
        access[m.group(1)] = Access(body_of(text, body) if 0 <= body < end else "")
        threads, blocks, maxnreg = None, 1, None
        for d, values in PTX_DIRECTIVE_RE.findall(header):
            nums = [int(v) for v in re.findall(r"\d+", values)]
            if d in ("maxntid", "reqntid"):
                threads = 1
                for v in nums:
                    threads *= v
            elif d == "minnctapersm":
                blocks = max(1, nums[0])
            elif d == "maxnreg":
                maxnreg = nums[0]
        bounds[m.group(1)] = (threads, blocks, maxnreg)
    return arch, bounds, access


def vector_violations(arch, access):
    """What the PTX of `arch` lacks in vector accesses (see the module's docstring), by kernel."""
    out = {}
    for name, a in access.items():
        v = vector_width(name)
        if v <= 1:
            continue
        why = []
        pack_loads, pack_stores = pack_accesses(name, a)
        pair = ", or .u32 for a 16-bit pair" if v == 2 and HALF_RE.search(name) else ""
        if a.loads and not pack_loads:
            why.append(f"width {v} but no vector global load (ld.global.v*{pair}) among its {a.loads} global "
                       f"loads: its packs are read element by element")
        if is_map_kernel(name) and not pack_stores:
            why.append(f"width {v} but no vector global store (st.global.v*{pair}) among its {a.stores} global "
                       f"stores: its packs are written element by element")
        if why:
            out[name] = why
    return out


def budget_of(threads, blocks, maxnreg):
    """Registers a thread may use so that `blocks` blocks of `threads` fit on a multiprocessor."""
    b = min(MAX_REGISTERS, REGISTER_FILE // (threads * blocks) // GRANULE * GRANULE)
    if maxnreg is not None:
        b = min(b, maxnreg)
    return b


def shorten(demangled):
    """`void lockstep::kernels::device::map_kernel<bn_kernels::X<float, 4> >(...::Params)` ->
    `map_kernel<bn_kernels::X<float, 4> >`: the kernels' namespace, return type and parameters
    say nothing the template arguments do not."""
    s = demangled
    if s.startswith("void "):
        s = s[len("void "):]
    if s.endswith(")"):  # drop the parameter list: the last top-level parenthesis
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i]
                break
    return s.replace("lockstep::kernels::device::", "").replace("lockstep::kernels::", "")


def demangle(names):
    """Mangled name -> a short readable one (c++filt where there is one)."""
    tool = shutil.which("c++filt")
    out = {n: n for n in names}
    if tool and names:
        try:
            text = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True,
                                  check=True).stdout
            lines = text.splitlines()
            if len(lines) == len(names):
                out = {n: shorten(d) for n, d in zip(names, lines)}
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resource-usage", required=True, help="nvcc --resource-usage stderr ('-': stdin)")
    ap.add_argument("--ptx", action="append", default=[], help="PTX of the same translation unit (repeatable)")
    ap.add_argument("--expect-arch", action="append", default=[], metavar="sm_XX",
                    help="fail unless kernels were compiled for this architecture (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="print only the violations")
    args = ap.parse_args(argv)

    if args.resource_usage == "-":
        usage = sys.stdin.read()
    else:
        with open(args.resource_usage, encoding="utf-8", errors="replace") as f:
            usage = f.read()
    kernels, functions, ptxas_errors = parse_resource_usage(usage)

    bounds_by_arch, any_bounds, access_by_arch = {}, {}, {}
    for path in args.ptx:
        with open(path, encoding="utf-8", errors="replace") as f:
            arch, bounds, access = parse_ptx(f.read())
        bounds_by_arch.setdefault(arch, {}).update(bounds)
        any_bounds.update(bounds)
        access_by_arch.setdefault(arch, {}).update(access)

    violations = []
    for e in ptxas_errors:
        violations.append(f"ptxas: {e}")
    if not kernels:
        violations.append("no kernel found in the resource usage: a gate that checks nothing fails "
                          "(was nvcc run with --resource-usage, and does the translation unit instantiate kernels?)")
    for arch in args.expect_arch:
        if kernels and not any(k.arch == arch for k in kernels):
            violations.append(f"no kernel compiled for {arch}, which the gate checks (--expect-arch)")
    if not args.ptx:
        violations.append("no PTX given (--ptx): the launch bounds, and so the register budgets, are unknown")

    ptx_names = {n for access in access_by_arch.values() for n in access}
    names = demangle(sorted({k.name for k in kernels} | {f.name for f in functions} | ptx_names))
    vector_checked = set()
    for arch, access in sorted(access_by_arch.items(), key=lambda a: str(a[0])):
        for name, why in vector_violations(arch, access).items():
            violations.extend(f"{arch} {names[name]}: {w}" for w in why)
        vector_checked |= {(arch, n) for n in access if vector_width(n) > 1}
    rows = []
    for k in kernels:
        b = bounds_by_arch.get(k.arch, {}).get(k.name) or any_bounds.get(k.name)
        label = f"{k.arch} {names[k.name]}"
        budget = None
        if b is None:
            if args.ptx:
                violations.append(f"{label}: not in the PTX, so its launch bounds are unknown")
        elif b[0] is None:
            violations.append(f"{label}: no __launch_bounds__ (no .maxntid in the PTX), so no register budget")
        else:
            budget = budget_of(*b)
        if k.registers is None:
            violations.append(f"{label}: ptxas printed no 'Used N registers' line for it")
        elif budget is not None and k.registers > budget:
            violations.append(f"{label}: {k.registers} registers, over the budget of {budget} for "
                              f"__launch_bounds__({b[0]}, {b[1]}) (65536 / ({b[0]} x {b[1]}), in multiples of 8)")
        if k.lmem:
            violations.append(f"{label}: {k.lmem} bytes of local memory (stack frame), must be 0")
        if k.spill_stores or k.spill_loads:
            violations.append(f"{label}: spills registers to local memory ({k.spill_stores} bytes of spill stores, "
                              f"{k.spill_loads} bytes of spill loads)")
        a = access_by_arch.get(k.arch, {}).get(k.name)
        width = vector_width(k.name)
        vectors = "-" if a is None or width == 1 else "{1}/{0}".format(*pack_accesses(k.name, a))
        rows.append((k.arch, "?" if k.registers is None else str(k.registers),
                     "?" if budget is None else str(budget), str(k.smem), str(k.lmem), str(width), vectors,
                     names[k.name]))
    for f in functions:
        violations.append(f"{f.arch} {names[f.name]} (device function): {f.lmem} bytes of local memory, "
                          f"{f.spill_stores} bytes of spill stores, {f.spill_loads} of spill loads, must be 0")

    if not args.quiet and rows:
        head = ("arch", "regs", "budget", "smem", "lmem", "V", "vst/vld", "kernel")
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(7)]
        fmt = "{:<%d}  {:>%d}  {:>%d}  {:>%d}  {:>%d}  {:>%d}  {:>%d}  {}" % tuple(widths)
        print(fmt.format(*head))
        for r in sorted(rows, key=lambda r: (r[0], r[7])):
            print(fmt.format(*r))
        archs = sorted({k.arch for k in kernels})
        print(f"{len({k.name for k in kernels})} kernels x {len(archs)} architectures ({', '.join(archs)}): "
              f"{len(rows)} checked; {len(vector_checked)} of width > 1 checked for vector accesses in the PTX")
    if violations:
        print(f"\nFAILED: {len(violations)} violation(s) of the kernels' static gate:", file=sys.stderr)
        for v in violations:
            print(f"  {v}", file=sys.stderr)
        return 1
    print("OK: no local memory, every kernel within its launch bounds' register budget, "
          "every kernel of width > 1 with vector accesses")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
