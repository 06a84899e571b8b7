#!/usr/bin/env bash
# Sets up everything the tests need, then runs the whole suite (slow tests included). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -ra "$@"
