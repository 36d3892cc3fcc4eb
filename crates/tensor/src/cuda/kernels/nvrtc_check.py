#!/usr/bin/env python3
"""Compile kernel files with NVRTC the way the Rust side does (crates/tensor/src/cuda/compile.rs):
prelude.cuh + common.cuh + the file, `-std=c++17`, once for sm_80 (A100) and once for sm_90a (H100,
H200: what the Rust side compiles for compute capability 9.0), and print NVRTC's log and the
kernels (`.entry`) each file exports. No GPU is needed.

Usage: python3 nvrtc_check.py [--arch 80,90a] [--strict] [--ptx-dir DIR] [--cubin-dir DIR] [files...]
(default: every *.cu in this folder). Prints ptxas's registers, shared memory and spills per
kernel (NVRTC passes `--ptxas-options=-v` on). Exits non-zero if any compilation fails; with
--strict also if a kernel spills, has a stack frame, its PTX uses local memory, or ptxas
serialises its wgmma products (C7513/C7519). (ptxas may spill a few bytes on purpose: it keeps
a kernel at 32 registers for occupancy.)

NVRTC is found through $NVRTC_LIB, else the pip wheel layout under /opt/cudawheels; headers
through $CUDA_INCLUDE_DIRS (colon-separated), else the wheel's include and include/cccl.
"""

import argparse
import ctypes
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WHEEL = "/opt/cudawheels/nvidia/cu13"


def load_nvrtc():
    candidates = [os.environ.get("NVRTC_LIB"), os.path.join(WHEEL, "lib", "libnvrtc.so.13"),
                  "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for c in candidates:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            pass
    sys.exit("nvrtc_check: libnvrtc not found (set NVRTC_LIB)")


def include_dirs():
    env = os.environ.get("CUDA_INCLUDE_DIRS")
    if env:
        return [d for d in env.split(":") if d]
    return [os.path.join(WHEEL, "include"), os.path.join(WHEEL, "include", "cccl")]


class Nvrtc:
    def __init__(self):
        self.lib = load_nvrtc()
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        L.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                         ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p]
        L.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_char_p)]
        for f in ("nvrtcGetProgramLogSize", "nvrtcGetPTXSize", "nvrtcGetCUBINSize"):
            getattr(L, f).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for f in ("nvrtcGetProgramLog", "nvrtcGetPTX", "nvrtcGetCUBIN"):
            getattr(L, f).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def version(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def _get(self, prog, size_fn, get_fn):
        size = ctypes.c_size_t()
        if getattr(self.lib, size_fn)(prog, ctypes.byref(size)) != 0 or size.value == 0:
            return b""
        buf = ctypes.create_string_buffer(size.value)
        getattr(self.lib, get_fn)(prog, buf)
        return buf.raw[: size.value]

    def compile(self, name, source, options):
        """(ok, log, ptx, cubin)"""
        prog = ctypes.c_void_p()
        rc = self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                         0, None, None)
        if rc != 0:
            return False, self.lib.nvrtcGetErrorString(rc).decode(), b"", b""
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
        log = self._get(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
        log = log.rstrip(b"\0").decode(errors="replace")
        ptx = cubin = b""
        if rc == 0:
            ptx = self._get(prog, "nvrtcGetPTXSize", "nvrtcGetPTX").rstrip(b"\0")
            cubin = self._get(prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")
        else:
            log = log or self.lib.nvrtcGetErrorString(rc).decode()
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log, ptx, cubin


def ptxas_summary(log):
    """[(kernel, "N regs[, S smem][, spills a/b][, stack c]")] from ptxas -v output."""
    out, kernel, props = [], None, {}
    def flush():
        if kernel is not None:
            text = f"{props.get('regs', '?')} regs"
            if props.get("smem"):
                text += f", {props['smem']} B smem"
            if props.get("spill", "0/0") != "0/0":
                text += f", spills {props['spill']} B"
            if props.get("stack", "0") != "0":
                text += f", stack {props['stack']} B"
            out.append((kernel, text))
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            flush()
            kernel, props = m.group(1), {}
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", line)
        if m:
            props["stack"] = m.group(1)
            props["spill"] = f"{m.group(2)}/{m.group(3)}"
        m = re.search(r"Used (\d+) registers", line)
        if m:
            props["regs"] = m.group(1)
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            props["smem"] = m.group(1)
    flush()
    return out


def full_source(name, text):
    """As compile.rs's full_source: prelude, common.cuh, then the file."""
    with open(os.path.join(HERE, "prelude.cuh")) as f:
        prelude = f.read()
    with open(os.path.join(HERE, "common.cuh")) as f:
        common = f.read()
    return f"{prelude}\n// ---- common.cuh\n{common}\n// ---- {name}\n{text}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--arch", default="80,90a", help="comma-separated SM versions")
    ap.add_argument("--ptx-dir", help="write <file>-sm<arch>.ptx here")
    ap.add_argument("--cubin-dir", help="write <file>-sm<arch>.cubin here")
    ap.add_argument("--strict", action="store_true",
                    help="also fail on register spills, stack frames or local memory in PTX")
    args = ap.parse_args()
    files = args.files or sorted(
        os.path.join(HERE, f) for f in os.listdir(HERE) if f.endswith(".cu"))
    nvrtc = Nvrtc()
    print(f"NVRTC {nvrtc.version()}")
    incs = include_dirs()
    failed = False
    for arch in args.arch.split(","):
        # Rust's options (compile.rs), plus ptxas -v for the register/spill summary (it
        # does not change the code).
        options = [f"--gpu-architecture=sm_{arch}", "-std=c++17"] + [
            f"--include-path={d}" for d in incs] + ["--ptxas-options=-v"]
        for path in files:
            name = os.path.basename(path)
            with open(path) as f:
                text = f.read()
            ok, log, ptx, cubin = nvrtc.compile(name, full_source(name, text), options)
            status = "ok" if ok else "FAILED"
            print(f"== {name} sm_{arch}: {status}")
            if not ok:
                print(log.rstrip())
                failed = True
                continue
            # ptxas -v lines become one summary line per kernel; anything else (warnings)
            # is printed as is.
            other = [l for l in log.splitlines() if l.strip() and not l.startswith("ptxas")]
            if other:
                print("\n".join(other))
            # Hopper's warpgroup products that ptxas had to serialise (C7513), or around
            # which it injected waits (C7519): correct, but the overlap they exist for is lost.
            serialised = [l for l in log.splitlines() if "(C7513)" in l or "(C7519)" in l]
            for line in serialised:
                print("   WARNING: " + line.split(":", 1)[-1].strip())
            if serialised and args.strict:
                failed = True
            for kernel, props in ptxas_summary(log):
                print(f"   {kernel}: {props}")
                if args.strict and ("spill" in props or "stack" in props):
                    failed = True
            ptx_text = ptx.decode(errors="replace")
            entries = re.findall(r"\.entry\s+(\w+)", ptx_text)
            print(f"   {len(entries)} kernels")
            # Local memory in a kernel: spilled registers or an array the compiler could not
            # keep in registers (a non-constant index, say).
            if "ld.local" in ptx_text or "st.local" in ptx_text:
                print("   WARNING: the PTX uses local memory (an array indexed at run time?)")
                failed = failed or args.strict
            cubin_name = f"{name}-sm{arch}"
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                with open(os.path.join(args.ptx_dir, cubin_name + ".ptx"), "wb") as f:
                    f.write(ptx)
            if args.cubin_dir:
                os.makedirs(args.cubin_dir, exist_ok=True)
                with open(os.path.join(args.cubin_dir, cubin_name + ".cubin"), "wb") as f:
                    f.write(cubin)
    print("nvrtc_check:", "FAILED" if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
