import torch, sys
sys.path.insert(0, ".")
import warpforge as wf
from warpforge.ops.mla import decode_rows16_gluon_kernel as d16, mla_decode_reference
from tests.mla.test_mla_decode import _problem
from tests.mla.test_mla_rows16 import _poison_past_the_ends, LENS
torch.manual_seed(0)
for poison in (False, True):
    for page in (64, 16):
        q, _, cache, table, seqlens, _ = _problem(len(LENS), 1, 16, page, LENS, "fp8", torch.bfloat16)
        if poison:
            _poison_past_the_ends(cache, table, LENS)
        ref, ref_lse = mla_decode_reference(q.float(), cache, table, seqlens, kv_format="fp8")
        for splits in (1, 3):
            out, lse = d16.mla_decode_rows16_gluon(q, cache, table, seqlens, 576 ** -0.5, False, splits, 3)
            torch.cuda.synchronize()
            bad = [(i, int((~torch.isfinite(out[i])).sum()), float((out[i].float() - ref[i]).abs().max()),
                    float((lse[i] - ref_lse[i]).abs().max())) for i in range(len(LENS))]
            print(f"poison {poison} page {page} splits {splits}:", bad, flush=True)
