#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# run from tests/ so that the installed package, not the source folder, is imported
cd tests && python -m pytest -q "$@"
