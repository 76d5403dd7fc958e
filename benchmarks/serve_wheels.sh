#!/usr/bin/env bash
# Wheels of foscar's serve extra (FastAPI, uvicorn, pydantic) and of the openai client its tests
# use, for a Python 3.12 x86-64 GPU machine without a package index: downloaded into .whl/, which
# run_device.sh installs into /tmp/site before a mode runs. The machine already has httpx, anyio,
# h11, click, prometheus-client and uvloop. Run it from the repository root where pip reaches an
# index:
#
#   bash benchmarks/serve_wheels.sh
#
# Every wheel is pinned with no dependencies resolved (pip download --no-deps): the list below is
# the whole closure beside what the machine has. pydantic-core and jiter are compiled, hence the
# manylinux platform wheels; the rest are pure Python.
set -euo pipefail
[ -f foscar/__init__.py ] || { echo "serve_wheels.sh: run it from the repository root" >&2; exit 2; }
pure=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3
  pydantic==2.13.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
  uvicorn==0.55.0
  openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 sniffio==1.3.1
)
compiled=(pydantic-core==2.46.4 jiter==0.19.0)
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "${pure[@]}" "${compiled[@]}"
ls -l .whl
