#!/usr/bin/env bash
# Set up .venv-test with the test extras (scripts/setup.sh; torch and matplotlib included) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-test EXTRAS=test bash scripts/setup.sh
# upstream's llama-server, for the head-to-head tests (tests/test_llama_server.py): built once into .llama-server/
# from the same llama.cpp source, about 10 minutes on 2 cores the first time; DFLASH_NO_LLAMA_SERVER=1 skips it (and
# those tests)
if [ "${DFLASH_NO_LLAMA_SERVER:-0}" != 1 ]; then
    PYTHON=.venv-test/bin/python bash scripts/build-llama-server.sh
fi
. .venv-test/bin/activate
# run from tests/ so that the installed package, not the source folder, is imported
cd tests && python -m pytest -q "$@"
