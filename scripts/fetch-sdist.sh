#!/usr/bin/env bash
# The llama-cpp-python 0.3.36 sdist (its vendored llama.cpp is the one this project builds on), downloaded from the
# package index once into build/sdist/ and kept there: scripts/setup.sh builds the wheel from it,
# scripts/build-llama-server.sh upstream's binaries, and the tests read upstream's converter in it. Prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
SDIST=build/sdist/llama_cpp_python-0.3.36.tar.gz
if [ ! -f "$SDIST" ]; then
    PY=${PYTHON:-python3}
    # without build isolation pip reads the sdist's metadata at once, where it would first install a build backend;
    # a venv of this project (scripts/setup.sh) has scikit-build-core
    flags=(-q --no-deps --no-binary :all:)
    if "$PY" -c "import scikit_build_core" 2>/dev/null; then
        flags+=(--no-build-isolation)
    fi
    mkdir -p build/sdist
    part=$(mktemp -d build/sdist.XXXXXX)
    "$PY" -m pip download "${flags[@]}" "llama-cpp-python==0.3.36" -d "$part" >&2
    mv "$part/llama_cpp_python-0.3.36.tar.gz" "$SDIST"  # whole or not at all
    rm -rf "$part"
fi
echo "$PWD/$SDIST"
