#!/bin/bash
# Compile the configs of NOTES 21's register scan for sm_90a (CPU; triton's ptxas/nvdisasm) into
# $OUT_DIR (default /tmp/sass_uninit): HEAD's kernel from this checkout, the old E4M3 Q staging
# from commit 1847b6b (git archive into $OUT_DIR/old). Then run_all.sh.
# compile_one.py args: name pkgroot kaxis tile_pages opt_or kbits vbits kchannel vchannel heads_per_kv
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
export OUT_DIR=${OUT_DIR:-/tmp/sass_uninit} OMP_NUM_THREADS=1 TRITON_INTERPRET=0
mkdir -p "$OUT_DIR/old"
git -C "$REPO" archive 1847b6b foscar | tar -x -C "$OUT_DIR/old"
c() { python "$HERE/compile_one.py" "$@"; }
c old_token_e4m3   "$OUT_DIR/old" token None 1024 2 2 0 0 4
c head_token_e4m3  "$REPO" token None 1024 2 2 0 0 4
c a_KcVc_tp1_k2v4  "$REPO" channel 1 0 2 4 1 1 4
c b_KcVc_tp1_k2v2  "$REPO" channel 1 0 2 2 1 1 4
c c_KcVc_tp2_k2v4  "$REPO" channel None 0 2 4 1 1 4
c c_KcVc_tp2_k2v2  "$REPO" channel None 0 2 2 1 1 4
c d_KcVt_tp1_k2v4  "$REPO" channel 1 0 2 4 1 0 4
c d_KtVc_tp1_k2v4  "$REPO" token 1 0 2 4 0 1 4
c a_KcVc_tp1_k2v4_opt32768 "$REPO" channel 1 32768 2 4 1 1 4
c a_KcVc_tp1_k2v4_opt65536 "$REPO" channel 1 65536 2 4 1 1 4
