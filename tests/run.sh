#!/usr/bin/env bash
# The test command (README.md "Run the tests"): on a fresh machine with Python 3.11 and nothing installed,
# installs nbgen with its test extras (CPU torch), prefetches the embedded model, and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: the local CPU build (an unpinned torch pulls gigabytes of CUDA wheels)
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test,notebook]"
if [ "${NBGEN_BROWSER_TESTS:-1}" = "1" ] && [ -f tests/browser/setup.sh ]; then
  bash tests/browser/setup.sh || echo "browser test setup failed; the browser test will be skipped"
fi
$PY -m nbgen.models fetch
exec $PY -m pytest -q -p no:cacheprovider --timeout=900 "$@"
