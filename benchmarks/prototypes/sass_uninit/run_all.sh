#!/bin/bash
# Analyse every config compile_all.sh compiled: $OUT_DIR/X.report (maybe-unwritten register
# reads, sass_uninit.py) and X.wgmma (registers touched while a wgmma may run, wgmma_inflight.py).
HERE=$(cd "$(dirname "$0")" && pwd)
OUT_DIR=${OUT_DIR:-/tmp/sass_uninit}
export OMP_NUM_THREADS=1
for f in old_token_e4m3 head_token_e4m3 a_KcVc_tp1_k2v4 b_KcVc_tp1_k2v2 c_KcVc_tp2_k2v4 c_KcVc_tp2_k2v2 d_KcVt_tp1_k2v4 d_KtVc_tp1_k2v4 a_KcVc_tp1_k2v4_opt32768 a_KcVc_tp1_k2v4_opt65536; do
  python "$HERE/sass_uninit.py" "$OUT_DIR/$f.sass" --lines "$OUT_DIR/$f.lines" --ctx 5 > "$OUT_DIR/$f.report"
  python "$HERE/wgmma_inflight.py" "$OUT_DIR/$f.sass" "$OUT_DIR/$f.lines" > "$OUT_DIR/$f.wgmma"
  echo "$f: $(grep -c '^==' "$OUT_DIR/$f.report") flagged instructions; $(head -1 "$OUT_DIR/$f.wgmma" | sed 's/.*; //')"
done
