"""vLLM's `fused_moe` call on warpforge, and vLLM-style tuned tile files.

`fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, inplace=False, activation="silu", ...)` takes
vLLM's positional order and keywords (w1 [E, 2I, H] gate rows then up rows, w2 [E, H, I], as vLLM stores them)
and runs `warpforge.fused_moe` (or `moe.experts` after a custom_routing_function). FP8: use_fp8_w8a8=True with
float8_e4m3fn w1 / w2 and w1_scale / w2_scale, either per 128 x 128 block (block_shape=[128, 128], scales
[E, ceil(rows/128), ceil(cols/128)]) or one per expert (block_shape None, scales [E] or one element): the weights
are dequantised inside the GEMMs and the activations stay in hidden_states' dtype (warpforge's FP8 path is
weight-only, so a1_scale / a2_scale are refused rather than ignored).

Tuned tiles: WARPFORGE_MOE_CONFIG_DIR names a directory of JSON files named like vLLM's
(`get_config_file_name`: `E=8,N=14336,device_name=NVIDIA_H200.json`, with `,dtype=fp8_w8a8[,block_shape=[128,128]]`
for FP8 weights and `,dtype=float32` for fp32), each mapping token counts to {"BLOCK_SIZE_M", "BLOCK_SIZE_N",
"BLOCK_SIZE_K", "num_warps", "num_stages"} (GROUP_SIZE_M and other keys are ignored; one tile serves both GEMMs).
The directory is read at call time; each file once (cached), and the entry of the nearest token count is used, as
vLLM does. Where no file applies, the built-in table is used and one log line per file name says so. The files
serve every warpforge fused_moe call (warpforge.fused_moe too) once this module is imported: it installs the lookup
as warpforge.ops.moe.api.config_source, which forward, backward and fake tensors all consult.

Refused with a WarpforgeInputError naming the argument: activation other than "silu", use_int8_w8a8,
use_int8_w8a16, use_int4_w4a16, per_channel_quant, expert_map (expert parallel), global_num_experts other than
-1 / E, w1_zp / w2_zp, a1_scale / a2_scale, block_shape other than [128, 128].
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Optional

import torch

from ..errors import WarpforgeInputError, check_bool, check_dtype, check_int, check_same_device, check_tensor, fail
from ..ops.moe import api as moe_api
from ..ops.moe import configs as moe_configs
from ..ops.moe import experts as moe_experts
from ..ops.moe import fused_moe as wf_fused_moe

logger = logging.getLogger(__name__)
ENV = "WARPFORGE_MOE_CONFIG_DIR"
FP8_BLOCK = [128, 128]
_POW2 = (16, 32, 64, 128, 256)
_NOTED: set = set()


# --------------------------------------------------------------------------------------- tuned tiles
def device_name(device: torch.device) -> str:
    """vLLM's device part of a config file name: the CUDA name with '_' for ' ' ("NVIDIA_H200"); "cpu" for the
    Triton interpreter."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_")


def get_config_file_name(E: int, N: int, dtype: Optional[str] = None, block_shape=None,
                         device: Optional[torch.device] = None) -> str:
    """The file name vLLM gives a tuned config (N = the intermediate size I, w2.shape[2]); device: the current CUDA
    device by default."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    dtype_part = f",dtype={dtype}" if dtype else ""
    block_part = f",block_shape={list(block_shape)}".replace(" ", "") if block_shape and all(block_shape) else ""
    return f"E={E},N={N},device_name={device_name(device)}{dtype_part}{block_part}.json"


def _file_names(device: torch.device, w13: torch.Tensor) -> list[str]:
    e, n = w13.shape[0], w13.shape[1] // 2
    if w13.dtype == torch.float8_e4m3fn:  # warpforge's FP8 weights are always 128 x 128 blocks
        return [get_config_file_name(e, n, "fp8_w8a8", FP8_BLOCK, device),
                get_config_file_name(e, n, "fp8_w8a8", None, device)]
    return [get_config_file_name(e, n, "float32" if w13.dtype == torch.float32 else None, None, device)]


def _tile(path: str, key: str, entry) -> moe_configs.MoECfg:
    where = f"{path} [{key!r}]"
    if not isinstance(entry, dict):
        fail(where, "a config object", type(entry).__name__)
    sizes = []
    for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        value = entry.get(name)
        if value not in _POW2 or isinstance(value, bool):
            fail(f"{where}.{name}", f"one of {_POW2}", repr(value))
        sizes.append(value)
    warps, stages = entry.get("num_warps", 4), entry.get("num_stages", 3)
    if warps not in (1, 2, 4, 8, 16) or isinstance(warps, bool):
        fail(f"{where}.num_warps", "one of (1, 2, 4, 8, 16)", repr(warps))
    check_int(f"{where}.num_stages", stages, 1, 8)
    gemm = moe_configs.GemmTile(sizes[1], sizes[2], warps, stages)
    return moe_configs.MoECfg(sizes[0], gemm, gemm)


@functools.lru_cache(maxsize=256)
def _read(folder: str, name: str) -> Optional[dict]:
    """{token count: MoECfg} of folder/name, or None where there is no such file (a bad file raises, uncached)."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        fail(path, "a JSON object mapping token counts to tile configs", f"{type(e).__name__}: {e}")
    if not isinstance(data, dict):
        fail(path, "a JSON object mapping token counts to tile configs", type(data).__name__)
    # vLLM writes other top-level keys beside the token counts (triton_version)
    table = {int(key): _tile(path, key, entry) for key, entry in data.items() if key.strip().isdigit()}
    if not table:
        fail(path, "at least one token count (a key like \"16\") with its config", sorted(data)[:8])
    logger.info("warpforge: MoE tiles from %s", path)
    return table


def tuned_config(device: torch.device, tokens: int, w13: torch.Tensor) -> Optional[moe_configs.MoECfg]:
    """The tuned tile for this shape and token count from WARPFORGE_MOE_CONFIG_DIR (the nearest token count of the
    first file that exists), or None: the built-in table then serves, and one log line per file name says so."""
    folder = os.environ.get(ENV) or None
    names = _file_names(device, w13)
    if folder is not None:
        for name in names:
            table = _read(folder, name)
            if table is not None:
                return table[min(table, key=lambda m: (abs(m - tokens), m))]
    if (folder, names[0]) not in _NOTED:
        _NOTED.add((folder, names[0]))
        if folder is None:
            logger.info("warpforge: %s is not set; MoE tiles for %s from the built-in table", ENV, names[0])
        else:
            logger.warning("warpforge: no %s in %s (%s); MoE tiles from the built-in table", " or ".join(names),
                           folder, ENV)
    return None


def clear_config_cache() -> None:
    """Forget the files read and the log lines given (e.g. after rewriting a file)."""
    _read.cache_clear()
    _NOTED.clear()


moe_api.config_source = tuned_config


# ------------------------------------------------------------------------------------------- fused_moe
def _fp8_scales(name, scale, w, block_shape, ref):
    """A vLLM FP8 scale as warpforge's [E, ceil(rows/128), ceil(cols/128)] block scales."""
    if scale is None:
        fail(name, "fp32 scales for the FP8 weights (use_fp8_w8a8=True)", None)
    check_tensor(name, scale)
    check_dtype(name, scale, (torch.float32,))
    check_same_device(name, scale, "hidden_states", ref)
    e, rows, cols = w.shape
    blocks = (e, -(-rows // 128), -(-cols // 128))
    if block_shape is not None:
        return scale  # warpforge checks it is [E, rows/128, cols/128]
    if scale.numel() == 1:
        return scale.reshape(1, 1, 1).expand(blocks)
    if scale.numel() == e and (scale.dim() == 1 or tuple(scale.shape) == (e, 1, 1)):
        return scale.reshape(e, 1, 1).expand(blocks)
    fail(name, f"one scale per expert ([{e}] or one element) with block_shape None, or block scales {blocks} with "
         "block_shape=[128, 128]", f"shape {tuple(scale.shape)}")


# warpforge's argument names in its errors -> vLLM's
_NAMES = {"hidden": "hidden_states", "w13": "w1", "router_logits": "gating_output", "w_scales[0]": "w1_scale",
          "w_scales[1]": "w2_scale"}


def fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, inplace=False, activation="silu",
              use_grouped_topk=False, num_expert_group=None, topk_group=None, custom_routing_function=None,
              use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
              per_channel_quant=False, global_num_experts=-1, expert_map=None, w1_scale=None, w2_scale=None,
              w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None, block_shape=None):
    """vLLM's fused_moe: hidden_states [T, H], w1 [E, 2I, H], w2 [E, H, I], gating_output [T, E] (router logits,
    softmax routing; use_grouped_topk: DeepSeek's grouped top-k over num_expert_group groups) -> out [T, H] (written
    into hidden_states and returned with inplace=True)."""
    try:
        return _fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, inplace, activation,
                          use_grouped_topk, num_expert_group, topk_group, custom_routing_function, use_fp8_w8a8,
                          use_int8_w8a8, use_int8_w8a16, use_int4_w4a16, per_channel_quant, global_num_experts,
                          expert_map, w1_scale, w2_scale, w1_zp, w2_zp, a1_scale, a2_scale, block_shape)
    except WarpforgeInputError as e:
        head, sep, rest = str(e).partition(":")
        if head in _NAMES:
            raise WarpforgeInputError(_NAMES[head] + sep + rest) from None
        raise


def _fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, inplace, activation, use_grouped_topk,
               num_expert_group, topk_group, custom_routing_function, use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16,
               use_int4_w4a16, per_channel_quant, global_num_experts, expert_map, w1_scale, w2_scale, w1_zp, w2_zp,
               a1_scale, a2_scale, block_shape):
    if activation != "silu":
        fail("activation", "'silu' (warpforge's experts are SwiGLU)", repr(activation))
    for name, flag in (("use_int8_w8a8", use_int8_w8a8), ("use_int8_w8a16", use_int8_w8a16),
                       ("use_int4_w4a16", use_int4_w4a16), ("per_channel_quant", per_channel_quant)):
        check_bool(name, flag)
        if flag:
            fail(name, "False (warpforge's quantised experts are FP8 with 128 x 128 block or per-expert scales: "
                 "use_fp8_w8a8)", True)
    for name, value in (("expert_map", expert_map), ("w1_zp", w1_zp), ("w2_zp", w2_zp)):
        if value is not None:
            fail(name, "None (not supported by warpforge yet)", "a tensor")
    for name, value in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if value is not None:
            fail(name, "None (warpforge's FP8 experts keep the activations in hidden_states' dtype: static "
                 "activation scales would go unused)", "a tensor")
    for name, flag in (("inplace", inplace), ("use_grouped_topk", use_grouped_topk), ("use_fp8_w8a8", use_fp8_w8a8),
                       ("renormalize", renormalize)):
        check_bool(name, flag)
    check_tensor("w1", w1)
    check_tensor("hidden_states", hidden_states)
    if w1.dim() == 3 and global_num_experts not in (-1, w1.shape[0]):
        fail("global_num_experts", f"-1 or the experts of w1 ({w1.shape[0]}): no expert parallelism",
             repr(global_num_experts))
    w_format, w_scales = "bf16", None
    if use_fp8_w8a8:
        if block_shape is not None and list(block_shape) != FP8_BLOCK:
            fail("block_shape", f"None or {FP8_BLOCK} (warpforge's FP8 weight blocks)", repr(block_shape))
        check_tensor("w2", w2)
        if w1.dim() != 3 or w2.dim() != 3:
            bad = "w1" if w1.dim() != 3 else "w2"
            fail(bad, "a 3-d expert weight", f"shape {tuple((w1 if bad == 'w1' else w2).shape)}")
        w_format = "fp8"
        w_scales = (_fp8_scales("w1_scale", w1_scale, w1, block_shape, hidden_states),
                    _fp8_scales("w2_scale", w2_scale, w2, block_shape, hidden_states))
    else:
        for name, value in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("block_shape", block_shape)):
            if value is not None:
                fail(name, "None unless use_fp8_w8a8=True", type(value).__name__)
    if custom_routing_function is not None:
        if not callable(custom_routing_function):
            fail("custom_routing_function", "None or a callable (hidden, logits, topk, renormalize) -> (weights, ids)",
                 type(custom_routing_function).__name__)
        weights, ids = custom_routing_function(hidden_states, gating_output, topk, renormalize)
        out = moe_experts(hidden_states, w1, w2, weights, ids, w_format=w_format, w_scales=w_scales)
    else:
        if use_grouped_topk and (num_expert_group is None or topk_group is None):
            fail("num_expert_group" if num_expert_group is None else "topk_group",
                 "an int with use_grouped_topk=True", None)
        groups = dict(num_expert_group=num_expert_group, topk_group=topk_group) if use_grouped_topk else {}
        out = wf_fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize=renormalize, w_format=w_format,
                           w_scales=w_scales, **groups)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out


__all__ = ["fused_moe", "get_config_file_name", "tuned_config", "clear_config_cache", "device_name"]
