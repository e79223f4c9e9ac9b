#!/usr/bin/env bash
# One device call: the tree against the dsquant files kept under .old/ (carry .wheels and .old), end to end.
#   1. the -m gpu tests of $TESTS on the tree
#   2. `bench engine` with $ENGINE_ARGS on the tree, then on .old/ (swapped in and back; TAG=old)
#   3. if the tree's $AB_SCHEME (int4) is > 1% faster at batch 1 and not > 2% slower at 64 sequences
#      (AB_GAIN_ON=c64: > 1% faster at 64 sequences and not > 1% slower at batch 1): the trained-model GPU
#      test and the demo (the gates for landing a GPU-path change); GATES_FIRST=1: the gates right after the
#      tree's engine, whatever it shows, then the old engine only if time is left (EXTRA_FIRST=1: step 4 first)
#   4. with the time left: $EXTRA_STEPS (gpu.sh steps on the tree, e.g. moegemv with MOEGEMV_ARGS)
# Every step runs through scripts/gpu.sh with its own OUT under /tmp/ab; all of it comes back as $OUT/ab.tgz
# (one archive per step inside) beside $OUT/driver.txt, re-packed after each phase, so a run stopped at the
# command's limit still returns what finished. BUDGET_S: the seconds this driver may use (default 550).
set -u
O=${OUT:-out}; S=scripts/gpu.sh; B=${BUDGET_S:-550}; R=/tmp/ab; rm -rf $R; mkdir -p $R "$O"
SCHEME=${AB_SCHEME:-int4}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$O/driver.txt"; }
left() { [ $(( B - ($(date +%s) - t0) )) -gt "$1" ]; }
pack() { tar -czf "$O/ab.tgz" -C $R . ; }
el start
if [ -n "${TESTS:-}" ]; then
  TEST_S=${TEST_S:-150} OUT=$R/t bash $S new >/dev/null 2>&1
  el tests; tar -xzOf $R/t/all.tgz ./tests-new.txt 2>/dev/null | tail -4 | tee -a "$O/driver.txt"
fi
ENGINE_ARGS="${ENGINE_ARGS:---schemes $SCHEME,bf16 --modes async}" OUT=$R/en bash $S engine >/dev/null 2>&1
el engine-tree
gates() {
  CPUVAL_S=1 OUT=$R/g bash $S trained demo >/dev/null 2>&1
  el gates; tar -xzOf $R/g/all.tgz ./trained.txt 2>/dev/null | tail -3 | tee -a "$O/driver.txt"
  tar -xzOf $R/g/all.tgz ./demo-cuda.txt 2>/dev/null | grep -A8 "^artifact" | tee -a "$O/driver.txt"
  pack
}
extra() {
  if [ -n "${EXTRA_STEPS:-}" ] && left 100; then
    lim=$(( B - ($(date +%s) - t0) - 20 ))
    MOEGEMV_S=$lim PROBE_S=$lim ENGINE_S=$lim MSPROBE_S=$lim OUT=$R/extra bash $S $EXTRA_STEPS >/dev/null 2>&1
    el "$EXTRA_STEPS"; pack
  fi
}
if [ -n "${GATES_FIRST:-}" ]; then  # short budgets: the gates before the A/B's old engine, whatever it shows
  pack; gates
  if [ -n "${EXTRA_FIRST:-}" ]; then extra; EXTRA_STEPS=""; fi  # EXTRA_FIRST=1: $EXTRA_STEPS before the old engine
  left 80 || { el done; exit 0; }
fi
OUT=$R/x1 bash $S swap >/dev/null 2>&1
ENGINE_ARGS="${OLD_ENGINE_ARGS:---schemes $SCHEME --modes async}" TAG=old OUT=$R/eo bash $S engineon >/dev/null 2>&1
el engine-old
OUT=$R/x2 bash $S swap >/dev/null 2>&1
pack
python3 - $R "$SCHEME" "${AB_GAIN_ON:-b1}" <<'EOF' | tee -a "$O/driver.txt"
import json, sys, tarfile
r, scheme, gain_on = sys.argv[1:4]
def eng(sub, name):
    with tarfile.open(f"{r}/{sub}/all.tgz") as t:
        d = json.load(t.extractfile(f"./{name}"))
    return {k: (round(v["batch1_async"]["decode_tok_s"], 1), round(v["concurrent_async"]["output_tok_s"]))
            for k, v in d["schemes"].items()}
new, old = eng("en", "engine.json"), eng("eo", "engineonold.json")
print("tree", new, "old", old)
(b1, c64), (ob1, oc64) = new[scheme], old[scheme]
win = (c64 > 1.01 * oc64 and b1 > 0.99 * ob1) if gain_on == "c64" else (b1 > 1.01 * ob1 and c64 > 0.98 * oc64)
open(f"{r}/win", "w").write("1" if win else "0")
print("win", win)
EOF
if [ -z "${GATES_FIRST:-}" ] && [ "$(cat $R/win 2>/dev/null)" = 1 ] && left 250; then
  gates
fi
extra
el done
