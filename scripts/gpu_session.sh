#!/usr/bin/env bash
# One device call's steps, each bounded by a timeout so the call always returns what it has:
#   bash scripts/gpu_session.sh OUT STEP...   (steps: see the case list below)
# Everything lands in OUT/work and comes back as OUT/all.tgz (the device returns at most 8 files). To run a commit
# while the working tree changes: git archive HEAD | tar -x -C .head && git rev-parse HEAD > .head/COMMIT, carry .head.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
w=$out/work; mkdir -p "$w"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# a checkout exported without .git (git archive) names its commit in COMMIT, for the results' git_commit
[ -f COMMIT ] && export WARPFORGE_GIT_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$w/gpu.txt"
par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
# issue 19's speculation: a target of GPT-2 small's shape on the plays' bytes (the issue's example), STEPS steps or
# MINUTES; a draft of the tiny preset with NL layers at seq 1024 (the bench prompt is ~600 bytes)
spec_target() { timeout $3 python3 -m warpforge gpt train --preset gpt2-124m --data shakespeare --vocab_size=256 \
                  --max-steps $1 --max-minutes $2 --lr=1e-3 --warmup_steps=$(( $1 / 10 )) --eval_every=$(( $1 / 2 )) \
                  --ckpt-every $1 --out "$w/target" > "$w/target.log" 2>&1; }
spec_draft() { timeout $3 python3 -m warpforge gpt train --preset tiny --seq_len=1024 --batch_size=16 --n_layer=$1 \
                 --max-minutes $2 ${4:+--max-steps $4} ${5:-} --out "$w/draft$1" > "$w/draft$1.log" 2>&1; }
spec_bench() { timeout 70 python3 -m warpforge.serve.spec_bench --model "$w/target" --speculative "$w/$1" --k $2 \
                 --json "$w/spec-$1-k$2.json" 2>&1 | tail -1
               tar czf "$out/all.tgz" -C "$w" --exclude='./target' --exclude='./draft[0-9]' .; }
spec_cleanup() { grep -E "done" "$w"/target.log "$w"/draft*.log
                 rm -rf "$w"/target/*.pt "$w"/target/*.safetensors "$w"/draft*/*.pt "$w"/draft*/*.safetensors; }
paged_gluon_tests() { timeout 300 python3 -m pytest -q tests/paged/test_paged_gluon.py tests/paged/test_paged_decode.py \
                        -k "gpu and (fp8 or fp4 or gluon or graph or portable or helper or quantised)" \
                        > "$w/paged-gluon-tests.log" 2>&1; tail -n 8 "$w/paged-gluon-tests.log"; }
# the Evoformer forward portable (the default) / Gluon, twice each, each beside Flex in its own process: the cases MATCH $1
evo_fwd_ab() { local r=0 v; for v in 0 1 0 1; do r=$((r + 1))
                 WARPFORGE_EVO_GLUON_FWD=$v SKIP_TESTS=1 MATCH="$1" timeout 60 bash scripts/gpu_check.sh "$w/evo-ab$v-$r" evoformer \
                   > "$w/$step$v-$r.log" 2>&1
                 echo "gluon fwd $v:"; grep -E "$1" "$w/evo-ab$v-$r/bench-evoformer.log" | grep -E " (warpforge|flex) "
                 tar czf "$out/all.tgz" -C "$w" .; done; }
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests) timeout 420 python3 -m pytest -v -rf $par tests > "$w/tests.log" 2>&1; grep -E "FAILED|ERROR|passed|failed" "$w/tests.log" | tail -25 ;;
    tune-paged) timeout 200 python3 -m warpforge tune paged --formats bf16,fp8 --out "$w/tune_paged_4k.json" > "$w/tune_paged_4k.log" 2>&1
                timeout 60 python3 -m warpforge tune paged --L 1024 --formats bf16 --out "$w/tune_paged_1k.json" > "$w/tune_paged_1k.log" 2>&1 ;;
    tests-*) timeout 200 python3 -m pytest -q $par $(echo "${step#tests-}" | tr ',' '\n' | sed 's|^|tests/|') > "$w/$(echo "$step" | tr '/,' '__').log" 2>&1 ;;
    tune-mla) timeout 240 python3 -m warpforge tune mla --only 16:bf16,128:bf16 --out "$w/tune_mla_8k.json" > "$w/tune_mla_8k.log" 2>&1
              timeout 90 python3 -m warpforge tune mla --L 1024 --only 16:bf16,128:bf16 --out "$w/tune_mla_1k.json" > "$w/tune_mla_1k.log" 2>&1 ;;
    tune-paged-q) timeout 240 python3 -m warpforge tune paged --formats fp8,nvfp4,mxfp4 --L 16384 --out "$w/tune_paged_q.json" > "$w/tune_paged_q.log" 2>&1 ;;
    tune-monarch) timeout 300 python3 -m warpforge tune monarch --out "$w/tune_monarch.json" > "$w/tune_monarch.log" 2>&1 ;;
    monarch-parts) # issue 17: each launch of a Monarch step alone at the table's tiles, pointer / descriptor stores, mode 2 / 3
                   timeout 200 python3 -m warpforge tune monarch --parts-only --out "$w/monarch_parts.json" > "$w/monarch_parts.log" 2>&1
                   grep "^nb " "$w/monarch_parts.log" ;;
    gpt-monarch) for mlp in swiglu monarch; do
                   SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache timeout 240 bash scripts/gpt_train_check.sh shakespeare 1.6 \
                     "$w/gpt-shakespeare-$mlp.json" --mlp $mlp > "$w/gpt-$mlp.log" 2>&1; tail -3 "$w/gpt-$mlp.log"; done ;;
    gpt-monarch-sweep) # issue 17's GPT line (val within 3% of the dense MLP's at 600 steps, more tokens/s): the dense
                       # MLP, then Monarch MLPs wider than its 8/3 (266k vs 860k parameters a layer at 8/3); MLP:FFN_MULT:LR
                       for c in ${MONARCH_SWEEP:-swiglu:2.667:2e-3 monarch:8:2e-3 monarch:10.667:2e-3 monarch:8:3e-3}; do
                         IFS=: read -r mlp mult lr <<< "$c"; tag=gm-$mlp-$mult-$lr
                         SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache timeout 150 python3 -m warpforge gpt train --preset shakespeare \
                           --mlp $mlp --ffn_mult=$mult --lr=$lr --out "$w/$tag" > "$w/$tag.log" 2>&1
                         echo "$mlp ffn_mult $mult lr $lr: $(python3 -c "import json,sys; h=json.load(open(sys.argv[1])); \
                           v=[x for x in h if 'val_loss' in x]; print(v[-1] if v else 'no val')" "$w/$tag/history.json" 2>&1)"
                         grep -oE "[0-9,]+ tok/s" "$w/$tag.log" | tail -1; rm -f "$w/$tag"/*.pt "$w/$tag"/*.safetensors; done ;;
    tune-attention) timeout 240 python3 -m warpforge tune attention --parts fwd --out "$w/tune_attention.json" > "$w/tune_attention.log" 2>&1 ;;
    compare-attention-varlen) SKIP_TESTS=1 COMPARE=$PWD/.before MATCH=varlen timeout 200 bash scripts/gpu_check.sh "$w/cmp" attention > "$w/cmp-attention.log" 2>&1 ;;
    compare-sparse-loss) SKIP_TESTS=1 COMPARE=$PWD/.before MATCH='index loss' timeout 150 bash scripts/gpu_check.sh "$w/cmp" sparse > "$w/cmp-sparse-loss.log" 2>&1
                         tail -n 6 "$w/cmp-sparse-loss.log" ;;
    compare-sparse) SKIP_TESTS=1 COMPARE=$PWD/.before MATCH="${CMP_MATCH:-s16k top16}" timeout 200 bash scripts/gpu_check.sh "$w/cmp" sparse \
                      > "$w/cmp-sparse.log" 2>&1; cat "$w/cmp/compare-sparse.log" ;;
    compare-moe) SKIP_TESTS=1 COMPARE=$PWD/.before MATCH='T(1024|4096|8192)' timeout 240 bash scripts/gpu_check.sh "$w/cmp" moe > "$w/cmp-moe.log" 2>&1 ;;
    bench-mla-check) SKIP_TESTS=1 MATCH='L(1k|8k) (bf16|fp8)' timeout 200 bash scripts/gpu_check.sh "$w/bench" mla > "$w/$step.log" 2>&1 ;;
    fp8-residual) # issue 14's FP8 accuracy line: q's residual codes (the e4m3 default): the FP8 GPU tests, the headline's
                  # 1 - cos with and without them (printed), then the fp8 bench case (a row without the residual beside)
                  timeout 200 python3 -m pytest -q $par -rf -m gpu -k "not headline" tests/attention/test_attention_fp8_gluon.py \
                    tests/attention/test_flash_attention_fp8.py > "$w/fp8_tests.log" 2>&1; grep -E "FAILED|passed|failed" "$w/fp8_tests.log" | tail -8
                  timeout 90 python3 -m pytest -q -s -m gpu -k headline tests/attention/test_attention_fp8_gluon.py > "$w/fp8_headline.log" 2>&1
                  grep -E "1 - cos|passed|failed" "$w/fp8_headline.log"
                  SKIP_TESTS=1 MATCH=fp8 timeout 120 bash scripts/gpu_check.sh "$w/bench" attention > "$w/bench-fp8.log" 2>&1
                  grep -E "warpforge|cudnn" "$w/bench/bench-attention.log" | tail -6 ;;
    bench-fp8) SKIP_TESTS=1 MATCH=fp8 timeout 120 bash scripts/gpu_check.sh "$w/bench" attention > "$w/$step.log" 2>&1 ;;
    compare-mla) SKIP_TESTS=1 COMPARE=$PWD/.before MATCH='L(1k|8k) (bf16|fp8)' timeout 300 bash scripts/gpu_check.sh "$w/cmp" mla > "$w/cmp-mla.log" 2>&1 ;;
    bench-mla) SKIP_TESTS=1 timeout 330 bash scripts/gpu_check.sh "$w/bench" mla > "$w/$step.log" 2>&1; tail -n 40 "$w/$step.log" | grep -E "warpforge  " ;;
    bench-sparse-loss) SKIP_TESTS=1 MATCH='index loss' timeout 150 bash scripts/gpu_check.sh "$w/bench-loss" sparse > "$w/$step.log" 2>&1
                       grep -E "index loss" "$w/$step.log" ;;
    bench-sparse) SKIP_TESTS=1 timeout 420 bash scripts/gpu_check.sh "$w/bench" sparse > "$w/$step.log" 2>&1 ;;
    serve-bench) for bt in ${SERVE_BATCHES:-1 64}; do  # issue 19's decode MBU bar: Llama-3-8B shape, random bf16 weights, 1k context
                   timeout 150 python3 -m warpforge.serve.bench --shape llama3-8b --batch $bt --context 1024 \
                     --json "$w/serve-decode-b$bt.json" > "$w/serve-decode-b$bt.log" 2>&1; tail -2 "$w/serve-decode-b$bt.log"
                 done ;;
    serve-gpu-tests) timeout 150 python3 -m pytest -q -m gpu tests/serve > "$w/serve-gpu-tests.log" 2>&1; tail -n 3 "$w/serve-gpu-tests.log" ;;
    attention-gluon-tests) timeout 200 python3 -m pytest -q $par -m gpu tests/attention/test_attention_gluon.py tests/attention/test_attention_gluon_bwd.py \
                             > "$w/attention-gluon-tests.log" 2>&1; tail -n 15 "$w/attention-gluon-tests.log" ;;
    serve-prefill) timeout 240 python3 -m warpforge.serve.prefill_bench --shape llama3-8b --tokens 8192 \
                     --json "$w/serve-prefill-8k.json" > "$w/serve-prefill.log" 2>&1; tail -1 "$w/serve-prefill.log" ;;
    serve-spec) export SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache
                spec_target 500 2 200; spec_draft 4 1 120
                for run in "ngram 4" "ngram 8" "$w/draft4 4"; do set -- $run
                  timeout 120 python3 -m warpforge.serve.spec_bench --model "$w/target" --speculative "$1" --k $2 \
                    --json "$w/spec-$(basename "$1")-k$2.json" 2>&1 | tail -1; done
                spec_cleanup ;;
    serve-spec-draft) export SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache  # the draft-model line alone
                # the acceptance is the draft's training: the tiny preset's 400 steps gave 1.0 once (session 12) and
                # 0.47-0.52 three times (session 13, the same engine as session 12's: spec-diag), so 1500 steps
                spec_target 500 2 200
                # drafts of 2 layers (the fewest that copy in context: half the chain's kernels) and of 4 (the tiny preset)
                for nl in 2 4; do
                  spec_draft $nl 2.5 170 1500
                  for k in 4 6; do spec_bench draft$nl $k; done; done
                spec_cleanup ;;
    serve-spec-distill) export SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache  # drafts distilled from the target
                spec_target 500 2 200
                for nl in 2 4; do
                  spec_draft $nl 2.5 170 1500 --teacher="$w/target"
                  for k in 4 6 8; do [ $nl = 4 ] && [ $k = 8 ] || spec_bench draft$nl $k; done; done
                spec_cleanup ;;
    row-invariance) timeout 90 python3 scripts/row_invariance.py > "$w/row_invariance.log" 2>&1; cat "$w/row_invariance.log" ;;
    spec-diag) export SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache  # acceptance / identity every way (scripts/spec_diag.py)
               spec_target 300 1.1 100; spec_draft 4 0.6 60
               timeout 220 python3 scripts/spec_diag.py --model "$w/target" --draft "$w/draft4" --json "$w/spec_diag.json" \
                 > "$w/spec_diag.log" 2>&1; cat "$w/spec_diag.log" | grep name
               if [ -d .before ]; then for k in 4 6; do  # the same models through an earlier commit's engine
                 (cd .before && PYTHONPATH=$PWD timeout 60 python3 -m warpforge.serve.spec_bench --model "$w/target" \
                   --speculative "$w/draft4" --k $k --json "$w/spec-before-k$k.json" 2>&1 | tail -1); done; fi
               spec_cleanup ;;
    moe-train) timeout 150 python3 -m pytest -q $par tests/moe > "$w/moe-tests.log" 2>&1; tail -n 3 "$w/moe-tests.log"
               timeout 200 python3 -m warpforge bench --family moe --match "fwd\+bwd" --json "$w/moe-train.json" \
                 > "$w/moe-train.log" 2>&1; grep -E "fwd\+bwd|within" "$w/moe-train.log" ;;
    tune-moe-fp8) timeout 420 python3 -m warpforge tune moe --w-format fp8 --models ${MOE_MODELS:-mixtral,deepseek-v3} \
                    --tokens ${MOE_TOKENS:-128,16,1} --budget-s 330 --out "$w/tune_moe_fp8.json" > "$w/tune_moe_fp8.log" 2>&1
                  grep -E "BEST|math" "$w/tune_moe_fp8.log" ;;
    tune-moe-sorted) timeout 280 python3 -m warpforge tune moe-sorted --models ${MOE_MODELS:-mixtral} \
                       --out "$w/tune_moe_sorted.json" > "$w/tune_moe_sorted.log" 2>&1; tail -n 12 "$w/tune_moe_sorted.log" ;;
    moe-decode-profile) timeout 150 python3 scripts/profile_case.py --family moe --impl '^warpforge$' --iters 50 \
                          --match "${MOE_MATCH:-(qwen3-30b-a3b T(1|4) uniform$|mixtral T1 uniform|deepseek-v3 T1 uniform)}" \
                          > "$w/moe-decode-profile.log" 2>&1; grep -E "a call" "$w/moe-decode-profile.log" ;;
    attention-bwd-window-tests) timeout 200 python3 -m pytest -q $par -m gpu tests/attention/test_attention_gluon_bwd.py \
                                 tests/attention/test_attention_gluon_window.py -k "not knobs" > "$w/bwd_window_tests.log" 2>&1
                               tail -n 5 "$w/bwd_window_tests.log" ;;
    # the one-launch decode kernel: its GPU tests, then the family's decode rows without it (0) and with it (1)
    moe-decode-tests) timeout 120 python3 -m pytest -q -m gpu tests/moe/test_moe_decode.py tests/moe/test_fused_moe.py \
                        > "$w/moe-decode-gpu-tests.log" 2>&1; tail -n 3 "$w/moe-decode-gpu-tests.log" ;;
    moe-decode-ab) for v in 0 1; do WARPFORGE_MOE_DECODE=$v timeout 150 python3 -m warpforge bench --family moe \
                   --match "${MOE_MATCH:-T(1|4|16) }" --json "$w/moe-decode-$v.json" > "$w/moe-decode-$v.log" 2>&1
                   grep -E "warpforge  " "$w/moe-decode-$v.log"; done ;;
    tune-moe-decode) timeout 420 python3 -m warpforge tune moe-decode --models ${MOE_MODELS:-qwen3-30b-a3b,mixtral,deepseek-v3} \
                       --tokens ${MOE_TOKENS:-1,4,16} --out "$w/tune_moe_decode.json" > "$w/tune_moe_decode.log" 2>&1
                     grep -E " ms|WRONG" "$w/tune_moe_decode.log" | head -120 ;;
    # FP8 MLA caches read by the Gluon kernel itself (in-place dequantisation in shared memory): GPU tests, the
    # h_q 128 rows, then FP8 through the dequantisation pass (WARPFORGE_MLA_GLUON_IN_KERNEL=0) beside them
    # (mla-graph-q: the CUDA-graph tests alone, the in-kernel quantized path's among them)
    mla-graph-q) timeout 120 python3 -m pytest -q -m gpu tests/mla/test_mla_gluon.py -k "graph_capture" > "$w/mla-graph-q.log" 2>&1; tail -n 3 "$w/mla-graph-q.log" ;;
    mla-quant) timeout 250 python3 -m pytest -q -m gpu tests/mla/test_mla_gluon.py -k "quantized or gated or gate_off" \
               > "$w/mla-quant-tests.log" 2>&1; tail -n 3 "$w/mla-quant-tests.log"
             timeout 150 python3 -m warpforge bench --family mla --match 'h128 s_q1 L(1k|8k) ' --json "$w/mla-h128.json" \
               > "$w/mla-h128.log" 2>&1; grep -E "warpforge  " "$w/mla-h128.log"
             WARPFORGE_MLA_GLUON_IN_KERNEL=0 timeout 90 python3 -m warpforge bench --family mla --match 'h128 s_q1 L(1k|8k) (fp8|nvfp4|mxfp4)' \
               --json "$w/mla-h128-pass.json" > "$w/mla-h128-pass.log" 2>&1; grep -E "warpforge  " "$w/mla-h128-pass.log" ;;
    # FP4 MLA caches at h_q 128, every L, read by the kernel and through the dequantisation pass (the crossover)
    mla-fp4-sweep) for v in 1 0; do WARPFORGE_MLA_GLUON_IN_KERNEL=$v timeout 120 python3 -m warpforge bench --family mla \
                     --match 'h128 s_q1 L[0-9]+k (nvfp4|mxfp4)' --json "$w/mla-h128-fp4-inkernel$v.json" \
                     > "$w/mla-h128-fp4-inkernel$v.log" 2>&1; grep -E "warpforge  " "$w/mla-h128-fp4-inkernel$v.log"; done ;;
    # Qwen3 at T4 / T2048 twice (call3 read T2048 uniform 1.548 ms against moe.json's earlier 0.736, unchanged code)
    qwen3-check) for r in 1 2; do timeout 60 python3 -m warpforge bench --family moe --match "qwen3-30b-a3b T(4|2048) " \
                   --json "$w/qwen3-check-$r.json" > "$w/qwen3-check-$r.log" 2>&1; grep -E "warpforge  " "$w/qwen3-check-$r.log"; done ;;
    # the dequantisation pass of quantized MLA caches (configs.DEQUANT) alone, every candidate, L 8k
    tune-mla-dequant) timeout 150 python3 -m warpforge tune mla --dequant --out "$w/tune_mla_dequant.json" \
                        > "$w/tune_mla_dequant.log" 2>&1; cat "$w/tune_mla_dequant.log" ;;
    # the MoE tables as committed: decode kernel tests and rows, the sorted path's tests and fwd+bwd rows
    moe-final) timeout 60 python3 -m pytest -q -m gpu tests/moe/test_moe_decode.py tests/moe/test_moe_sorted.py \
                 > "$w/moe-final-tests.log" 2>&1; tail -n 4 "$w/moe-final-tests.log"
               timeout 70 python3 -m warpforge bench --family moe --match "${MOE_MATCH:-T(1|4) }" --json "$w/moe-decode.json" \
                 > "$w/moe-decode.log" 2>&1; grep -E "warpforge  " "$w/moe-decode.log"
               timeout 80 python3 -m warpforge bench --family moe --match "fwd\+bwd" --json "$w/moe-train.json" \
                 > "$w/moe-train.log" 2>&1; grep -E "fwd\+bwd" "$w/moe-train.log" ;;
    # the sorted path's GPU tests, the per-GEMM table (d act also at 4 stages), the family fwd+bwd bench
    moe-sorted-check) timeout 90 python3 -m pytest -q -m gpu tests/moe/test_moe_sorted.py > "$w/moe-sorted-gpu-tests.log" 2>&1
                 tail -n 3 "$w/moe-sorted-gpu-tests.log"
                 timeout 80 python3 scripts/bench_moe_gemms.py --model mixtral --tiles dact=128x64x8x4,dact=128x64x4x3xws,dact=256x64x8x3 > "$w/moe_gemms.log" 2>&1
                 grep -E "^(up|dact)" "$w/moe_gemms.log"
                 timeout 150 python3 -m warpforge bench --family moe --match "fwd\+bwd" --json "$w/moe-train.json" \
                   > "$w/moe-train.log" 2>&1; grep -E "fwd\+bwd" "$w/moe-train.log" ;;
    serve-profile) timeout 150 python3 -m warpforge.serve.bench --shape llama3-8b --batch 64 --context 1024 --profile \
                     > "$w/serve-profile-b64.log" 2>&1; grep -A30 "^profile" "$w/serve-profile-b64.log" | cut -c1-160 ;;
    gpt-graphs-test) timeout 120 python3 -m pytest -q -m gpu tests/gpt/test_gpu_graphs.py > "$w/gpt-graphs-test.log" 2>&1; tail -n 3 "$w/gpt-graphs-test.log" ;;
    tune-norm) timeout 240 python3 -m warpforge tune norm --out "$w/tune_norm.json" > "$w/tune_norm.log" 2>&1 ;;
    tune-evoformer) timeout 300 python3 -m warpforge tune evoformer --out "$w/tune_evoformer.json" > "$w/tune_evoformer.log" 2>&1 ;;
    tune-sparse) timeout 200 python3 -m warpforge tune sparse --s 65536 --out "$w/tune_sparse.json" > "$w/tune_sparse.log" 2>&1 ;;
    gpt-long) for att in sparse mha; do  # the long preset's sparse attention beside its dense twin, same steps
                SKIP_PREPARE=1 WARPFORGE_CACHE=$PWD/.wfcache timeout 150 bash scripts/gpt_train_check.sh long 3.0 \
                  "$w/gpt-long-$att.json" --attention=$att --max_steps=150 --eval_every=75 --compile=off \
                  --max-minutes 1.6 > "$w/gpt-long-$att.log" 2>&1; tail -2 "$w/gpt-long-$att.log"; done ;;
    mla-gluon) timeout 90 python3 scripts/check_mla_gluon.py --out "$w/mla_gluon_check.json" > "$w/mla_gluon_check.log" 2>&1 &&
               timeout 120 python3 scripts/bench_mla_gluon.py --out "$w/mla_gluon.json" > "$w/mla_gluon.log" 2>&1
               tail -14 "$w/mla_gluon.log" ;;
    mla-gluon-before) (cd .before && PYTHONPATH=$PWD timeout 120 python3 scripts/bench_mla_gluon.py --out "$w/mla_gluon_before.json" \
                        > "$w/mla_gluon_before.log" 2>&1); tail -13 "$w/mla_gluon_before.log" ;;
    attention-bwd-knobs) timeout 70 python3 -m pytest -q -m gpu tests/attention/test_attention_gluon_bwd.py -k knobs > "$w/bwd_knob_tests.log" 2>&1; tail -n 15 "$w/bwd_knob_tests.log"
                         timeout 125 python3 scripts/bench_attention_gluon.py --bwd --bwd-sweep --bwd-cases 0,1,3 --json "$w/attention_gluon_bwd_sweep.json" > "$w/bwd_sweep.log" 2>&1; cat "$w/bwd_sweep.log" ;;
    evoformer-bench) SKIP_TESTS=1 MATCH='row|triangle' timeout 260 bash scripts/gpu_check.sh "$w/bench" evoformer > "$w/$step.log" 2>&1
                     grep -E "warpforge|flex" "$w/bench/bench-evoformer.log" | tail -16 ;;
    evo-quick) # the least a short call can check: tests/evoformer on the GPU, then the row forward A/B (evo_fwd_ab)
               timeout 150 python3 -m pytest -q $par -m gpu tests/evoformer > "$w/evo-quick-tests.log" 2>&1; tail -n 2 "$w/evo-quick-tests.log"
               tar czf "$out/all.tgz" -C "$w" .
               evo_fwd_ab 'row fwd s' ;;
    evo-fwd-ab) evo_fwd_ab '(row|triangle) fwd [sr]' ;;  # the row and triangle forwards' A/B alone (after evoformer-full's tests)
    evo-clamp) # the backward's clamped exponent (a huge-masked row's NaN guard, one FMNMX a score): row / triangle
               # fwd+bwd at .before (the commit without it) and here, same process order, bench_compare's 3%
               SKIP_TESTS=1 COMPARE=$PWD/.before MATCH='^(row|triangle) fwd\+bwd' timeout 200 bash scripts/gpu_check.sh "$w/cmp" evoformer \
                 > "$w/$step.log" 2>&1; cat "$w/cmp/compare-evoformer.log" ;;
    evoformer-full) # issue 16 on the H200: the GPU tests, then every case of the family bench (results/h200/evoformer.json)
                    timeout 240 python3 -m pytest -q $par -k "not compiles" tests/evoformer > "$w/tests-evoformer.log" 2>&1; tail -n 1 "$w/tests-evoformer.log"
                    SKIP_TESTS=1 timeout 400 bash scripts/gpu_check.sh "$w/bench" evoformer > "$w/$step.log" 2>&1
                    grep -E "warpforge|flex" "$w/bench/bench-evoformer.log" | tail -24 ;;
    evoformer-gluon) # issue 16: the Gluon kernels (fwd, dk/dv, dq + pair bias): their tests (a hang or a failure stops here),
                     # the per-kernel probe (portable vs Gluon), the whole family bench and tests/evoformer with them on
                     export WARPFORGE_EVO_GLUON=1 WARPFORGE_EVO_GLUON_FWD=1 WARPFORGE_EVO_GLUON_DKDV=1
                     # (its sm_90 compile tests run on any CPU: skipped here, they took most of session 32's 150 s)
                     if timeout 200 python3 -m pytest -q -x -rf -k "not compiles" tests/evoformer/test_evoformer_gluon.py > "$w/evo-gluon-tests.log" 2>&1; then
                       tail -n 3 "$w/evo-gluon-tests.log"
                       for sh in row triangle; do timeout 100 python3 scripts/probe_evoformer.py --shape $sh > "$w/probe-$sh.log" 2>&1
                         cat "$w/probe-$sh.log"; done
                       WARPFORGE_EVO_GLUON_FWD_CONSUMERS=3 timeout 100 python3 scripts/probe_evoformer.py --shape row \
                         > "$w/probe-row-3consumers.log" 2>&1; grep gluon "$w/probe-row-3consumers.log"
                       SKIP_TESTS=1 timeout 260 bash scripts/gpu_check.sh "$w/bench" evoformer > "$w/evo-bench.log" 2>&1
                       grep -E "warpforge|flex" "$w/bench/bench-evoformer.log" | tail -24
                       timeout 150 python3 -m pytest -q $par -rf -k "not compiles" tests/evoformer > "$w/tests-evoformer.log" 2>&1
                       grep -E "FAILED|passed|failed" "$w/tests-evoformer.log" | tail -12
                     else tail -n 40 "$w/evo-gluon-tests.log"; fi ;;
    evoformer-gluon-probe) # the Gluon kernels' tests, then the per-kernel probe (portable vs Gluon; fwd with 2 and 3 consumers)
                     export WARPFORGE_EVO_GLUON=1 WARPFORGE_EVO_GLUON_FWD=1 WARPFORGE_EVO_GLUON_DKDV=1
                     timeout 200 python3 -m pytest -q -x -rf -k "not compiles" tests/evoformer/test_evoformer_gluon.py > "$w/evo-gluon-tests.log" 2>&1
                     tail -n 3 "$w/evo-gluon-tests.log"
                     for sh in row triangle; do timeout 100 python3 scripts/probe_evoformer.py --shape $sh > "$w/probe-$sh.log" 2>&1
                       cat "$w/probe-$sh.log"; done
                     WARPFORGE_EVO_GLUON_FWD_CONSUMERS=3 timeout 100 python3 scripts/probe_evoformer.py --shape row \
                       > "$w/probe-row-3consumers.log" 2>&1; grep gluon "$w/probe-row-3consumers.log"
                     unset WARPFORGE_EVO_GLUON WARPFORGE_EVO_GLUON_FWD WARPFORGE_EVO_GLUON_DKDV ;;
    evoformer-profile) # where a triangle / row fwd+bwd call's time goes: wall beside kernels (warpforge, flex), then the host
                     for m in "triangle fwd\+bwd" "row fwd\+bwd"; do
                       timeout 120 python3 scripts/profile_case.py --family evoformer --match "$m" --impl "warpforge|flex" \
                         --iters 20 --top 14 > "$w/profile-${m%% *}.log" 2>&1; grep -B1 -A15 "a call" "$w/profile-${m%% *}.log"; done
                     timeout 120 python3 scripts/profile_case.py --family evoformer --match "triangle fwd\+bwd" --impl warpforge \
                       --host --iters 20 --top 25 > "$w/profile-host.log" 2>&1; head -c 6000 "$w/profile-host.log" ;;
    evo-host) # where an eager Evoformer fwd+bwd call's host time goes (scripts/evo_host_breakdown.py), triangle then row
                     for sh in triangle row; do timeout 120 python3 scripts/evo_host_breakdown.py --shape $sh > "$w/evo-host-$sh.log" 2>&1
                       cat "$w/evo-host-$sh.log"; done ;;
    evo-lean) # issue 16's triangle line (host-bound): the leaner backward (one launch for the log2 biases, one for the partials'
              # sum and cast) against .before in the same call: tests/evoformer, the host breakdown, the bench's row and triangle
              timeout 100 python3 -m pytest -q $par -rf -k "not compiles" tests/evoformer > "$w/tests-evoformer.log" 2>&1
              grep -E "FAILED|passed|failed" "$w/tests-evoformer.log" | tail -8
              timeout 60 python3 scripts/evo_host_breakdown.py --shape triangle --reps 100 > "$w/evo-host-triangle.log" 2>&1
              cat "$w/evo-host-triangle.log"
              COMPARE=$PWD/.before SKIP_TESTS=1 MATCH='row|triangle' timeout 200 bash scripts/gpu_check.sh "$w/cmp" evoformer \
                > "$w/$step.log" 2>&1; grep -E "warpforge|flex" "$w/cmp/bench-before-evoformer.log" "$w/cmp/bench-evoformer.log" | grep "fwd+bwd" ;;
    evo-groups) # the merged dq + pair-bias pass's MSA-row groups at the triangle shape: the default (G 11, two waves) vs one wave
                for g in 0 5 11; do timeout 80 python3 scripts/probe_evoformer.py --shape triangle $([ $g != 0 ] && echo --groups $g) \
                  > "$w/probe-triangle-g$g.log" 2>&1; echo "G $g"; grep -E "^gluon" "$w/probe-triangle-g$g.log"; done ;;
    evoformer-default) # issue 16 with the tables' defaults (configs: the dq + pair-bias Gluon pass on): tests/evoformer, then the bench's row and triangle
                     # (the sm_90 compile tests run on any CPU: skipped on the device)
                     timeout 240 python3 -m pytest -q $par -rf -k "not compiles" tests/evoformer > "$w/tests-evoformer.log" 2>&1
                     grep -E "FAILED|passed|failed" "$w/tests-evoformer.log" | tail -12
                     SKIP_TESTS=1 MATCH='row|triangle' timeout 150 bash scripts/gpu_check.sh "$w/bench" evoformer > "$w/$step.log" 2>&1
                     grep -E "warpforge|flex" "$w/bench/bench-evoformer.log" | tail -16 ;;
    evoformer-sweep) # the d32 tiles (session 31 chose them on an H100): forward, dq and pair-bias passes, capped tiles too
                     timeout 240 python3 -m warpforge tune evoformer --shapes row --parts fwd,dq,dbias \
                       --out "$w/tune_evoformer.json" > "$w/tune_evoformer.log" 2>&1
                     for p in "fwd " "dq swept" "dbias swept"; do grep "$p" "$w/tune_evoformer.log" | sort -t: -k2 -n | head -n 3; done ;;
    evoformer-sweep-extra) # the d 8/16 tiles (extra-MSA stack: 0.33x Flex fwd+bwd on the H200 in session 11) with the d32 levers
                     timeout 420 python3 -m warpforge tune evoformer --shapes extra --parts fwd,dkdv,dq \
                       --out "$w/tune_evoformer_extra.json" > "$w/tune_evoformer_extra.log" 2>&1
                     for p in "fwd " "dkdv swept" "dq swept"; do grep "$p" "$w/tune_evoformer_extra.log" | sort -t: -k2 -n | head -n 3; done ;;
    attention-bwd-check) timeout 70 python3 -m pytest -q $par -m gpu tests/attention/test_attention_gluon_bwd.py -k "not knobs" > "$w/bwd_tests.log" 2>&1; tail -n 3 "$w/bwd_tests.log"
                         timeout 75 python3 scripts/bench_attention_gluon.py --bwd --json "$w/attention_gluon_bwd.json" > "$w/bwd_bench.log" 2>&1
                         grep -E "^fwd|gluon\+gluon |gluon\+portable|cudnn " "$w/bwd_bench.log" ;;
    norms-eager) timeout 55 python3 -m warpforge tune norm --shapes 16384x768 --budget 45 --out "$w/tune_norm.json" > "$w/tune_norm.log" 2>&1
                 timeout 30 python3 -m warpforge tune norm --eager-profile > "$w/eager_profile.log" 2>&1
                 timeout 65 python3 -m warpforge bench --family fused --match "norm fwd" --json "$w/fused-norms.json" > "$w/bench-norms.log" 2>&1
                 tail -n 26 "$w/tune_norm.log"; head -n 12 "$w/eager_profile.log"; grep "per fwd+bwd call" "$w/eager_profile.log"
                 grep -E "norm fwd" "$w/bench-norms.log" | tail -n 30 ;;
    norms-eager-profile) timeout 110 python3 -m warpforge tune norm --eager-profile > "$w/eager_profile2.log" 2>&1
                         head -n 80 "$w/eager_profile2.log"; grep -A 31 "torch.profiler, rms_norm" "$w/eager_profile2.log" ;;
    attention-gqa-window) timeout 200 python3 -m pytest -q -m gpu tests/attention/test_attention_gluon_window.py > "$w/window_tests.log" 2>&1; tail -n 15 "$w/window_tests.log"
                          timeout 115 python3 scripts/bench_attention_gluon.py --gqa-window --json "$w/attention_gqa_window.json" > "$w/gqa_window.log" 2>&1; cat "$w/gqa_window.log" ;;
    window-d64) timeout 200 python3 -m pytest -q -m gpu tests/attention/test_attention_gluon_window.py -k "group_split and 64" \
                  > "$w/window_d64_tests.log" 2>&1; tail -n 15 "$w/window_d64_tests.log" ;;
    gpu-tests-*) timeout 240 python3 -m pytest -q -m gpu $par $(echo "${step#gpu-tests-}" | tr ',' '\n' | sed 's|^|tests/|') \
                   > "$w/$(echo "$step" | tr '/,' '__').log" 2>&1; tail -n 15 "$w/$(echo "$step" | tr '/,' '__').log" ;;
    # the paged Gluon kernel (issue 18): its GPU tests and the family's quantised / graph ones (which take it on the
    # H200), then sweeps: FP8 at 16k and 4k beside the bf16 anchor, FP4 at 4k (16k's quantiser needs ~56 GB)
    paged-gluon-tests) paged_gluon_tests ;;
    paged-fp4-gluon) paged_gluon_tests
                     timeout 90 python3 -m warpforge tune paged --L 4096 --formats nvfp4gluon,mxfp4gluon --out "$w/tune_paged_fp4_gluon_4k.json" > "$w/tune_paged_fp4_gluon_4k.log" 2>&1
                     tail -n 40 "$w/tune_paged_fp4_gluon_4k.log" ;;
    s41) # session 41 when the device time is short: the GPU tests of what changed since the last GPU run first (the
         # paged Gluon kernel's FP4 pointers and pitches, per-page V scales relative to the first page, the MLA rows16
         # kernel's relative chunk scales), then the paged family bench (both FP4 layouts, one process)
         timeout 240 python3 -m pytest -q -m gpu tests/paged/test_paged_gluon.py tests/paged/test_paged_split_scales.py \
           tests/mla/test_mla_rows16.py -k "not long" > "$w/s41-tests.log" 2>&1
         grep -E "FAILED|passed|failed" "$w/s41-tests.log" | tail -n 12
         tar czf "$out/all.tgz" -C "$w" .
         SKIP_TESTS=1 timeout 300 bash scripts/gpu_check.sh "$w/bench" paged > "$w/bench-paged.log" 2>&1
         grep -E "warpforge|sdpa" "$w/bench-paged.log" | tail -n 20 ;;
    s43m) # session 43: the MLA Gluon kernel's FP4 word decode (natural column order now: no permuted Q / output) on
          # its GPU tests, then the in-kernel / pass sweep at h_q 128 (the crossover api.quantized_in_kernel encodes)
          timeout 200 python3 -m pytest -q -m gpu tests/mla/test_mla_gluon.py -k "quantized or capture or garbage" \
            > "$w/s43-mla-tests.log" 2>&1; grep -E "FAILED|passed|failed" "$w/s43-mla-tests.log" | tail -n 12
          tar czf "$out/all.tgz" -C "$w" .
          for v in 1 0; do WARPFORGE_MLA_GLUON_IN_KERNEL=$v timeout 120 python3 -m warpforge bench --family mla \
            --match 'h128 s_q1 L[0-9]+k (bf16|nvfp4|mxfp4)' --json "$w/mla-h128-fp4-inkernel$v.json" \
            > "$w/mla-h128-fp4-inkernel$v.log" 2>&1; grep -E "warpforge  " "$w/mla-h128-fp4-inkernel$v.log"; done ;;
    s43t) # session 43: the portable kernels' FP4 word reads (paged, MLA) and serve's FP4 layouts under graphs
          timeout 300 python3 -m pytest -q -m gpu tests/paged/test_paged_decode.py tests/mla/test_mla_decode.py \
            tests/serve/test_gpu.py > "$w/s43-tests.log" 2>&1; grep -E "FAILED|passed|failed" "$w/s43-tests.log" | tail -n 12 ;;
    s43q) # session 43: the paged Gluon kernel with q's fragments from shared memory (PagedCfg.q_shared: the NVFP4
          # pair 182 -> 168 registers, three programs an SM), both FP4 formats and layouts, 2 / 3 slots, L 4k and 16k
          for L in 4096 16384; do timeout 120 python3 scripts/probe_paged_gluon.py --formats nvfp4,mxfp4 --slots 2,3 \
            --maxnreg 0 --planar --q-shared 0,1 --L $L; done > "$w/probe_q_shared.log" 2>&1; grep -v "^$" "$w/probe_q_shared.log" ;;
    s43d) # session 43: the NVFP4 pair's wrong output under graph replay (scripts/diag_fp4_pair.py: poisoned free memory,
          # the bench's order, the V scale doubled, eager, a recapture, the bare launch at three copy widths), MXFP4
          # beside it (~150 s); SANITIZE=1 then runs it under compute-sanitizer memcheck (up to 240 s more)
          for f in nvfp4 mxfp4; do timeout 90 python3 scripts/diag_fp4_pair.py --fmt $f; done > "$w/diag_fp4_pair.log" 2>&1
          cat "$w/diag_fp4_pair.log" | tail -n 40
          tar czf "$out/all.tgz" -C "$w" .
          cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
          if [ "${SANITIZE:-0}" = 1 ] && [ -n "$cs" ]; then timeout 240 "$cs" --tool memcheck --print-limit 20 python3 scripts/diag_fp4_pair.py \
            > "$w/diag_fp4_pair_memcheck.log" 2>&1; grep -E "Invalid|ERROR SUMMARY|1-cos" "$w/diag_fp4_pair_memcheck.log" | head -n 30
          else echo "memcheck skipped (SANITIZE=1 runs it; compute-sanitizer: ${cs:-none})"; fi ;;
    s42) # session 42: s41's GPU tests, then the FP4 probe (paged-split's, both layouts) at 4k: 2 and 3 slots, capped at 168
         # registers or not (the pair's 16-byte .cg copies may let 3 slots pay where the rows' 8-byte .ca did not:
         # NOTES session 20; the pair compiles to 182 registers at 2 slots, 2 programs an SM, and to 168 at 3)
         timeout 240 python3 -m pytest -q -m gpu tests/paged/test_paged_gluon.py tests/paged/test_paged_split_scales.py \
           tests/mla/test_mla_rows16.py -k "not long" > "$w/s41-tests.log" 2>&1
         grep -E "FAILED|passed|failed" "$w/s41-tests.log" | tail -n 12
         tar czf "$out/all.tgz" -C "$w" .
         { timeout 120 python3 scripts/probe_paged_gluon.py --formats nvfp4 --slots 2,3 --maxnreg 0,168 --planar --L 4096
           timeout 70 python3 scripts/probe_paged_gluon.py --formats mxfp4 --slots 2,3 --maxnreg 0 --planar --L 4096
           # 64-token steps under a 128-register cap: four programs an SM (~100 B spilled, none in the loop's top ten)
           timeout 90 python3 scripts/probe_paged_gluon.py --formats nvfp4 --block-n 64 --slots 3,4 --maxnreg 0,128 \
             --planar --L 4096
         } > "$w/probe_paged_split.log" 2>&1; grep -v "^$" "$w/probe_paged_split.log" ;;
    s42s) # s42 when little device time is left: the tests, then NVFP4's probe at 4k alone
          timeout 230 python3 -m pytest -q -m gpu tests/paged/test_paged_gluon.py tests/paged/test_paged_split_scales.py \
            tests/mla/test_mla_rows16.py -k "not long" > "$w/s41-tests.log" 2>&1
          grep -E "FAILED|passed|failed" "$w/s41-tests.log" | tail -n 12
          tar czf "$out/all.tgz" -C "$w" .
          timeout 110 python3 scripts/probe_paged_gluon.py --formats nvfp4 --slots 2,3 --maxnreg 0,168 --planar --L 4096 \
            > "$w/probe_paged_split.log" 2>&1; grep -v "^$" "$w/probe_paged_split.log" ;;
    s42b) # session 42's second call: the paged family bench (on the H200: results/h200/paged.json), then paged-split's
          # FP8 probe at 4k (a register cap, 64-token steps)
          SKIP_TESTS=1 timeout 300 bash scripts/gpu_check.sh "$w/bench" paged > "$w/bench-paged.log" 2>&1
          grep -E "warpforge|sdpa" "$w/bench-paged.log" | tail -n 20
          tar czf "$out/all.tgz" -C "$w" .
          for n in 128 64; do timeout 60 python3 scripts/probe_paged_gluon.py --formats fp8 --slots 2,3,4 --maxnreg 0,128 \
            --block-n $n --L 4096; done > "$w/probe_paged_fp8.log" 2>&1; grep -v "^$" "$w/probe_paged_fp8.log" ;;
    paged-split) # issue 18: FP4 caches as (values, block scales) pairs: the probe on the same bytes in both layouts (16 / 4k
                 # tokens; the pair compiles to 182 registers, 2 programs an SM, the rows to 168, 3: both also capped at
                 # 168), FP8 at 4k with a register cap / 64-token steps (4 programs an SM), the family bench (every case:
                 # both FP4 layouts beside bf16 and fp8, one process), then the GPU tests (the tar after each part)
                 for L in 16384 4096; do timeout 100 python3 scripts/probe_paged_gluon.py --formats nvfp4,mxfp4 --slots 2 \
                   --maxnreg 0,168 --planar --L $L; done > "$w/probe_paged_split.log" 2>&1; grep -v "^$" "$w/probe_paged_split.log"
                 for n in 128 64; do timeout 60 python3 scripts/probe_paged_gluon.py --formats fp8 --slots 2,3,4 --maxnreg 0,128 \
                   --block-n $n --L 4096; done > "$w/probe_paged_fp8.log" 2>&1; grep -v "^$" "$w/probe_paged_fp8.log"
                 tar czf "$out/all.tgz" -C "$w" .
                 SKIP_TESTS=1 timeout 300 bash scripts/gpu_check.sh "$w/bench" paged > "$w/bench-paged.log" 2>&1
                 grep -E "warpforge|sdpa" "$w/bench-paged.log" | tail -n 20
                 tar czf "$out/all.tgz" -C "$w" .
                 timeout 200 python3 -m pytest -q tests/paged/test_paged_gluon.py tests/paged/test_paged_split_scales.py \
                   > "$w/paged-split-tests.log" 2>&1; tail -n 4 "$w/paged-split-tests.log" ;;
    probe-paged) timeout 200 python3 scripts/probe_paged_gluon.py ${PROBE_ARGS:-} > "$w/probe_paged.log" 2>&1; cat "$w/probe_paged.log" | tail -n 30 ;;
    probe-slots) for f in fp8 nvfp4; do timeout 60 python3 scripts/probe_slots_bytes.py --fmt $f > "$w/probe_slots_$f.log" 2>&1; tail -n 8 "$w/probe_slots_$f.log"; done ;;
    paged-fp8-4k) timeout 90 python3 -m warpforge tune paged --L 4096 --formats fp8gluon --out "$w/tune_paged_fp8_gluon_4k.json" > "$w/tune_paged_fp8_gluon_4k.log" 2>&1
                  tail -n 20 "$w/tune_paged_fp8_gluon_4k.log" ;;
    paged-gluon) paged_gluon_tests
                 timeout 150 python3 -m warpforge tune paged --L 16384 --formats fp8gluon,bf16 --bf16-tiles 2 --out "$w/tune_paged_gluon_16k.json" > "$w/tune_paged_gluon_16k.log" 2>&1
                 timeout 80 python3 -m warpforge tune paged --L 4096 --formats fp8gluon,bf16 --bf16-tiles 2 --out "$w/tune_paged_gluon_4k.json" > "$w/tune_paged_gluon_4k.log" 2>&1
                 tail -n 50 "$w"/tune_paged_gluon_16k.log "$w"/tune_paged_gluon_4k.log ;;
    paged-fp8mma) timeout 70 python3 -m pytest -q tests/paged/test_paged_decode.py -k "fp8_mma or quantised_cache or look_ahead" > "$w/paged-fp8mma-tests.log" 2>&1; tail -n 3 "$w/paged-fp8mma-tests.log"
                  timeout 130 python3 -m warpforge tune paged --L 16384 --formats bf16,fp8,fp8mma --bf16-tiles 2 --out "$w/tune_paged_fp8mma_16k.json" > "$w/tune_paged_fp8mma_16k.log" 2>&1
                  tail -n 30 "$w/tune_paged_fp8mma_16k.log" ;;
    evoformer-fused-bench) for v in 0 1; do  # the two-pass backward (0) and the fused one (1), each beside Flex
                             WARPFORGE_EVO_BWD_FUSED=$v SKIP_TESTS=1 MATCH='row fwd\+bwd' timeout 120 bash scripts/gpu_check.sh \
                               "$w/evo-fused$v" evoformer > "$w/$step$v.log" 2>&1; grep -E "row fwd\+bwd" "$w/$step$v.log"; done ;;
    evoformer-fused) timeout 120 python3 -m pytest -q $par tests/evoformer > "$w/tests-evoformer.log" 2>&1; tail -n 2 "$w/tests-evoformer.log"
                     timeout 200 python3 -m warpforge tune evoformer --shapes row --parts fused,dkdv --out "$w/tune_evoformer_fused.json" > "$w/tune_evoformer_fused.log" 2>&1
                     sort -t: -k2 -n "$w/tune_evoformer_fused.log" | head -n 12 ;;
    attention-gluon) timeout -k 5 90 python3 scripts/bench_attention_gluon.py > "$w/attention_gluon.log" 2>&1; tail -12 "$w/attention_gluon.log"
                     timeout -k 5 100 python3 -m pytest -q -x -m gpu tests/attention/test_attention_gluon.py > "$w/attention_gluon_tests.log" 2>&1
                     tail -3 "$w/attention_gluon_tests.log" ;;
    attention-head-group) for g in ${HEAD_GROUPS:-1 2}; do  # the backward's program order (configs.GLUON_BWD_HEAD_GROUP)
                            echo "head group $g"; WARPFORGE_ATTN_GLUON_BWD_HEAD_GROUP=$g timeout 90 python3 \
                              scripts/bench_attention_gluon.py --bwd 2>&1 | grep -E "^fwd\+bwd|gluon\+gluon|cudnn  "; done \
                            > "$w/attention-head-group.log" 2>&1; cat "$w/attention-head-group.log" ;;
    key-rows-tests) timeout 150 python3 -m pytest -q -m gpu tests/attention/test_attention_gluon_bwd.py -k "knobs or key_rows" \
                      > "$w/key_rows_tests.log" 2>&1; tail -n 5 "$w/key_rows_tests.log"  # the backward's KEY_ROWS step
                    WARPFORGE_SPARSE_GLUON_BWD=64,3,64,1,1,0,4,2 timeout 120 python3 -m pytest -q -m gpu tests/sparse \
                      > "$w/key_rows_sparse_tests.log" 2>&1; tail -n 5 "$w/key_rows_sparse_tests.log" ;;
    key-rows-bench) timeout 150 python3 scripts/bench_attention_gluon.py --bwd --key-rows --bwd-cases ${KR_CASES:-0,1,4} \
                      > "$w/key_rows_bench.log" 2>&1; grep -E "fwd\+bwd b|gluon\+gluon|cudnn|FAILED" "$w/key_rows_bench.log" | cut -c1-150 ;;
    attention-gluon-bwd) timeout 75 python3 scripts/bench_attention_gluon.py --bwd --json "$w/attention_gluon_bwd.json" > "$w/bwd_bench.log" 2>&1
                         timeout 115 python3 -m pytest -q -m gpu tests/attention/test_attention_gluon_bwd.py > "$w/bwd_tests.log" 2>&1
                         tail -25 "$w/bwd_bench.log"; tail -3 "$w/bwd_tests.log" ;;
    attention-fp8-gluon) timeout 170 python3 -m pytest -q $par -m gpu tests/attention/test_attention_fp8_gluon.py > "$w/fp8_gluon_tests.log" 2>&1
                         timeout 80 python3 scripts/bench_attention_fp8_gluon.py --json "$w/fp8_gluon.json" > "$w/fp8_gluon.log" 2>&1
                         tail -3 "$w/fp8_gluon_tests.log"; tail -30 "$w/fp8_gluon.log" ;;
    attention-gluon-sweep) timeout 140 python3 scripts/bench_attention_gluon.py --sweep-only > "$w/attention_gluon_sweep.log" 2>&1
                           tail -40 "$w/attention_gluon_sweep.log" ;;
    norms) timeout 100 python3 -m warpforge bench --family fused --match "norm fwd" --json "$w/fused-norms.json" > "$w/bench-norms.log" 2>&1
           timeout 60 python3 -m warpforge tune norm --shapes 16384x768 --budget 45 --out "$w/tune_norm.json" > "$w/tune_norm.log" 2>&1
           tail -20 "$w/bench-norms.log" ;;
    gpt-profile) # issue 20's step line: the gpt2-124m step kernel by kernel, ours beside torch.compile's (no graphs)
                 timeout 240 python3 scripts/profile_case.py --family gpt --match "s1024$" --impl "^(warpforge|torch.compile)$" \
                   --iters 5 --top 45 > "$w/gpt-profile.log" 2>&1; grep -E -A3 "a call" "$w/gpt-profile.log" | head -20 ;;
    gpt) timeout 200 python3 -m warpforge bench --family gpt --quick --json "$w/gpt.json" > "$w/gpt.log" 2>&1 ;;
    # the Gluon kernel for <= 16 rows over FP8 caches: its GPU tests, then h_q 16 bf16 / fp8 at every L (the bar's
    # ratio, one process), and fp8 at 4k / 16k on the portable kernel
    mla-rows16) timeout 200 python3 -m pytest -q -m gpu tests/mla/test_mla_rows16.py > "$w/mla-rows16-tests.log" 2>&1
                tail -n 3 "$w/mla-rows16-tests.log"
                timeout 200 python3 -m warpforge bench --family mla --match 'h16 s_q1 L[0-9]+k (bf16|fp8)' \
                  --json "$w/mla-h16.json" > "$w/mla-h16.log" 2>&1; grep -E "warpforge  " "$w/mla-h16.log"
                WARPFORGE_MLA_GLUON_ROWS16=0 timeout 100 python3 -m warpforge bench --family mla --match 'h16 s_q1 L(4k|16k) fp8' \
                  --json "$w/mla-h16-portable.json" > "$w/mla-h16-portable.log" 2>&1; grep -E "warpforge  " "$w/mla-h16-portable.log" ;;
    # experiment branches exported into .branch-NAME (`git archive BRANCH | tar -x -C .head/.branch-NAME`): each one's
    # rows16 GPU tests and the same probe, beside this checkout's in the same call
    branch-rows16) for d in .branch-*; do
                     (cd "$d" && PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -m gpu tests/mla/test_mla_rows16.py \
                        > "$w/$d-rows16-tests.log" 2>&1; echo "$d"; tail -n 2 "$w/$d-rows16-tests.log"
                      PYTHONPATH=$PWD timeout 150 python3 scripts/probe_mla_rows16.py $PROBE_ARGS > "$w/$d-probe-rows16.log" 2>&1
                      grep -v Warn "$w/$d-probe-rows16.log")
                   done ;;
    # the same probe only, in each exported variant (constants changed on a scratch branch)
    branch-probe) for d in .branch-*; do
                    (cd "$d" && echo "$d" && PYTHONPATH=$PWD timeout 120 python3 scripts/probe_mla_rows16.py $PROBE_ARGS \
                       > "$w/$d-probe-rows16.log" 2>&1; grep -v Warn "$w/$d-probe-rows16.log")
                  done ;;
    # the rows16 ablations (copies alone, math alone, ...) from the scratch branch s22-rows16-ablate exported into
    # .ablate (`git archive s22-rows16-ablate | tar -x -C .head/.ablate`)
    ablate-rows16) (cd .ablate && PYTHONPATH=$PWD timeout 150 python3 scripts/probe_mla_rows16.py --L 4096,16384 \
                      --slots 2 --splits 2 --ablate 0,1,2,4,8 > "$w/ablate-rows16.log" 2>&1
                    grep -v Warn "$w/ablate-rows16.log") ;;
    probe-mma8) timeout 60 python3 scripts/probe_mma_sync_fp8.py > "$w/probe-mma8.log" 2>&1; grep -v Warn "$w/probe-mma8.log" ;;
    probe-rows16) timeout 240 python3 scripts/probe_mla_rows16.py $PROBE_ARGS > "$w/probe-rows16.log" 2>&1; cat "$w/probe-rows16.log" ;;
    mla-tests) timeout 200 python3 -m pytest -q $par -m gpu tests/mla > "$w/mla-tests.log" 2>&1; tail -n 3 "$w/mla-tests.log" ;;
    monarch-ab) # issue 17: the GPU tests (the table's settings and the knobs), then the family bench once a setting
                # (WARPFORGE_MONARCH_RUNS, _TMA_STORE, _WGRAD_BLAS; the table's own last), each its own process
                timeout 150 python3 -m pytest -q -m gpu tests/monarch > "$w/monarch-tests.log" 2>&1; tail -n 3 "$w/monarch-tests.log"
                for f in ${MONARCH_KNOBS:-110}; do
                  WARPFORGE_MONARCH_RUNS=${f:0:1} WARPFORGE_MONARCH_TMA_STORE=${f:1:1} WARPFORGE_MONARCH_WGRAD_BLAS=${f:2:1} \
                    SKIP_TESTS=1 timeout 150 bash scripts/gpu_check.sh "$w/monarch-$f" monarch > "$w/monarch-$f.log" 2>&1
                  echo "runs ${f:0:1} tma_store ${f:1:1} wgrad_blas ${f:2:1}"; grep -E "warpforge  " "$w/monarch-$f.log" | tail -8; done
                SKIP_TESTS=1 timeout 150 bash scripts/gpu_check.sh "$w/monarch" monarch > "$w/monarch.log" 2>&1
                echo "the table's settings"; grep -E "warpforge  " "$w/monarch.log" | tail -8 ;;
    sparse-gluon) timeout 150 python3 -m pytest -q -m gpu tests/sparse/test_sparse_gluon.py > "$w/sparse-gluon-tests.log" 2>&1
                  tail -n 3 "$w/sparse-gluon-tests.log"
                  timeout 120 python3 scripts/bench_sparse_gluon.py > "$w/sparse-fwd.log" 2>&1; tail -n 3 "$w/sparse-fwd.log"
                  timeout 150 python3 scripts/bench_sparse_gluon.py --bwd > "$w/sparse-fwdbwd.log" 2>&1
                  tail -n 3 "$w/sparse-fwdbwd.log" ;;
    sparse-sweep) for kv in ${SPARSE_FWD_KNOBS:-64,4,1,0 64,4,1,1 128,2,1,1 128,2,0,0}; do  # the Gluon forward's knobs at 64k
                    echo "fwd $kv"; WARPFORGE_SPARSE_GLUON_FWD=$kv timeout 60 python3 scripts/bench_sparse_gluon.py --s ${SWEEP_S:-65536} \
                      --gluon-only 2>&1 | tail -n 1; done > "$w/sparse-sweep.log" 2>&1
                  for kv in ${SPARSE_BWD_KNOBS:-64,3,64,1,1,0,4,0 64,3,64,1,1,0,4,1 64,3,64,1,1,0,4,2 64,3,64,1,1,0,1,2}; do  # the backward's, fwd+bwd
                    echo "bwd $kv"; WARPFORGE_SPARSE_GLUON_BWD=$kv timeout 60 python3 scripts/bench_sparse_gluon.py --s ${SWEEP_S:-65536} \
                      --bwd --gluon-only 2>&1 | tail -n 1; done >> "$w/sparse-sweep.log" 2>&1; cat "$w/sparse-sweep.log" ;;
    sparse-locality) for pat in index local; do  # what L2 locality is worth: the same work, scattered or nearest blocks
                       timeout 150 python3 scripts/bench_sparse_gluon.py --s 65536,131072,262144 --bwd --gluon-only \
                         --pattern $pat 2>&1 | grep "^s "; done > "$w/sparse-locality.log" 2>&1; cat "$w/sparse-locality.log" ;;
    host-profile) timeout 120 python3 scripts/profile_case.py --host --iters 20 --top 35 --family ${HOST_FAMILY:-sparse} \
                    --match "${HOST_MATCH:-s16k}" --impl "${HOST_IMPL:-^warpforge$}" > "$w/host-profile.log" 2>&1
                  grep -E "enqueue" "$w/host-profile.log" ;;
    sparse-profile) WARPFORGE_SPARSE_GLUON=${WARPFORGE_SPARSE_GLUON:-1} timeout 150 python3 scripts/profile_case.py --family sparse \
                      --match "${PROFILE_MATCH:-s64k top16}" --impl '^(warpforge|flex)$' --iters 10 > "$w/sparse-profile.log" 2>&1
                    grep -v Warn "$w/sparse-profile.log" | head -n 45 ;;
    multi-gpu-tests) timeout 300 python3 -m pytest -q -m gpu tests/distributed > "$w/multi-gpu-tests.log" 2>&1; tail -n 5 "$w/multi-gpu-tests.log" ;;
    multi-gpu-bench) timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node $(nvidia-smi -L | wc -l) \
                       scripts/bench_multi_gpu.py --out "$w/multi-gpu.json" > "$w/multi-gpu-bench.log" 2>&1; tail -n 4 "$w/multi-gpu-bench.log" ;;
    gpt-ddp-weak) DDP_ARGS="--batch-scaling weak" timeout 400 bash scripts/gpt_ddp_check.sh "$w" gpt2-124m 60 > "$w/gpt-ddp-weak.log" 2>&1; tail -n 2 "$w/gpt-ddp-weak.log" ;;
    bench-*) f=${step#bench-}; SKIP_TESTS=1 timeout ${BENCH_TIMEOUT:-240} bash scripts/gpu_check.sh "$w/bench" ${f//,/ } > "$w/$step.log" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "$step: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$w/steps.txt"
  tar czf "$out/all.tgz" -C "$w" .  # after every step: a call cut by the device's limit still returns the steps done
done
