#!/usr/bin/env bash
# One device (H200) call: the named steps in order, each under its own time limit. Logs and JSON go
# under $OUT, which comes back as one archive (all.tgz) with steps.txt beside it (each step's exit
# code and seconds). Carry .wheels (../shared/wheels/h200-cp312; .wheels-extra for the HTTP bench
# client) and, for `old`, .old (see below).
# Usage: [ENV=...] scripts/gpu.sh STEP...
#   tests:      new (the -m gpu tests of $TESTS), old (the same on the dsquant files kept under .old/,
#               swapped in and back), swap (exchange them for the steps that follow; swap again to go back),
#               gputests (every -m gpu test; too many for one 10-minute run: gpukernels + gpurest + trained split it),
#               restests (tests/kernels and tests/runtime without -m gpu, at full size), trained (the trained-model
#               GPU accuracy test)
#   main job:   demo (dsquant demo --device cuda, then a CPU validate of the same artifacts)
#   kernels:    gemm, mmaprobe (scripts/w4a16_mma_probe.py), gemmsweep, gemmbench (with gemmsweep's configs), minibench, gemv, moe,
#               moegemv (scripts/moe_gemv_probe.py: the INT4 MoE GEMV with and without its dequantization;
#               MOEGEMV_ARGS="--kernels gemv,pair --gemv-default": against the split-K pair MMA),
#               moepf8 (scripts/moe_pair_fp8_probe.py: FP8 decode pairs, grouped GEMM against the pair MMA),
#               moeq (scripts/moe_decode_probe.py: MoE decode with and without align / in-GEMM fp8 quant),
#               routeq (scripts/router_route_probe.py: router logits + routing in one launch against two),
#               alignq (scripts/moe_align_probe.py: moe_align's one-hot, sort and torch methods),
#               fp8dec (scripts/fp8_decode_probe.py: FP8 decode GEMV forms, L2-cold), attention,
#               kvfp8 (FP8-KV-cache decode rows), kvsweep (their launch configs: scripts/kvfp8_sweep.py),
#               kvwords (the words kernels, paged_decode_fp8.py / mla_decode_fp8_words.py: scripts/kv_words_probe.py),
#               mlalong (MLA decode at long context, small batch: scripts/mla_long_sweep.py), mlashort (short contexts:
#               how finely to split, scripts/mla_short_sweep.py), prefill (GQA prefill
#               configs against SDPA: scripts/prefill_sweep.py), prefilltma (the TMA prefill kernel's configs against the paged
#               kernel and SDPA: scripts/prefill_tma_probe.py; PROBE_ARGS=--quick), probe (cuBLAS FP8 scale layout),
#               cache (Triton cache tarball)
#   engine:     engine, tpbench / tpv2 (tensor parallelism: V2-Lite at TP_SIZES, V2-236B INT4; several GPUs), engineon (the same with fused_moe's two decode rules at PAIR_N, FUSE_N, MLA decode's split tiles at MLA_TILES / MLA_SMALL_TILES, router_route up to ROUTE_N tokens, the greedy argmax inside the decode graphs with GREEDY_GRAPH=1, any python statement in EXTRA_PY; DSQUANT_PDL=0: no programmatic dependent launch), enginefull (with HTTP serving and the transformers peer), serve, long (131072-token
#               prompt; long32: 32768), profile (scripts/gpu_engine_profile.py), variance (scripts/engine_variance.py:
#               dsq-tiny-v3 BF16, fp8-block and AWQ engines, interleaved, each step's time split; GREEDY_GRAPH=1: the argmax in the graphs),
#               msprobe (scripts/multi_step_probe.py: dsq-tiny-v3 BF16 (MS_FP8=1: and fp8-block) at MS_STEPS decode steps per launch)
#   quantize:   v3 (scripts/calib_plan.py, DeepSeek-V3 layers), v2lite8 (AWQ of an 8-layer V2-Lite shape),
#               v2prof (the same, timed phase by phase: scripts/profile_quantize.py),
#               validate8 (RTN and FP8 artifacts of that shape validated against it)
#   tune:       tune1, tune4, ... (dsquant tune of dsq-tiny-v3 at --max-ppl-increase N; TUNE_ARGS: more options;
#               TUNE_MODEL: another model dir, or v2lite8 for the random 8-layer V2-Lite shape; TUNE_TAG: output suffix),
#               tuneprof (after tune$TUNE_B: scripts/recipe_step_profile.py on its artifacts, PDL off and on)
# Each step's limit is an env variable (STEP_S, e.g. DEMO_S=300); see the case below.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsquant_triton_cache}
OUT=${OUT:-out}; mkdir -p "$OUT"
SITE=$(mktemp -d)
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl 2>&1 | tail -2
fi
for mod in httpx httpcore h11 anyio sniffio certifi idna; do  # the HTTP bench client's, only where missing
  python3 -c "import $mod" 2>/dev/null || ! ls .wheels-extra/${mod}-*.whl >/dev/null 2>&1 || \
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels-extra/${mod}-*.whl
done
export PYTHONPATH="$PWD:$SITE"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# test workers: 4 on a card of more than 100 GB, 2 on an 80 GB H100 (4 workers' full-size MoE stacks ran it out of memory)
MEM_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n ${WORKERS:-$([ "${MEM_MB:-0}" -gt 100000 ] && echo 4 || echo 2)}"
W=${WORK:-$(mktemp -d)}
M=dsquant/assets/models/dsq-tiny-v3
swap() {  # swap the dsquant files under .old/ with the tree's
  for f in $(cd .old && find dsquant -name '*.py'); do
    cp "$f" "/tmp/swap.$$" && cp ".old/$f" "$f" && cp "/tmp/swap.$$" ".old/$f"
  done
  SWAPPED=$(( 1 - ${SWAPPED:-0} ))  # steps that run on both sides name their output with $(sfx)
}
sfx() { [ "${SWAPPED:-0}" = 1 ] && echo -swapped; }
v2lite8_checkpoint() {
  [ -d "$W/v2lite8" ] || python3 -c "
import time
from dsquant.bench.random_model import V2_LITE, write_random_checkpoint
t = time.perf_counter()
write_random_checkpoint('$W/v2lite8', {**V2_LITE, 'num_hidden_layers': ${LAYERS:-8}}, device='cuda')
print(f'wrote the bf16 checkpoint in {time.perf_counter() - t:.1f} s')"
}
for step in "$@"; do
  start=$(date +%s)
  case $step in
    new) timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider ${TESTS:-tests/kernels} \
           --timeout 180 -rf -s 2>&1 | tail -${TAIL:-80} > "$OUT/tests-new.txt" ;;
    swap) swap ;;  # the tree's dsquant files and those under .old/ exchanged: the steps after it run the other version
    old) swap; timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider ${TESTS:-tests/kernels} \
           --timeout 180 -rf 2>&1 | tail -${TAIL:-60} > "$OUT/tests-old.txt"; swap ;;
    gputests) timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider tests/ \
           --timeout 200 2>&1 | tail -40 > "$OUT/gputests.txt" ;;
    gpukernels) timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider tests/kernels \
           --timeout 200 2>&1 | tail -40 > "$OUT/gpukernels.txt" ;;  # gputests in two halves that each fit
    gpurest) timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider tests/ \
           --ignore=tests/kernels --ignore=tests/runtime/test_gpu_trained_accuracy.py --timeout 200 2>&1 \
           | tail -40 > "$OUT/gpurest.txt" ;;  # the trained-model test is its own step (trained)
    restests) timeout "${REST_S:-110}" python3 -m pytest -q -m "not gpu" $XD -p no:cacheprovider tests/kernels \
           tests/runtime --timeout 100 2>&1 | tail -25 > "$OUT/restests.txt" ;;
    trained) timeout "${TRAINED_S:-540}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_trained_accuracy.py \
           --timeout 530 -rfE -s --tb=short > "$OUT/trained.txt" 2>&1 ;;
    demo) timeout "${DEMO_S:-300}" python3 -m dsquant demo --device cuda --out "$W/demo" > "$OUT/demo-cuda.txt" 2>&1
          echo "demo rc=$?" >> "$OUT/demo-cuda.txt"
          timeout "${CPUVAL_S:-200}" python3 -m dsquant validate "$W"/demo/{fp8-block,mixed-fp8attn-w4experts,awq-w4g128,gptq-w4g128} \
             --baseline $M --device cpu --no-latency --no-peers --window 512 --stride 256 --max-eval-tokens 16384 \
             --out "$W/demo-cpu" > "$OUT/demo-cpu-validate.txt" 2>&1
          echo "cpu validate rc=$?" >> "$OUT/demo-cpu-validate.txt"
          cp "$W/demo/report/report.json" "$OUT/demo-cuda-report.json" 2>/dev/null
          cp "$W/demo-cpu/report.json" "$OUT/demo-cpu-report.json" 2>/dev/null ;;
    gemm) timeout "${GEMM_S:-150}" python3 -m dsquant bench gemm --rep-ms 20 --m ${GEMM_M:-1,4,64,1024,4096} \
            --json "$OUT/gemm.json" > "$OUT/gemm.txt" 2>&1 ;;
    mmaprobe) timeout "${PROBE_S:-300}" python3 scripts/w4a16_mma_probe.py "$OUT/mmaprobe.json" ${PROBE_ARGS:-} \
            > "$OUT/mmaprobe.txt" 2>&1 ;;  # the k-sliced W4A16 MMA kernel's configs against bf16 / the old path
    mmaprobev2) DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/dsquant_triton_cache_v2 timeout "${PROBE_S:-300}" \
            python3 scripts/w4a16_mma_probe.py "$OUT/mmaprobev2.json" ${PROBE2_ARGS:-} > "$OUT/mmaprobev2.txt" 2>&1 ;;
            # the same with Triton's MMA v2 (mma.sync) instead of wgmma
    gemmsweep) timeout "${SWEEP_S:-240}" python3 scripts/gemm_sweep.py "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1 ;;
    gemmbench) cfg=""; [ -s "$OUT/sweep.json" ] && cfg="--configs $OUT/sweep.json"
            timeout "${GEMM_S:-200}" python3 -m dsquant bench gemm --rep-ms 25 $cfg --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1 ;;
    minibench) timeout 60 python3 -m dsquant bench gemm --shapes 7168x4096 --m 1,1024 --rep-ms 20 \
            --json "$OUT/minibench.json" > "$OUT/minibench.txt" 2>&1 ;;
    gemv) timeout "${GEMV_S:-240}" python3 scripts/gemv_sweep.py "$OUT/gemv_sweep.json" ${GEMV_ARGS:-} > "$OUT/gemv.txt" 2>&1 ;;
    moegemv) timeout "${MOEGEMV_S:-150}" python3 scripts/moe_gemv_probe.py "$OUT/moe_gemv_probe.json" ${MOEGEMV_ARGS:-} \
            > "$OUT/moe_gemv_probe.txt" 2>&1 ;;
    moepf8) timeout "${MOEPF8_S:-200}" python3 scripts/moe_pair_fp8_probe.py "$OUT/moe_pair_fp8.json" ${MOEPF8_ARGS:-} \
            > "$OUT/moe_pair_fp8.txt" 2>&1 ;;  # FP8 decode pairs: grouped GEMM against the split-K pair MMA
    fp8dec) timeout "${FP8DEC_S:-200}" python3 scripts/fp8_decode_probe.py "$OUT/fp8dec.json" ${FP8DEC_ARGS:-} \
        > "$OUT/fp8dec.txt" 2>&1 ;;
    alignq) timeout "${ALIGNQ_S:-150}" python3 scripts/moe_align_probe.py "$OUT/alignq.json" ${ALIGNQ_ARGS:-} \
            > "$OUT/alignq.txt" 2>&1 ;;
    routeq) timeout "${ROUTEQ_S:-120}" python3 scripts/router_route_probe.py "$OUT/routeq.json" ${ROUTEQ_ARGS:-} \
            > "$OUT/routeq.txt" 2>&1 ;;
    moeq) timeout "${MOEQ_S:-150}" python3 scripts/moe_decode_probe.py "$OUT/moeq.json" ${MOEQ_ARGS:-} \
            > "$OUT/moeq.txt" 2>&1 ;;
    moe) timeout "${MOE_S:-150}" python3 -m dsquant bench moe ${MOE_ARGS:-} --json "$OUT/moe.json" > "$OUT/moe.txt" 2>&1 ;;
    attention) timeout "${ATT_S:-200}" python3 -m dsquant bench attention --sweep --peer-gb 100 \
            --json "$OUT/attention.json" > "$OUT/attention.txt" 2>&1 ;;
    kvfp8) timeout "${KV_S:-200}" python3 -c "
import torch
from dsquant.bench.attention import _print
from dsquant.bench.attention_fp8 import fp8_rows
from dsquant.bench.common import write_json
rows = fp8_rows(64, torch.Generator().manual_seed(0), lambda r: _print([r]))
write_json('$OUT/kvfp8.json', rows, {'block_size': 64})" > "$OUT/kvfp8.txt" 2>&1 ;;
    kvsweep) timeout "${KVS_S:-360}" python3 scripts/kvfp8_sweep.py "$OUT/kvsweep.json" --budget-s "${KVS_BUDGET:-320}" \
        ${KVS_ARGS:-} > "$OUT/kvsweep.txt" 2>&1 ;;
    mlashort) timeout "${MLASHORT_S:-200}" python3 scripts/mla_short_sweep.py "$OUT/mlashort.json" ${MLASHORT_ARGS:-} \
            > "$OUT/mlashort.txt" 2>&1 ;;
    mlalong) timeout "${MLALONG_S:-200}" python3 scripts/mla_long_sweep.py "$OUT/mlalong.json" --budget-s "${MLALONG_BUDGET:-150}" \
        > "$OUT/mlalong.txt" 2>&1 ;;
    prefill) timeout "${PREFILL_S:-200}" python3 scripts/prefill_sweep.py "$OUT/prefill$(sfx).json" > "$OUT/prefill$(sfx).txt" 2>&1 ;;
    kvwords) timeout "${KVW_S:-360}" python3 scripts/kv_words_probe.py "$OUT/kvwords.json" --budget-s "${KVW_BUDGET:-320}" \
            ${KVW_ARGS:-} > "$OUT/kvwords.txt" 2>&1 ;;  # FP8-KV decode: the words kernels' configs against both caches' defaults
    prefilltma) timeout "${PREFILL_S:-400}" python3 scripts/prefill_tma_probe.py "$OUT/prefill-tma.json" ${PROBE_ARGS:-} > "$OUT/prefill-tma.txt" 2>&1 ;;
    probe) timeout 120 python3 scripts/fp8_cublas_probe.py "$OUT/fp8-cublas-probe.json" > "$OUT/probe.txt" 2>&1 ;;
    cache) tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . ;;
    engine) timeout "${ENGINE_S:-300}" python3 -m dsquant bench engine ${ENGINE_ARGS:---schemes int4,bf16,fp8 --modes async} \
            --peer-batches "" --json "$OUT/engine.json" > "$OUT/engine.txt" 2>&1 ;;
    engineon) timeout "${ENGINE_S:-300}" python3 -c "
import sys
import dsquant.runtime.kernels.moe.fused_moe as fm
import dsquant.runtime.kernels.attention.mla_decode_plan as md
fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS = ${PAIR_N:-fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS}
fm.FP8_FUSE_QUANT_MAX_TOKENS = ${FUSE_N:-fm.FP8_FUSE_QUANT_MAX_TOKENS}
md.NARROW_SPLIT_TILES = ${MLA_TILES:-md.NARROW_SPLIT_TILES}
md.SMALL_BATCH_SPLIT_TILES = ${MLA_SMALL_TILES:-md.SMALL_BATCH_SPLIT_TILES}
import dsquant.runtime.kernels.moe.router_gemv as rg
rg.FUSED_ROUTE_MAX_T = ${ROUTE_N:-rg.FUSED_ROUTE_MAX_T}
import dsquant.runtime.engine.cuda_graph as cg
cg.GREEDY_IN_GRAPH = ${GREEDY_GRAPH:-cg.GREEDY_IN_GRAPH}
${EXTRA_PY:-}
from dsquant.cli import main
sys.argv = ['dsquant', 'bench', 'engine', *'${ENGINE_ARGS:---schemes fp8,bf16 --modes async}'.split(),
            '--peer-batches', '', '--json', '$OUT/engineon${TAG:-}.json']
main()" > "$OUT/engineon${TAG:-}.txt" 2>&1 ;;  # engine with fused_moe's decode rules at PAIR_N, FUSE_N and MLA decode's split tiles at MLA_TILES, MLA_SMALL_TILES, the one-launch router at ROUTE_N tokens (each unset: the module's default); A/B against engine
    tpbench) NCCL_NVLS_ENABLE=0 timeout "${TP_S:-500}" python3 -c "
import sys
import dsquant.runtime.parallel.worker as w
w.TP_CUDA_GRAPHS = bool(${TP_GRAPHS:-0})
from dsquant.cli import main
sys.argv = ['dsquant', 'bench', 'engine', '--schemes', '${TP_SCHEMES:-int4,bf16,fp8}', '--tensor-parallel-size',
            '${TP_SIZES:-1,2}', '--modes', 'async', '--peer-batches', '', '--json', '$OUT/tpbench${TP_GRAPHS:-0}.json']
main()" > "$OUT/tpbench.txt" 2>&1 ;;  # issue 26: V2-Lite at TP=N against TP=1 (needs N GPUs); TP_GRAPHS=1: decode graphs under TP
    tpv2) NCCL_NVLS_ENABLE=0 timeout "${TP_S:-550}" python3 -m dsquant bench engine --model "${TP_MODEL:-v2}" --schemes int4 \
            --tensor-parallel-size "${TP_SIZES:-2}" --modes async --peer-batches "" --json "$OUT/tpv2.json" \
            > "$OUT/tpv2.txt" 2>&1 ;;  # issue 26: DeepSeek-V2's 236B shape in INT4 across GPUs (random weights)
    enginefull) timeout "${ENGINE_S:-420}" python3 -m dsquant bench engine --schemes "${SCHEMES:-int4,fp8,bf16}" \
            --serve 1,8,32,64 --peer-batches "${PEER:-1,16}" --json "$OUT/enginefull.json" > "$OUT/enginefull.txt" 2>&1 ;;
    serve) timeout "${SERVE_S:-400}" python3 -m dsquant bench engine --schemes ${SERVE_SCHEMES:-fp8} --modes async \
            --peer-batches "" --serve ${SERVE_C:-1,8,32,64} --json "$OUT/serve.json" > "$OUT/serve.txt" 2>&1 ;;
    long|long32) n=131072; [ "$step" = long32 ] && n=32768
        timeout "${LONG_S:-150}" python3 -m dsquant bench engine --schemes "${LONG_SCHEMES:-int4}" --concurrency 0 \
            --batch1-output 8 --long-context $n --peer-batches "" ${LONG_ARGS:-} --json "$OUT/$step.json" \
            > "$OUT/$step.txt" 2>&1 ;;
    profile) timeout "${PROFILE_S:-150}" python3 scripts/gpu_engine_profile.py "$OUT" ${PROFILE_SCHEMES:-bf16 int4} \
            > "$OUT/profile.txt" 2>&1 ;;
    v3) timeout "${V3_S:-330}" python3 scripts/calib_plan.py "$OUT/calib-plan-v3.json" --workdir "$W/v3" \
          --recipes "${V3_RECIPES:-awq-w4g128,rtn-w4g128}" --timeout "${V3_Q_S:-300}" > "$OUT/v3.txt" 2>&1
        echo "v3 rc=$?" >> "$OUT/v3.txt"; du -sh "$W"/v3/* >> "$OUT/v3.txt" 2>&1 ;;
    v2lite8) v2lite8_checkpoint > "$OUT/v2lite8.log" 2>&1
        /usr/bin/time -v timeout "${V2_S:-200}" python3 -m dsquant quantize "$W/v2lite8" --recipe "${V2_RECIPE:-awq-w4g128}" \
            -o "$W/awq" --device cuda >> "$OUT/v2lite8.log" 2> "$OUT/v2lite8.err"
        echo "quantize rc=$?" >> "$OUT/v2lite8.log"; cp "$W/awq/dsquant.json" "$OUT/v2lite8-manifest.json" 2>/dev/null ;;
    v2prof) v2lite8_checkpoint > "$OUT/v2prof.txt" 2>&1  # where quantize's time goes (scripts/profile_quantize.py)
        timeout "${V2_S:-200}" python3 scripts/profile_quantize.py "$W/v2lite8" "${V2_RECIPE:-awq-w4g128}" "$W/awq-prof" \
            "$OUT/v2prof.json" --device cuda >> "$OUT/v2prof.txt" 2>&1 ;;
    validate8) v2lite8_checkpoint > "$OUT/validate8.txt" 2>&1
        for r in rtn-w4g128 fp8-block; do
          timeout 200 python3 -m dsquant quantize "$W/v2lite8" --recipe $r -o "$W/$r" --device cuda >> "$OUT/validate8.txt" 2>&1
        done
        timeout "${VALIDATE_S:-300}" python3 -m dsquant validate "$W/rtn-w4g128" "$W/fp8-block" --baseline "$W/v2lite8" \
            --out "$OUT/validate8" --device cuda ${VARGS:-} >> "$OUT/validate8.txt" 2>&1 ;;
    tuneprof) b=${TUNE_B:-4}; d="$W/tune-b$b/compare"  # after tune$b: its artifacts' decode graphs, kernel by kernel
        [ -e "$d/artifact" ] || ln -s "$W/tune-b$b/artifact" "$d/artifact"
        for pdl in 0 1; do DSQUANT_PDL=$pdl timeout "${TUNEPROF_S:-120}" python3 scripts/recipe_step_profile.py \
            "$OUT/tuneprof-pdl$pdl.json" $M "$d" fp8-block awq-w4g128 artifact >> "$OUT/tuneprof.txt" 2>&1; done ;;
    tune*) b=${step#tune}; tm=${TUNE_MODEL:-$M}; t=tune-b$b${TUNE_TAG:-}
         : > "$OUT/$t.txt"; if [ "$tm" = v2lite8 ]; then v2lite8_checkpoint >> "$OUT/$t.txt" 2>&1; tm="$W/v2lite8"; fi
         timeout "${TUNE_S:-290}" python3 -m dsquant tune "$tm" --device cuda --max-ppl-increase "$b" \
           --batch 1,64 --latency-cache "$W/tune-latency" -o "$W/$t" ${TUNE_ARGS:-} >> "$OUT/$t.txt" 2>&1
         echo "tune rc=$?" >> "$OUT/$t.txt"; mkdir -p "$OUT/$t"
         (cd "$W/$t" && cp -r tune.json tune.md pareto.png recipe.yaml validate "$W/tune-latency" "$OUT/$t/" 2>/dev/null) ;;
    msprobe) ms_models=$M  # multi-step decoding against single steps; MS_FP8=1: fp8-block too
        if [ -n "${MS_FP8:-}" ]; then
          [ -d "$W/v-fp8-block" ] || timeout 120 python3 -m dsquant quantize $M --recipe fp8-block -o "$W/v-fp8-block" \
               --device cuda >> "$OUT/msprobe.txt" 2>&1
          ms_models="$M $W/v-fp8-block"
        fi
        timeout "${MSPROBE_S:-240}" python3 scripts/multi_step_probe.py "$OUT/msprobe.json" $ms_models \
            --steps ${MS_STEPS:-1,8} --rounds ${ROUNDS:-2} >> "$OUT/msprobe.txt" 2>&1 ;;
    variance*) for r in fp8-block awq-w4g128; do  # variancepin: the same, the process pinned to one CPU
          [ -d "$W/v-$r" ] || timeout 120 python3 -m dsquant quantize $M --recipe $r -o "$W/v-$r" --device cuda >> "$OUT/$step.txt" 2>&1
        done
        pin=""; [ "$step" = variancepin ] && pin="taskset -c ${PIN_CPU:-3}"
        timeout "${VARIANCE_S:-300}" $pin python3 scripts/engine_variance.py "$OUT/$step.json" $M "$W/v-fp8-block" \
            "$W/v-awq-w4g128" --rounds ${ROUNDS:-3} ${GREEDY_GRAPH:+--greedy-in-graph} >> "$OUT/$step.txt" 2>&1 ;;
    *) echo "unknown step $step" | tee -a "$OUT/steps.txt" ;;
  esac
  echo "== $step: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
for f in "$OUT"/tests-*.txt "$OUT"/gputests.txt "$OUT"/gpukernels.txt "$OUT"/gpurest.txt "$OUT"/restests.txt; do [ -f "$f" ] && tail -5 "$f"; done
for f in tuneprof msprobe moe_gemv_probe moe_pair_fp8 mmaprobe mmaprobev2 variance variancepin kvfp8 gemm moe routeq alignq engine enginefull serve long long32 attention v3 mlalong mlashort moeq prefill tpbench tpv2; do [ -f "$OUT/$f.txt" ] && tail -16 "$OUT/$f.txt"; done
tail -3 "$OUT"/tune-b*.txt "$OUT/v2lite8.log" 2>/dev/null; tail -30 "$OUT/trained.txt" 2>/dev/null
grep -A8 "^artifact" "$OUT/demo-cuda.txt" "$OUT/demo-cpu-validate.txt" 2>/dev/null
# what comes back is limited in files: everything in one archive (steps.txt beside it)
(cd "$OUT" && tar -czf /tmp/all.tgz --exclude=steps.txt . && find . -mindepth 1 ! -name steps.txt -delete && mv /tmp/all.tgz .)
