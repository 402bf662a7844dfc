"""The Hopper-pipeline kernels, compiled for sm_90 on this machine (no GPU: Triton's wheel carries ptxas), must be
what they claim: warp-specialized (a TMA producer and consumer warpgroups, setmaxnreg), on wgmma and TMA. Their
numbers are checked by the interpreter tests here and by the GPU tests on the H200."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_warp_specialized_forward_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--family", "attention_ws"],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if "flash_fwd_ws_kernel" in line]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-2000:]
    for line in lines:
        assert "warps 12" in line and "warp-specialized" in line and "spills 0/0" in line, line
        assert all(f"'{feat}'" in line for feat in ("wgmma", "tma", "setmaxnreg")), line


def test_fp8_forward_compiles_to_fp8_mmas_for_sm90():
    """Q·Kᵀ and P·V on e4m3 wgmma (QGMMA), INT8 Q·Kᵀ on s8 wgmma, without spills at the table's tiles for head dims
    up to 128 (d 256 spills a few bytes on some Triton versions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--family", "attention_fp8"],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if "flash_fp8_fwd_kernel" in line]
    # compile_sm90's cases: d 64 single code, d 128 e4m3 defaults, d 128 single code, d 128 int8, d 256 defaults
    assert run.returncode == 0 and len(lines) == 5, run.stdout[-2000:] + run.stderr[-2000:]
    assert "quantize_rows_kernel" in run.stdout and "quantize_v_kernel" in run.stdout
    assert "quantize_key_blocks_kernel" in run.stdout
    for line in lines:
        assert "'e4m3 mma'" in line, line
    for line in lines[:4]:
        assert "spills 0/0" in line, line
    assert "'s8 mma'" in lines[3], lines[3]
