#!/usr/bin/env bash
# Installs what the browser tests (tests/browser/) need: Debian's chromium, Playwright for
# Python (its bundled driver only: the test points it at /usr/bin/chromium, no browser download)
# and JupyterLab. Safe to run again; .ci/run and tests/run.sh call it.
set -euo pipefail
PY=${PYTHON:-python3}
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo -n"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
  else
    echo "setup.sh: no apt-get; install chromium yourself" >&2
  fi
fi
$PY -m pip install -q "playwright>=1.40" "jupyterlab>=4" ipykernel
command -v chromium
$PY -c "import playwright, jupyterlab; print('playwright + jupyterlab ok')"
