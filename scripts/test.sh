#!/usr/bin/env bash
# Set up .venv-test with the test extras (scripts/setup.sh; torch and matplotlib included) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-test EXTRAS=test bash scripts/setup.sh
. .venv-test/bin/activate
# run from tests/ so that the installed package, not the source folder, is imported
cd tests && python -m pytest -q "$@"
