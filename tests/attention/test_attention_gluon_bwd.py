"""The Hopper Gluon backward of flash_attention (ops/attention/flash_gluon_bwd_kernel.py): its mbarrier protocol checked
by a random-interleaving model of the three partitions, compiled for sm_90 on CPU when the installed Triton is one its
Gluon API was written for, and checked against the reference gradients on an sm_90 GPU (forced on with
WARPFORGE_ATTN_GLUON_BWD=1 while configs.GLUON_BWD_DEFAULT is off)."""
import itertools
import math
import os
import random

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import compile_in_subprocess, import_loads_gluon
from warpforge.ops.attention import api, attention_reference, configs
from warpforge.ops.attention import flash_gluon_bwd_kernel as fb
from warpforge.ops.attention import flash_gluon_kernel as fg
from warpforge.testing import (assert_qkv_grads_close, gluon_triton, on_sm90_gluon, poisoned_outputs, rel_l2,
                               spy_launches, triton_version)

KNOB_ENV = ("WARPFORGE_ATTN_GLUON_BWD_BLOCK_M", "WARPFORGE_ATTN_GLUON_BWD_STAGES", "WARPFORGE_ATTN_GLUON_BWD_DQ_N",
            "WARPFORGE_ATTN_GLUON_BWD_DQ_SPLIT", "WARPFORGE_ATTN_GLUON_BWD_DQ_TMA", "WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gluon_triton() -> bool:
    return gluon_triton(fb.GLUON_TRITON_VERSIONS)


def _on_h200() -> bool:
    return on_sm90_gluon(fb.GLUON_TRITON_VERSIONS)


def test_gate_constants_agree_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == fb.GLUON_TRITON_VERSIONS
    assert isinstance(configs.GLUON_BWD_DEFAULT, bool)  # on since session 11's H200 run (benchmarks/NOTES.md)
    for (d, _), (block_m, stages, dq_n, split, tma) in configs.GLUON_BWD.items():
        assert d in fb.HEAD_DIMS and block_m in (64, 128) and stages >= 2 and dq_n <= 64 and d % dq_n == 0
        assert fb.smem_bytes(d, block_m, stages, d // 2 if split else dq_n, split, tma) <= fg.SMEM_MAX
    # importing warpforge (and the kernel module) does not load Gluon: it is built on first use
    assert not import_loads_gluon(("warpforge.ops.attention.flash_gluon_bwd_kernel",), ROOT)


def test_gate_off_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    big = 1 << 30
    assert not api.gluon_bwd_gate(q, q, q, q, q, big, 0, False)  # a CPU tensor
    monkeypatch.setattr(api, "arch_key", lambda device: "sm90")
    assert not api.gluon_bwd_gate(q, q, q, q, q, big, big, False)  # still a CPU tensor
    assert not api.gluon_bwd_gate(q, q, q, q, q, big, 0, True)  # deterministic: never the atomic dq


def test_switch_reads_its_own_variable(monkeypatch):
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
    assert not api._gluon_bwd_switch()
    monkeypatch.delenv(configs.GLUON_BWD_ENV)
    assert api._gluon_bwd_switch() is (configs.GLUON_BWD_DEFAULT and _gluon_triton())
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
    assert api._gluon_bwd_switch() is _gluon_triton()


def test_knobs_come_from_the_table_and_the_environment(monkeypatch):
    for name in KNOB_ENV:
        monkeypatch.delenv(name, raising=False)
    assert api.gluon_bwd_knobs(128, True) == configs.GLUON_BWD[(128, True)]
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_BLOCK_M", "128")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_STAGES", "3")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_DQ_N", "32")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_DQ_SPLIT", "1")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_DQ_TMA", "1")
    assert api.gluon_bwd_knobs(64, False) == (128, 3, 32, True, True)


def test_key_rows_knob_from_the_table_and_the_environment(monkeypatch):
    """KEY_ROWS: the table's value where the knobs take it (BLOCK_M 64, DQ_SPLIT, DQ_TMA), 0 where not; the variable
    replaces it, and a value other than 0, 1, 2 is refused by name."""
    monkeypatch.delenv("WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS", raising=False)
    assert api.gluon_bwd_key_rows(64, 3, 64, True, True) == configs.GLUON_BWD_KEY_ROWS
    assert api.gluon_bwd_key_rows(64, 4, 64, False, True) == 0
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS", "1")
    assert api.gluon_bwd_key_rows(64, 3, 64, True, True) == 1
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS", "on")
    with pytest.raises(ValueError, match="WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS takes 0, 1 or 2"):
        api.gluon_bwd_key_rows(64, 3, 64, True, True)


def test_bad_knobs_are_refused():
    def args(d, block_m, stages, dq_n=None):
        q = torch.empty(1, 1, 1, d)
        return (q, q, q, q, None, None, None, None, None, block_m, 1.0, False, block_m, stages, dq_n)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        fb.launch_args(*args(64, 64, 1))
    with pytest.raises(ValueError, match="BLOCK_M"):
        fb.launch_args(*args(64, 96, 2))
    with pytest.raises(ValueError, match="shared memory"):
        fb.launch_args(*args(128, 128, 3))
    with pytest.raises(ValueError, match="column chunk"):
        fb.launch_args(*args(128, 64, 2, 128))
    with pytest.raises(ValueError, match="shared memory"):  # DQ_TMA's staging tiles count: 64 KB at d 128
        fb.launch_args(*args(128, 64, 3), dq_tma=True)
    q, k = torch.empty(2, 8, 4, 64), torch.empty(2, 8, 2, 64)  # 2 · 2 = 4 kv-head slices
    with pytest.raises(ValueError, match="head_group must divide"):
        fb.launch_args(q, k, k, q, None, None, None, None, None, 64, 1.0, False, 64, 2, head_group=3)
    for block_m, dq_split, dq_tma in ((128, True, True), (64, False, True), (64, True, False)):
        assert not fb.key_rows_fits(block_m, dq_split, dq_tma)
        with pytest.raises(ValueError, match="needs BLOCK_M 64"):
            fb.launch_args(*args(64, block_m, 2), dq_split=dq_split, dq_tma=dq_tma, key_rows=1)
    with pytest.raises(ValueError, match="key_rows is 0, 1 or 2"):
        fb.launch_args(*args(64, 64, 2), dq_split=True, dq_tma=True, key_rows=3)
    assert fb.key_rows_fits(64, True, True)
    assert [fb.key_rows_knob(2, 64, True, True), fb.key_rows_knob(2, 64, False, True)] == [2, 0]


def test_head_group_is_a_divisor_of_the_slices():
    """The backward's order knob comes down to the largest divisor of the kv-head slices not above what was asked."""
    assert [fb.head_group(16, w) for w in (0, 1, 4, 5, 16, 64)] == [1, 1, 4, 4, 16, 16]
    assert fb.head_group(6, 4) == 3 and fb.head_group(5, 4) == 1 and fb.head_group(2, 8) == 2


# ------------------------------------------------------------------------------ the barrier protocol, modelled
class _Barrier:
    """An mbarrier: `count` arrivals (plus the expected transaction bytes, here: copies) complete a phase.
    wait(parity) passes iff the phase of that parity has completed, i.e. completed % 2 != parity."""

    def __init__(self, count):
        self.count, self.arrived, self.pending_tx, self.completed = count, 0, 0, 0

    def arrive(self):
        self.arrived += 1
        self._maybe_complete()

    def expect(self, copies):
        self.pending_tx += copies
        self.arrive()

    def land(self):
        self.pending_tx -= 1
        self._maybe_complete()

    def _maybe_complete(self):
        assert self.arrived <= self.count, "more arrivals than the barrier's count in one phase"
        if self.arrived == self.count and self.pending_tx == 0:
            self.arrived, self.completed = 0, self.completed + 1

    def passes(self, parity):
        return self.completed % 2 != parity


def _model_run(rng, stages, n_items, mutation=None, split=False, key_rows=False):
    """One random interleaving of the producer, the two consumers and the TMA engine, following the kernel's waits,
    expects, copies and arrives (flash_gluon_bwd_kernel._producer / _consumer; split: DQ_SPLIT's ds_full / ds_free
    pair, each warpgroup's dQ reading both dS tiles and both K slices; key_rows: two dS tiles a warpgroup, chosen by
    the step's parity, and no ds_free wait before writing one). Returns None or the failure."""
    kv_bar = _Barrier(1)
    ds_full, ds_free = _Barrier(2), _Barrier(2)
    n_par = 2 if key_rows and mutation != "one_ds_tile" else 1
    ds_tile = [[None, None] for _ in range(n_par)]         # the step whose dS a warpgroup's tile holds
    ds_readers = [[set(), set()] for _ in range(n_par)]    # warpgroups whose dQ reads a dS tile
    k_readers = [set(), set()]                             # warpgroups whose dQ reads a K slice
    ready = [_Barrier(1) for _ in range(stages)]
    empty = [_Barrier(1 if mutation == "empty_count_1" else 2) for _ in range(stages)]
    slot_tile = [None] * stages          # the tile a slot holds (after its copies landed)
    readers = [set() for _ in range(stages)]
    in_flight = []                       # TMA copies: (barrier, slot or None, tile)
    kv_landed = [0]

    def producer():
        kv_bar.expect(5)  # K and V (two slices each) and the index table
        for _ in range(5):
            in_flight.append((kv_bar, None, "kv"))
        yield
        for it in range(n_items):
            slot, u = it % stages, it // stages
            parity = (u & 1) if mutation == "producer_parity" else (u & 1) ^ 1
            while not empty[slot].passes(parity):
                yield "blocked"
            if empty[slot].completed != u:
                return f"producer passed empty[{slot}] for use {u} with {empty[slot].completed} phases completed"
            if readers[slot]:
                return f"producer refills slot {slot} while consumers {readers[slot]} still read it"
            ready[slot].expect(4)
            slot_tile[slot] = None
            for _ in range(4):
                in_flight.append((ready[slot], slot, it))
            yield

    def consumer(wg):
        while not kv_bar.passes(0):
            yield "blocked"
        if kv_landed[0] != 5:
            return f"consumer {wg} passed kv_bar before K, V and the index table landed"
        yield
        for it in range(n_items):
            slot, u = it % stages, it // stages
            parity = ((u & 1) ^ 1) if mutation == "consumer_parity" else (u & 1)
            while not ready[slot].passes(parity):
                yield "blocked"
            if ready[slot].completed != u + 1:
                return f"consumer {wg} passed ready[{slot}] for use {u} with {ready[slot].completed} phases completed"
            if slot_tile[slot] != it:
                return f"consumer {wg} reads tile {slot_tile[slot]} in slot {slot}, wants {it}"
            par = it % n_par
            if split:
                if not key_rows:
                    free_parity = (it & 1) if mutation == "ds_free_parity" else (it & 1) ^ 1
                    while not ds_free.passes(free_parity):
                        yield "blocked"
                if ds_readers[par][wg]:
                    return f"consumer {wg} writes its dS tile (step {it}) while {ds_readers[par][wg]} read it"
            readers[slot].add(wg)
            for _ in range(rng.randint(0, 3)):  # the wgmmas reading the slot
                yield
            if split:
                ds_tile[par][wg] = it
                ds_full.arrive()
                yield
                while not ds_full.passes(it & 1):
                    yield "blocked"
                if ds_tile[par] != [it, it]:
                    return f"consumer {wg} step {it}: the dS tiles hold steps {ds_tile[par]}"
                for readers_of in (ds_readers[par][0], ds_readers[par][1], k_readers[0], k_readers[1]):
                    readers_of.add(wg)
                for _ in range(rng.randint(0, 2)):  # dQ's wgmmas over both tiles and both K slices
                    yield
                for readers_of in (ds_readers[par][0], ds_readers[par][1], k_readers[0], k_readers[1]):
                    readers_of.discard(wg)
            readers[slot].discard(wg)
            empty[slot].arrive()
            if split:
                ds_free.arrive()
            for _ in range(rng.randint(1, 3)):  # dQ's atomics (the arrive is progress: at least one yield)
                yield
        if split and n_items > 0 and mutation != "no_epilogue_wait":
            while not ds_free.passes((n_items - 1) & 1):
                yield "blocked"
        if split and k_readers[wg]:
            return f"consumer {wg} writes dK over its K slice while {k_readers[wg]} read it"

    agents = {"producer": producer(), "consumer0": consumer(0), "consumer1": consumer(1)}
    done = set()
    for _ in range(100000):
        runnable = [n for n in agents if n not in done]
        if in_flight:
            runnable.append("tma")
        if not runnable:
            return None
        progress = False
        for name in rng.sample(runnable, len(runnable)):
            if name == "tma":
                bar, slot, tile = in_flight.pop(rng.randrange(len(in_flight)))
                if slot is not None:
                    # the slot holds the tile once its last copy landed
                    slot_tile[slot] = tile if sum(1 for f in in_flight if f[1] == slot) == 0 else None
                else:
                    kv_landed[0] += 1
                bar.land()
                progress = True
                break
            try:
                step = next(agents[name])
            except StopIteration as stop:
                if stop.value:
                    return stop.value
                done.add(name)
                progress = True
                break
            if step != "blocked":
                progress = True
                break
        if not progress:
            where = {n: agents[n].gi_frame.f_locals.get("it") for n in agents if n not in done}
            return (f"deadlock: {where} (item each) blocked, {len(in_flight)} copies in flight; ready "
                    f"{[(b.completed, b.arrived, b.pending_tx) for b in ready]}, empty "
                    f"{[(b.completed, b.arrived) for b in empty]}, kv {kv_bar.completed}")
    return "did not finish"


@pytest.mark.parametrize("kv_rows", [0, 333, 1000])
def test_prep_kernel_statistics_and_zeros(kv_rows):
    """The backward's prep pass (plain Triton, so the interpreter runs it): delta = rowsum(out ∘ do), lse2 = lse ·
    log2 e (+inf where lse is -inf), the padded rows' statistics (lse2 +inf, delta 0), dq's accumulator zeroed, and
    with ZERO_KV every row of GROUP_SPLIT's dK / dV accumulator zeroed (rows spread over the programs, a tail)."""
    from warpforge.ops import _gluon_flash_bwd as gb
    b, s_q, h_q, d = 2, 100, 3, 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out, do = (torch.randn(b, s_q, h_q, d, device=dev, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(b, h_q, s_q, device=dev)
    lse[0, 1, 5] = float("-inf")
    s_pad, lse2, delta, dq_acc = gb._buffers(out, 64)
    for t in (lse2, delta, dq_acc):
        t.fill_(7.0)
    kv = torch.full((max(kv_rows, 1), d), 7.0, device=dev)
    grid = (b * h_q, s_pad // gb.PREP_ROWS)
    gb.bwd_prep_kernel[grid](out, do, lse, lse2, delta, dq_acc, kv, s_q, s_pad, kv_rows, out.stride(0), out.stride(1),
                             out.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
                             H_Q=h_q, D=d, BLOCK=gb.PREP_ROWS, ZERO_KV=kv_rows > 0)
    want_delta = (out.float() * do.float()).sum(-1).permute(0, 2, 1).reshape(b * h_q, s_q)
    assert torch.allclose(delta[:, :s_q], want_delta, atol=1e-3) and bool((delta[:, s_q:] == 0).all())
    want_lse2 = torch.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634).reshape(b * h_q, s_q)
    assert torch.allclose(lse2[:, :s_q], want_lse2) and bool((lse2[:, s_q:] == float("inf")).all())
    assert bool((dq_acc == 0).all())
    assert bool((kv == 0).all()) if kv_rows else bool((kv == 7.0).all())


@pytest.mark.parametrize("pair", [False, True])
def test_convert_kernel_single_and_pair(pair):
    """The conversion pass (plain Triton): accumulator [b · h, s_pad, d] · scale into [b, s, h, d] in the output's
    dtype, padded rows dropped; a grid of depth 2 converts dK and dV (accumulator [2, ...]) in one launch."""
    from warpforge.ops import _gluon_flash_bwd as gb
    b, s, h, d, s_pad = 2, 100, 3, 64, 128
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    acc = torch.randn(1 + pair, b * h, s_pad, d, device=dev)
    outs = [torch.full((b, s, h, d), 7.0, device=dev, dtype=torch.float16) for _ in range(1 + pair)]
    scale = 1.0 if pair else 0.5
    gb.acc_convert_kernel[(b * h, s_pad // gb.PREP_ROWS, 1 + pair)](
        acc, outs[0], outs[-1], s, s_pad, scale, outs[0].stride(0), outs[0].stride(1), outs[0].stride(2), H=h, D=d,
        BLOCK=gb.PREP_ROWS)
    for i, out in enumerate(outs):
        want = (acc[i, :, :s] * scale).view(b, h, s, d).permute(0, 2, 1, 3).half()
        assert torch.equal(out, want), i


def test_barrier_protocol_model():
    """Every interleaving tried finishes, each consumer reads every tile exactly when it has landed, and no slot is
    refilled while a consumer reads it: stages 2-4, items 0-9 (the GQA group times the query tiles)."""
    rng = random.Random(0)
    for run in range(6000):
        stages, n_items, split, key_rows = rng.choice((2, 3, 4)), rng.randint(0, 9), run % 3 > 0, run % 3 == 2
        failure = _model_run(rng, stages, n_items, split=split, key_rows=key_rows)
        assert failure is None, (run, stages, n_items, split, key_rows, failure)


def test_barrier_model_key_rows_needs_two_ds_tiles():
    """KEY_ROWS drops the ds_free wait before a dS tile is written; with one tile a warpgroup instead of two, some
    interleaving overwrites a tile the other warpgroup's dQ still reads."""
    rng = random.Random(2)
    assert any(_model_run(rng, rng.choice((2, 3)), rng.randint(3, 9), "one_ds_tile", split=True, key_rows=True)
               for _ in range(300))


@pytest.mark.parametrize("mutation", ["producer_parity", "consumer_parity", "empty_count_1", "ds_free_parity",
                                      "no_epilogue_wait"])
def test_barrier_model_catches_mutations(mutation):
    """The model is not vacuous: a wrong parity, a single-arrival empty barrier or a missing wait fails in some
    interleaving."""
    rng = random.Random(1)
    assert any(_model_run(rng, rng.choice((2, 3)), rng.randint(3, 9), mutation, split=True) for _ in range(300))


# ------------------------------------------------------------------------------ the schedule's arithmetic, emulated
LOG2E = 1.4426950408889634


def emulate_step(Qp, DOp, K, V, lse2, dl, dq_acc, dK, dV, bb, h, m0, BM, scale, limit0, shift, causal, left=None):
    """One consumer warpgroup's step (flash_gluon_bwd_kernel._consumer / _probs) in float64, shared with the sparse
    walk's emulation (tests/sparse/test_sparse_gluon.py): query rows m0 .. m0 + BM of head h (padded Qp / DOp, lse2 /
    dl per row) against the warpgroup's 64 keys K, V; the mask only where the kernel takes its masked branch (keys
    past s_k: limit0 < 63; the causal diagonal; a left window); dK, dV and dq_acc summed in place."""
    Q, dO = Qp[bb, m0:m0 + BM, h], DOp[bb, m0:m0 + BM, h]
    P = torch.exp2((Q @ K.T) * scale * LOG2E - lse2[bb, h, m0:m0 + BM, None])
    masked = limit0 < 63 or (causal and m0 + shift < 63)
    if left is not None:
        masked = masked or (m0 + BM - 1 + shift - left > 0)
    if masked:
        limit = torch.full((BM,), limit0)
        rows = torch.arange(m0, m0 + BM)
        if causal:
            limit = torch.minimum(limit, rows + shift)
        cols = torch.arange(64)
        ok = cols[None, :] <= limit[:, None]
        if left is not None:
            ok = ok & (cols[None, :] >= (rows + shift - left)[:, None])
        P = torch.where(ok, P, 0.0)
    dS = P * (dO @ V.T - dl[bb, h, m0:m0 + BM, None])
    dV += P.T @ dO
    dK += dS.T @ Q
    dq_acc[bb, h, m0:m0 + BM] += dS @ K


def emulate_store(dk, dv, dK, dV, bb, key_lo, kvh, s_k, scale):
    """The epilogue: the warpgroup's dK (scaled) and dV rows that exist (keys below s_k)."""
    n_valid = max(0, min(64, s_k - key_lo))
    dk[bb, key_lo:key_lo + n_valid, kvh] = (dK * scale)[:n_valid]
    dv[bb, key_lo:key_lo + n_valid, kvh] = dV[:n_valid]


def _emulate(q, k, v, do, causal, BM=64, left=None):
    """The Gluon backward's schedule (flash_gluon_bwd_kernel._span / _consumer / _probs) in float64: programs of
    128 keys x kv head, two 64-key warpgroups, the kernel's tile walk, mask conditions (masked / unmasked branch),
    padding, scales."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    G = h_q // h_kv
    scale = d ** -0.5
    out, lse = attention_reference(q, k, v, causal=causal, window=(-1 if left is None else left, -1))
    delta = (out * do).sum(-1)                      # [b, s, h]
    s_pad = -(-s_q // BM) * BM
    lse2 = torch.full((b, h_q, s_pad), math.inf, dtype=torch.float64)
    lse2[:, :, :s_q] = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    dl = torch.zeros((b, h_q, s_pad), dtype=torch.float64)
    dl[:, :, :s_q] = delta.transpose(1, 2)
    pad = lambda t, n: torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1], *t.shape[2:])], 1) if n > t.shape[1] else t
    n_kv = -(-s_k // 128)
    Qp, DOp = pad(q, s_pad), pad(do, s_pad)
    Kp, Vp = pad(k, n_kv * 128), pad(v, n_kv * 128)
    dq_acc = torch.zeros((b, h_q, s_pad, d), dtype=torch.float64)
    dk = torch.zeros_like(k); dv = torch.zeros_like(v)
    diag = s_k - s_q
    n_m = -(-s_q // BM)
    for pid0, bb, kvh in itertools.product(range(n_kv), range(b), range(h_kv)):
        n0 = pid0 * 128
        first = min(max(n0 - diag, 0) // BM, n_m) if causal else 0
        end = n_m
        if left is not None:  # _span's WINDOW: the last query that sees key n0 + 127
            end = max(min(max(n0 + 127 - diag + left + BM, 0) // BM, n_m), first)
        for wg in range(2):
            key_lo = n0 + 64 * wg
            K = Kp[bb, key_lo:key_lo + 64, kvh]; V = Vp[bb, key_lo:key_lo + 64, kvh]
            limit0 = s_k - 1 - key_lo; shift = diag - key_lo
            dK = torch.zeros(64, d, dtype=torch.float64); dV = torch.zeros(64, d, dtype=torch.float64)
            for g in range(G):
                h = kvh * G + g
                for i in range(first, end):
                    emulate_step(Qp, DOp, K, V, lse2, dl, dq_acc, dK, dV, bb, h, i * BM, BM, scale, limit0, shift,
                                 causal, left)
            emulate_store(dk, dv, dK, dV, bb, key_lo, kvh, s_k, scale)
    dq = (dq_acc[:, :, :s_q] * scale).transpose(1, 2)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 77, 77, 2, 1, 16), (2, 130, 300, 4, 2, 8), (1, 300, 130, 2, 2, 8),
                                   (1, 200, 200, 3, 1, 8)], ids=lambda s: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}".format(*s))
@pytest.mark.parametrize("left", [None, 0, 50, 127, 200])
def test_schedule_emulation_matches_reference(shape, causal, left):
    """The kernel's tile walk (first query tile per key tile, GQA heads; with a left window its last query tile), its
    masked / unmasked choice and per-row limits, the padded lse2 (+inf) / delta (0) rows and where the scales go,
    replayed in float64 on CPU, give the reference gradients: a wrong branch condition or limit would leave unmasked
    probabilities in."""
    b, s_q, s_k, h_q, h_kv, d = shape
    torch.manual_seed(0)
    q = torch.randn(b, s_q, h_q, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, s_k, h_kv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, s_k, h_kv, d, dtype=torch.float64, requires_grad=True)
    do = torch.randn(b, s_q, h_q, d, dtype=torch.float64)
    out, _ = attention_reference(q, k, v, causal=causal, window=(-1 if left is None else left, -1))
    want = torch.autograd.grad(out, (q, k, v), do)
    with torch.no_grad():
        got = _emulate(q.detach(), k.detach(), v.detach(), do, causal, left=left)
    for name, g, w in zip("qkv", got, want):
        assert rel_l2(g, w) <= 1e-5, f"d{name}"


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [  # configs.GLUON_BWD's knobs, and dq in 32-column chunks
    dict(d=128, causal=True, block_m=64, stages=2, dq_n=64),
    dict(d=128, causal=False, block_m=64, stages=2, dq_n=64, h_q=4, h_kv=4, dtype="float16"),
    dict(d=128, causal=True, block_m=64, stages=2, dq_n=32, h_q=8, h_kv=1),
    dict(d=64, causal=True, block_m=64, stages=4, dq_n=64, h_q=8, h_kv=1, dtype="float16"),
    dict(d=64, causal=False, block_m=64, stages=4, dq_n=64),
]


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {fb.GLUON_TRITON_VERSIONS} "
                    f"(installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compiles_for_sm90(case):
    r = compile_in_subprocess("warpforge.ops.attention.flash_gluon_bwd_kernel", case, ROOT)
    print(f"\n{case}: {r['registers']} registers/thread (ptxas cap; setmaxnreg {r['setmaxnreg_values']}), "
          f"spills {r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B, warps {r['num_warps']}, "
          f"{r['wgmma_count']} wgmma")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["mbarrier"] and r["red"]
    assert r["warp_specialize"] and r["num_warps"] == 12  # 2 consumer warpgroups + the producer's warpgroup
    assert r["ptxas_rc"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert not r["wgmma_serialized"], r["ptxas_log"]
    assert r["shared_bytes"] <= fg.SMEM_MAX
    assert fg.CONSUMER_REGS in r["setmaxnreg_values"] and fg.PRODUCER_REGS in r["setmaxnreg_values"]


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {fb.GLUON_TRITON_VERSIONS} "
                    f"(installed: {triton_version()}); its API differs between releases")
def test_dq_split_compiles_for_sm90():
    """The DQ_SPLIT knob: compiles, keeps the pipeline and spills nothing (it spilled ~100-260 B of hoisted wgmma
    descriptors at d 128 until session 15 rebuilt them at use)."""
    r = compile_in_subprocess("warpforge.ops.attention.flash_gluon_bwd_kernel", dict(d=128, causal=True, dq_split=True),
                              ROOT)
    print(f"\ndq_split d128: spills {r['spill_stores']}/{r['spill_loads']} B, {r['wgmma_count']} wgmma")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["red"] and r["ptxas_rc"] == 0
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and not r["wgmma_serialized"], r["ptxas_log"]


DQ_TMA_CASES = [  # dQ by TMA reduce-adds from shared memory (DQ_TMA), with and without DQ_SPLIT
    dict(d=128, causal=True, block_m=64, stages=2, dq_n=64, dq_tma=True),
    dict(d=128, causal=True, block_m=64, stages=2, dq_split=True, dq_tma=True, h_q=8, h_kv=1),
    dict(d=128, causal=False, block_m=64, stages=3, dq_split=True, dq_tma=True, dtype="float16"),
    dict(d=128, causal=True, block_m=64, stages=2, dq_n=128, dq_tma=True),  # one full-width dQ wgmma, one reduce
    dict(d=64, causal=True, block_m=64, stages=4, dq_n=64, dq_tma=True),
    dict(d=64, causal=True, block_m=64, stages=4, dq_split=True, dq_tma=True, h_q=8, h_kv=1),
    # KEY_ROWS: the transposed step (Pᵀ, dSᵀ as register A operands), dense, windowed, group-split and sparse
    dict(d=128, causal=True, block_m=64, stages=3, dq_split=True, dq_tma=True, key_rows=1),
    dict(d=128, causal=True, block_m=64, stages=3, dq_split=True, dq_tma=True, key_rows=2),
    dict(d=128, causal=True, block_m=64, stages=2, dq_split=True, dq_tma=True, key_rows=1, left=100),
    dict(d=128, causal=True, block_m=64, stages=2, dq_split=True, dq_tma=True, key_rows=2, h_q=8, h_kv=1,
         group_split=2),
    dict(d=128, causal=True, block_m=64, stages=3, dq_split=True, dq_tma=True, key_rows=2, block_size=128),
    dict(d=64, causal=False, block_m=64, stages=4, dq_split=True, dq_tma=True, key_rows=1, dtype="float16"),
]


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {fb.GLUON_TRITON_VERSIONS} "
                    f"(installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", DQ_TMA_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_dq_tma_compiles_for_sm90(case):
    """DQ_TMA: the PTX reduces dQ with cp.reduce.async.bulk.tensor (no per-thread atomics), keeps the pipeline, and
    spills nothing."""
    r = compile_in_subprocess("warpforge.ops.attention.flash_gluon_bwd_kernel", case, ROOT)
    print(f"\n{case}: spills {r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B, "
          f"{r['wgmma_count']} wgmma")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["ptxas_rc"] == 0, r.get("ptxas_log")
    assert r["tma_reduce"] and not r["red"]
    assert r["warp_specialize"] and r["num_warps"] == 12 and not r["wgmma_serialized"]
    assert r["shared_bytes"] <= fg.SMEM_MAX
    # KEY_ROWS at d 128: one register (4 B) spilled around the epilogue's ds_free wait, outside the loop (SASS read,
    # session 28: the STL after the last TMA store, the LDL after the wait)
    spill_limit = 4 if case.get("key_rows") and case["d"] == 128 else 0  # (KEY_ROWS 2: the same, measured)
    assert r["spill_stores"] <= spill_limit and r["spill_loads"] <= spill_limit, r["ptxas_log"]


# ------------------------------------------------------------------------------------------ GPU numerics
needs_h200 = pytest.mark.skipif(not _on_h200(), reason="the Gluon backward runs on sm_90 with Triton "
                                f"{fb.GLUON_TRITON_VERSIONS}")


@pytest.fixture
def gluon_bwd_on(monkeypatch):
    """The backward's gate switched on; records causal of each Gluon backward launch made through api's dispatch."""
    return spy_launches(monkeypatch, fb, "flash_bwd_gluon", lambda args: args[7], {configs.GLUON_BWD_ENV: "1"},
                        KNOB_ENV)


def _inputs(b, s_q, s_k, h_q, h_kv, d, dtype=torch.bfloat16):
    q = torch.randn(b, s_q, h_q, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(q, k, v, causal, d_out, deterministic=False):
    with poisoned_outputs():
        out = wf.flash_attention(q, k, v, causal=causal, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), d_out)


def _reference_grads(q, k, v, causal, d_out):
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*ref_in, causal=causal)
    return torch.autograd.grad(ref_out, ref_in, d_out.float())


SHAPES = [  # b, s_q, s_k, h_q, h_kv
    (1, 1, 1, 2, 2),
    (2, 77, 77, 4, 2),
    (2, 1000, 1000, 4, 4),
    (1, 2048 + 13, 2048 + 13, 2, 1),
    (3, 128, 128, 8, 2),
    (2, 77, 1000, 4, 1),    # fewer queries than keys (bottom-right causal)
    (2, 1000, 77, 4, 4),    # more queries than keys: causal rows that see nothing
    (1, 300, 300, 8, 1),    # MQA: dK/dV summed over 8 query heads in-program
]


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}-hq{}-hkv{}".format(*s))
def test_gpu_matches_reference(shape, causal, d, gluon_bwd_on):
    q, k, v = _inputs(*shape, d)
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    grads = _grads(q, k, v, causal, d_out)
    assert gluon_bwd_on == [causal]  # the gated path ran, not the portable backward
    for name, g, r in zip("qkv", grads, _reference_grads(q, k, v, causal, d_out)):
        assert torch.isfinite(g).all(), f"d{name}: unwritten (NaN-poisoned) or non-finite"
        assert rel_l2(g, r) <= 2e-2, f"d{name}"


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("block_m,stages,dq_n,dq_split,dq_tma,key_rows", [
    (64, 3, 32, False, False, 0), (64, 2, None, True, False, 0), (64, 2, 64, False, True, 0),
    (64, 2, None, True, True, 0), (64, 3, None, True, True, 0), (64, 2, 128, False, True, 0),
    (64, 2, None, True, True, 1), (64, 3, None, True, True, 1), (64, 3, None, True, True, 2)])
def test_gpu_knobs_match_portable(block_m, stages, dq_n, dq_split, dq_tma, key_rows, monkeypatch):
    """Every knob the sweep varies agrees with the portable backward (direct calls; fp16 too)."""
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
    for d, dtype, causal, shape in ((128, torch.bfloat16, True, (2, 1000 + 5, 1000 + 5, 8, 2)),
                                    (64, torch.float16, False, (2, 700, 900, 4, 4))):
        if (dq_n or 64) > d or fb.smem_bytes(d, block_m, stages, (d // 2) if dq_split else (dq_n or 64), dq_split,
                                             dq_tma) > fg.SMEM_MAX:
            continue
        q, k, v = _inputs(*shape, d, dtype)
        d_out = torch.randn(q.shape, device="cuda", dtype=dtype)
        out, lse = wf.flash_attention(q, k, v, causal=causal, return_lse=True)
        want = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
        with poisoned_outputs():
            got = fb.flash_bwd_gluon(d_out, q.detach(), k.detach(), v.detach(), out.detach(), lse, d ** -0.5, causal,
                                     block_m, stages, dq_n, dq_split, dq_tma, key_rows=key_rows)
        assert_qkv_grads_close(got, want, 1e-2, f"{block_m}/{stages}/{dq_n}/{dq_split}/{dq_tma}/{key_rows}")


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("left,split,key_rows,s_q,s_k", [(None, 2, 1, 1005, 1005), (300, 1, 1, 1005, 1005),
                                                         (50, 4, 1, 1005, 1005), (None, 2, 2, 1005, 1005),
                                                         (50, 4, 2, 1005, 1005), (None, 1, 2, 77, 1000),
                                                         (None, 1, 2, 1000, 77)])
def test_gpu_key_rows_window_and_group_split(left, split, key_rows, s_q, s_k, monkeypatch):
    """KEY_ROWS (the transposed step) with a left window and with GQA's group split agrees with the portable
    backward (the window's and the split's masks and reduce-adds on the transposed tiles); bottom-right causal with a
    shift that is not a multiple of 64 (fewer queries than keys) and rows that see nothing (more)."""
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
    q, k, v = _inputs(2, s_q, s_k, 8, 2, 128)
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    window = (-1, 0) if left is None else (left, 0)
    out, lse = wf.flash_attention(q, k, v, causal=True, window=window, return_lse=True)
    want = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    with poisoned_outputs():
        got = fb.flash_bwd_gluon(d_out, q.detach(), k.detach(), v.detach(), out.detach(), lse, 128 ** -0.5, True, 64, 2,
                                 None, True, True, group_split=split, left=left, key_rows=key_rows)
    assert_qkv_grads_close(got, want, 1e-2, f"left {left} split {split} key_rows {key_rows}")


@pytest.mark.gpu
@needs_h200
def test_gpu_deterministic_stays_portable_and_reproducible(gluon_bwd_on):
    """deterministic=True never takes the atomic-dq kernel, and its gradients are bitwise equal run to run."""
    q, k, v = _inputs(2, 1000, 1000, 8, 2, 128)
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    first = _grads(q, k, v, True, d_out, deterministic=True)
    second = _grads(q, k, v, True, d_out, deterministic=True)
    assert gluon_bwd_on == []
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # Without it: dq is summed by atomics, and so are dK / dV where GQA splits the group over programs (d 128,
    # configs.GLUON_BWD_GROUP_SPLIT); with one program per kv head (MHA) dK / dV are summed in-program: bitwise equal
    third = _grads(q, k, v, True, d_out)
    fourth = _grads(q, k, v, True, d_out)
    assert gluon_bwd_on == [True, True]
    for a, b in zip(third, fourth):
        assert rel_l2(a, b) <= 1e-3
    q, k, v = _inputs(2, 1000, 1000, 8, 8, 128)
    fifth = _grads(q, k, v, True, d_out)
    sixth = _grads(q, k, v, True, d_out)
    assert gluon_bwd_on == [True] * 4
    assert torch.equal(fifth[1], sixth[1]) and torch.equal(fifth[2], sixth[2])


@pytest.mark.gpu
@needs_h200
def test_gpu_strided_inputs_and_fallbacks(gluon_bwd_on, monkeypatch):
    """q, k, v as views of one packed qkv tensor (TMA descriptors over their strides); off by
    WARPFORGE_ATTN_GLUON_BWD=0 (the portable backward then agrees); softcap and a window go to the portable one."""
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    on = _grads(q, k, v, True, d_out)
    assert gluon_bwd_on == [True]
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
    off = _grads(q, k, v, True, d_out)
    assert len(gluon_bwd_on) == 1
    for g, w in zip(on, off):
        assert rel_l2(g, w) <= 1e-2
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
    # out.sum(): the incoming gradient is an expanded tensor (zero strides), copied contiguous for TMA
    summed = torch.autograd.grad(wf.flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    assert len(gluon_bwd_on) == 2
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
    summed_off = torch.autograd.grad(wf.flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    for g, w in zip(summed, summed_off):
        assert rel_l2(g, w) <= 1e-2
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
    out = wf.flash_attention(q, k, v, causal=True, softcap=30.0)
    torch.autograd.grad(out, (q, k, v), d_out)
    out = wf.flash_attention(q, k, v, window=(64, 64))  # two-sided: the portable kernels (a left window is ours)
    torch.autograd.grad(out, (q, k, v), d_out)
    assert len(gluon_bwd_on) == 2


@pytest.mark.gpu
@needs_h200
def test_gpu_long_sequence_matches_portable(gluon_bwd_on, monkeypatch):
    """A bench-sized problem (b 1, h 4, s 8192, d 128) against the portable backward (the fp32 reference would need
    1 GB of scores per head)."""
    q, k, v = _inputs(1, 8192, 8192, 4, 4, 128)
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    for causal in (True, False):
        got = _grads(q, k, v, causal, d_out)
        monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
        want = _grads(q, k, v, causal, d_out)
        monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
        for g, w in zip(got, want):
            assert rel_l2(g, w) <= 1e-2
    assert gluon_bwd_on == [True, False]
