"""Debug: the persistent paged FP8 kernel against one program an item, per-page scales (mode 2)."""
import sys, torch

from tests.paged.test_paged_decode import _problem, _decode, _reference
from warpforge.ops.paged import configs, decode_gluon_kernel as dg
from warpforge.testing import cosine
torch.manual_seed(0)
for fmt, lens, page, splits in (("fp8-page", [1000, 37, 1], 16, None), ("fp8-page", [1000, 37, 1], 16, 1),
                                ("fp8", [1000, 37, 1], 16, None), ("fp8-page", [300, 129], 64, 1),
                                ("fp8-page", [1000, 300], 16, 1)):
    b = len(lens)
    p = _problem(b, 1, 32, 8, 128, page, lens, fmt, torch.bfloat16)
    orig = dg.persistent_ctas
    dg.persistent_ctas = lambda items, cfg, device, code=1: None
    out, lse = _decode(p, num_splits=splits)
    dg.persistent_ctas = lambda items, cfg, device, code=1: 1 if items > 1 else None
    out_p, lse_p = _decode(p, num_splits=splits)
    dg.persistent_ctas = orig
    ref, ref_lse = _reference(p)
    print(fmt, lens, page, splits)
    for i in range(b):
        d = (out_p[i].float() - out[i].float()).abs().amax(dim=-1).flatten()   # per head
        print(f"  req {i}: max|out_p - out| per head {[round(x, 4) for x in d.tolist()]}; lse diff "
              f"{(lse_p[i] - lse[i]).abs().amax().item():.3g}; 1-cos grid {1 - cosine(out[i:i+1], ref[i:i+1]):.2e} "
              f"persistent {1 - cosine(out_p[i:i+1], ref[i:i+1]):.2e}")
