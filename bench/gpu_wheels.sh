#!/usr/bin/env bash
# Fetches, on a machine with pip access, the wheels bench/gpu_h100.sh installs on the GPU
# machine (Python 3.12, x86-64; nothing can be fetched there): tokamax and what it needs
# beyond that machine's image (which has jax 0.11.2, flax, absl-py, jaxtyping, tqdm).
# tokamax 0.0.12 (what installs for Python 3.11) fails there under jax 0.11.2 (`Mesh.__init__()
# got an unexpected keyword argument 'out_shape'`); 0.0.17 wants jax >= 0.11.1 and imports
# xprof's command-line tools (which need fire and termcolor) when it is imported.
#
#   bash bench/gpu_wheels.sh      # -> .whl/ (git-ignored through .git/info/exclude)
#
# The device tool then carries it: run(command="bash bench/gpu_h100.sh", carry=[".whl"]).
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform any -d .whl \
  tokamax==0.0.17 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 qwix==0.1.8 einshape==1.0 \
  typeguard==2.13.3 immutabledict==4.3.1 tensorboardx==2.6.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
ls .whl
