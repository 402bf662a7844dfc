"""Compile-only checks for the Hopper Gluon kernels (Gluon has no interpreter): compile a kernel for sm_90 on a
machine without a GPU and read what the compiler made of it.

    report = compile_report(kernel, args, grid, meta)   # PTX features, warps, shared memory, the compiled kernel
    report.update(ptxas_usage(report["kernel"].asm["ptx"]))   # registers, spills, wgmma serialization

A stub driver names the target while nothing is launched; Triton's wheel carries ptxas. Every Gluon kernel's
`compile_sm90` builds its own example arguments and calls these; CI runs them through the families' tests.
"""
from __future__ import annotations

import functools
import os
import re

SMEM_MAX = 232448  # sm_90's shared memory per block (227 KB)
PTX_FEATURES = {"wgmma": "wgmma.mma_async", "tma": "cp.async.bulk.tensor", "setmaxnreg": "setmaxnreg",
                "mbarrier": "mbarrier"}


def check_smem(kernel: str, need: int, config: str) -> None:
    """Refuse a configuration whose shared memory exceeds sm_90's per-block limit (a launch would fail later and
    less clearly): ValueError naming the kernel, the configuration and the bytes."""
    if need > SMEM_MAX:
        raise ValueError(f"{kernel}: {config} needs {need} B of shared memory (> {SMEM_MAX})")


def tma_addressable(t) -> bool:
    """A tensor a TMA descriptor can address as it is: 16-byte aligned base and strides, unit stride along the
    last dim."""
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]))


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block: tuple, dtype):
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


# Tritons whose Gluon TensorDescriptor.__post_init__ only validates (read in 3.6's source): there tma_descriptor may
# set the six fields itself; elsewhere it calls the constructor.
_DIRECT_DESCRIPTOR_VERSIONS = ("3.6",)


@functools.lru_cache(maxsize=None)
def _descriptor_class():
    """(Gluon's TensorDescriptor, whether this module may set its six fields directly)."""
    import dataclasses

    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    fields = tuple(f.name for f in dataclasses.fields(TensorDescriptor)) if dataclasses.is_dataclass(
        TensorDescriptor) else ()
    return TensorDescriptor, (triton.__version__.startswith(_DIRECT_DESCRIPTOR_VERSIONS)
                              and fields == ("base", "shape", "strides", "block_shape", "layout", "padding"))


def tma_descriptor(t, block, dtype):
    """A host TMA descriptor over t with [block] boxes in shared memory's default swizzled layout for dtype (a Gluon
    dtype). The layout is a pure function of (block, dtype) and costs ~5 us of Python to build: built once, where an
    eager call builds up to a dozen descriptors a launch. The descriptor's own checks (alignment, box sizes, dtype
    names; with them a descriptor took ~5 us of this 2-core CPU's Python, without ~1) are skipped where the class is
    the dataclass they run in: the callers' fits() checked the tensors with tma_addressable, and the boxes are the
    kernels' constants."""
    cls, direct = _descriptor_class()
    layout = _nvmma_layout(tuple(block), dtype)
    if not direct:
        return cls(t, list(t.shape), list(t.stride()), list(block), layout)
    desc = object.__new__(cls)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = (
        t, list(t.shape), list(t.stride()), list(block), layout, "zero")
    return desc


def builds(build, versions: tuple[str, ...]) -> bool:
    """The installed Triton is one of `versions` and the kernel's builder (its Gluon imports and definitions) runs:
    otherwise the caller takes its portable kernel."""
    import triton
    if not triton.__version__.startswith(versions):
        return False
    try:
        build()
    except Exception:  # noqa: BLE001 - any import / definition failure means: use the portable kernel
        return False
    return True


class StubTarget:
    """A stand-in driver for compiling without a GPU: it names the target and launches nothing."""

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_report(kernel, args, grid, meta, arch: int = 90) -> dict:
    """Compile `kernel[grid](*args, **meta)` for sm_<arch> under the stub driver: which PTX features it has
    (PTX_FEATURES), the setmaxnreg values, whether the TTGIR is warp-specialized, warps, shared memory, and the
    compiled kernel under "kernel"."""
    from triton.runtime.driver import driver
    previous = driver._active
    driver.set_active(StubTarget(arch))
    try:
        compiled = kernel.warmup(*args, grid=grid, **meta)
    finally:
        driver._active = previous
    ptx = compiled.asm.get("ptx", "")
    report = {name: tag in ptx for name, tag in PTX_FEATURES.items()}
    report["setmaxnreg_values"] = sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                          ptx)))
    report["warp_specialize"] = "ttg.warp_specialize" in compiled.asm.get("ttgir", "")
    report["num_warps"] = compiled.metadata.num_warps
    report["shared_bytes"] = compiled.metadata.shared
    report["kernel"] = compiled
    return report


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spill stores / loads, stack, and whether ptxas serialized the wgmma pipeline (its 'Potential
    Performance Loss' warning), from `ptxas -v` (Triton's ptxas) on the kernel's PTX."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    out = {"ptxas_rc": res.returncode, "ptxas_log": text.strip()}
    m = re.search(r"Used (\d+) registers", text)
    out["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    out["spill_stores"], out["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"(\d+) bytes stack frame", text)
    out["stack_bytes"] = int(m.group(1)) if m else None
    out["wgmma_serialized"] = "serialized" in text
    return out


def compile_in_subprocess(module: str, case: dict, root: str, timeout: int = 600) -> dict:
    """`module.compile_sm90(**case)` plus ptxas_usage, in a fresh interpreter (no TRITON_INTERPRET: the tests'
    process may have the interpreter on), returned as a JSON-able dict (the compiled kernel dropped). Also counts
    the wgmmas and those whose A operand is a register list."""
    import json
    import subprocess
    import sys
    code = ("import importlib, json, re, sys; from warpforge.ops import _gluon; "
            "m = importlib.import_module(sys.argv[1]); r = m.compile_sm90(**json.loads(sys.argv[2])); "
            "k = r.pop('kernel'); ptx = k.asm['ptx']; r.update(_gluon.ptxas_usage(ptx)); "
            r"r['wgmma_reg_a'] = len(re.findall(r'wgmma\.mma_async[^;]*\}, \{', ptx)); "
            "r['wgmma_count'] = ptx.count('wgmma.mma_async'); print('REPORT' + json.dumps(r))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    res = subprocess.run([sys.executable, "-c", code, module, json.dumps(case)], capture_output=True, text=True,
                         cwd=root, env=env, timeout=timeout)
    if res.returncode != 0:
        raise AssertionError(res.stderr[-4000:])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT"):])


def import_loads_gluon(modules: tuple[str, ...], root: str) -> bool:
    """Whether importing warpforge and `modules` in a fresh interpreter loads triton.experimental.gluon: the Gluon
    kernels build on first use, so `import warpforge` must not pay for Gluon (or fail where it is missing)."""
    import subprocess
    import sys
    code = ("import importlib, sys, warpforge; [importlib.import_module(m) for m in sys.argv[1:]]; "
            "print(any(m.startswith('triton.experimental.gluon') for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    if res.returncode != 0:
        raise AssertionError(res.stderr[-4000:])
    return res.stdout.strip() == "True"
