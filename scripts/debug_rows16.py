"""Debug: TMA one 32-row step into the rows16 kernel's shared-memory views and store what each view's load sees."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from warpforge.ops.mla import decode_rows16_gluon_kernel as d16

mma, every, a, bl, lk, lv, smem, smem_tma, smem_rope, smem_s = d16._layouts(gl)


@gluon.jit
def views(kn_desc, kr_desc, ks_desc, OUT_K, OUT_S, OUT_R, MMA: gl.constexpr, B: gl.constexpr, LK: gl.constexpr,
          SMEM: gl.constexpr, SMEM_TMA: gl.constexpr, SMEM_ROPE: gl.constexpr, SMEM_S: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.uint8, [1, 32, 4, 128], SMEM_TMA)
    r_tma = gl.allocate_shared_memory(gl.bfloat16, [1, 32, 64], SMEM_ROPE)
    s_tma = gl.allocate_shared_memory(gl.float32, [1, 32, 4], SMEM_S)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), 20992)
    tma.async_copy_global_to_shared(kn_desc, [0, 0, 0], bar.index(0), ring.index(0))
    tma.async_copy_global_to_shared(kr_desc, [0, 264], bar.index(0), r_tma.index(0))
    tma.async_copy_global_to_shared(ks_desc, [0, 128], bar.index(0), s_tma.index(0))
    mbarrier.wait(bar.index(0), 0)
    k = gl.permute(ring.index(0).load(LK), [1, 0, 2])       # [4, 32, 128] (w, t, c)
    KL: gl.constexpr = k.type.layout
    w_ = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, KL)))
    t_ = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, KL)))
    c_ = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, KL)))
    gl.store(OUT_K + w_[:, None, None] * 4096 + t_[None, :, None] * 128 + c_[None, None, :], k)
    SL: gl.constexpr = gl.SliceLayout(1, MMA)
    SCT: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0]], lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 1], [0, 2]], block_bases=[], shape=[32, 4])
    sc = gl.convert_layout(gl.permute(s_tma.index(0).load(SCT), [1, 0]), SL, assert_trivial=True)   # [4, 32]
    ws = gl.arange(0, 4, layout=gl.SliceLayout(1, SL))
    ts = gl.arange(0, 32, layout=gl.SliceLayout(0, SL))
    gl.store(OUT_S + ws[:, None] * 32 + ts[None, :], sc)
    r = r_tma.index(0).reshape([32, 4, 16]).permute([1, 2, 0]).load(B)   # [4, 16, 32] (w, d, t)
    BL: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [4, 1, 1], [2, 1, 0])
    r = gl.convert_layout(r, BL)
    wr = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
    dr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
    tr = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
    gl.store(OUT_R + wr[:, None, None] * 512 + dr[None, :, None] * 32 + tr[None, None, :], r)


def main():
    cache = torch.randint(0, 120, (2, 64, 1, 656), dtype=torch.uint8, device="cuda")
    kn, kr, ks = d16._descriptors(cache, (smem, smem_tma, smem_rope, smem_s))
    out_k = torch.zeros(4, 32, 128, dtype=torch.uint8, device="cuda")
    out_s = torch.zeros(4, 32, dtype=torch.float32, device="cuda")
    out_r = torch.zeros(4, 16, 32, dtype=torch.bfloat16, device="cuda")
    views[(1,)](kn, kr, ks, out_k, out_s, out_r, mma, bl, lk, smem, smem_tma, smem_rope, smem_s, num_warps=4)
    torch.cuda.synchronize()
    rows = cache.view(-1, 656)[:32]
    want_k = rows[:, :512].reshape(32, 4, 128).permute(1, 0, 2)
    want_s = rows[:, 512:528].contiguous().view(torch.float32).t()
    want_r = rows[:, 528:].contiguous().view(torch.bfloat16).reshape(32, 4, 16).permute(1, 2, 0)
    for name, got, want in (("latent", out_k, want_k), ("scales", out_s, want_s), ("rope", out_r, want_r)):
        same = got == want
        print(name, "equal" if same.all() else f"DIFFER at {(~same).sum().item()} of {same.numel()}", flush=True)
        if not same.all():
            idx = (~same).nonzero()[:6].tolist()
            print("  first:", idx, [got[tuple(i)].item() for i in idx], [want[tuple(i)].item() for i in idx])
            if name == "latent":   # where do the values come from?
                for i in idx[:3]:
                    v = got[tuple(i)].item()
                    print("   value", v, "found at (w,t,c):", (want == v).nonzero()[:4].tolist())


if __name__ == "__main__":
    main()
