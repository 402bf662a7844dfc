"""One Evoformer call (forward + backward) on a given shape with the chosen Gluon kernels on, against the
portable kernels: a smoke test for finding which kernel fails or hangs (run each under `timeout`).

    python scripts/evo_gluon_smoke.py B S R H D MASK(row|head|none) KERNELS(fwd,dkdv,dq)
"""
import os
import sys

import torch

B, S, R, H, D = (int(x) for x in sys.argv[1:6])
mask_kind, kernels = sys.argv[6], sys.argv[7].split(",")
import warpforge as wf  # noqa: E402
from warpforge.ops.evoformer import configs  # noqa: E402
from warpforge.testing import rel_l2  # noqa: E402

torch.manual_seed(0)
q, k, v, g = (torch.randn(B, S, R, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(4))
pair = torch.randn(B, 1, H, R, R, device="cuda", dtype=torch.bfloat16).requires_grad_()
biases = [pair]
if mask_kind != "none":
    keep = torch.rand(B, S, H if mask_kind == "head" else 1, 1, R, device="cuda") > 0.2
    keep[..., 0] = True
    biases.insert(0, torch.zeros(keep.shape, device="cuda").masked_fill(~keep, float("-inf")))
d_out = torch.randn_like(q)


def run(on):
    for name, env in (("fwd", configs.GLUON_FWD_ENV), ("dkdv", configs.GLUON_DKDV_ENV), ("dq", configs.GLUON_ENV)):
        os.environ[env] = "1" if on and name in kernels else "0"
    out = wf.evoformer_attention(q, k, v, biases, gate=g, backend="triton")
    res = (out, *torch.autograd.grad(out, [q, k, v, g, pair], d_out))
    torch.cuda.synchronize()
    return res


want, got = run(False), run(True)
print(" ".join(f"{n} {rel_l2(a, b):.1e}" for n, a, b in zip(["out", "dq", "dk", "dv", "dgate", "dpair"], got, want)),
      flush=True)
