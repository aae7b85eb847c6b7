#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on a GPU machine whose image has torch, triton, numpy, matplotlib, rich
# and pyyaml but not pydantic, Hydra or OmegaConf, and no package index (see benchmarks/README.md, "GPU check"):
# downloaded here for CPython 3.12 on x86-64 Linux into .whl/ (git-ignored; never commit wheels), plus
# antlr4-python3-runtime (an sdist only: its pure-Python wheel is built here) and overlapcfg's own wheel.
# Versions: those this checkout's .venv resolved (README's set-up), pinned so the machine runs what CI tested
# (typing_extensions too: pydantic 2.14 needs >= 4.16, newer than images may hold; it shadows theirs on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  hydra-core==1.3.8 omegaconf==2.3.1
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps -w .whl .
ls -l .whl
du -sh .whl
