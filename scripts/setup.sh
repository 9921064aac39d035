#!/usr/bin/env bash
# Install everything jupyter_metainit needs to run and to test, into .venv at the repo root.
#
#   bash scripts/setup.sh        # installs (idempotent: a second run only checks)
#
# Steps: create .venv with `python3` (override with PYTHON=...), install the CPU build of torch
# FIRST at an exact version (a bare `torch` requirement would pull a multi-GB CUDA build), then
# `pip install -e ".[test]"`, make sure the Jupyter kernel is the venv's python, install Debian's
# chromium for the browser tests (root only, never Playwright's own browser download) and g++ if
# there is no C++ compiler (the native fills; root only), and run
# `npm ci` in labextension/ when it has a package.json and npm is present (front-end tests only:
# the built extension is committed, users need no Node).
#
# Environment knobs:
#   PYTHON=python3.12        interpreter used to create .venv
#   TORCH_SPEC="torch==2.13.0"  the torch requirement installed before the package
#   SETUP_FORCE=1            redo the pip installs even when nothing changed
#   SETUP_SKIP_CHROMIUM=1    do not install chromium
#   SETUP_SKIP_NPM=1         do not run npm ci
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"

log() { printf '[setup] %s\n' "$*" >&2; }

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

# 1. The virtual environment -------------------------------------------------------------------
if [ -x "$VPY" ] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    log "found a broken .venv (its python does not run); recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VPY" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 || { log "error: $PYTHON not found (set PYTHON=...)"; exit 1; }
    log "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
# pip, minus the warnings some machines' pip configuration prints for every package
pip_install() {
    "$VPY" -m pip install --quiet "$@" 2> >(grep -v 'is neither a file nor a directory' >&2)
}

# 2. torch first, at an exact CPU version ------------------------------------------------------
# A torch already there is kept when pyproject.toml's range admits it (read from there, so the
# two never disagree): "torch>=LOW,<CAP", compared as (major, minor).
TORCH_RANGE="$(grep -o '"torch>=[0-9.]*,<[0-9.]*"' pyproject.toml | tr -d '"')"
TORCH_LOW="$(sed 's/torch>=\([0-9.]*\),.*/\1/' <<<"$TORCH_RANGE")"
TORCH_CAP="$(sed 's/.*,<\([0-9.]*\)/\1/' <<<"$TORCH_RANGE")"
if ! "$VPY" - "$TORCH_LOW" "$TORCH_CAP" >/dev/null 2>&1 <<'EOF'
import sys, torch
minor = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])
sys.exit(not minor(sys.argv[1]) <= minor(torch.__version__) < minor(sys.argv[2]))
EOF
then
    log "installing $TORCH_SPEC (before anything that depends on torch)"
    pip_install "$TORCH_SPEC"
fi

# 3. the package with its test extras (skipped when pyproject.toml did not change) -------------
STAMP="$VENV/.jupyter_metainit-setup"
WANT="$( (cat pyproject.toml scripts/constraints.txt; printf '%s\n' "$TORCH_SPEC" "$ROOT") | sha256sum | cut -d' ' -f1)"
if [ "${SETUP_FORCE:-0}" = 1 ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
        || ! "$VPY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
            ("jupyter_metainit", "pytest", "transformers", "accelerate", "nbclient", "ipykernel")))'; then
    log "installing jupyter_metainit (editable) with its test extras"
    pip_install -e ".[test]" -c scripts/constraints.txt
    printf '%s\n' "$WANT" >"$STAMP"
else
    log "python packages up to date"
fi

# 4. the Jupyter kernel must be this venv's python ---------------------------------------------
if ! "$VPY" - <<'EOF'
import json, os, sys
from jupyter_client.kernelspec import KernelSpecManager
spec = KernelSpecManager().get_kernel_spec("python3")
exe = spec.argv[0]
ok = os.path.isabs(exe) and os.path.realpath(exe) == os.path.realpath(sys.executable)
sys.exit(0 if ok else 1)
EOF
then
    log "installing the python3 kernelspec into .venv"
    "$VPY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (ipykernel)" >/dev/null
fi

# 5. Debian's chromium for the browser tests ---------------------------------------------------
if [ "${SETUP_SKIP_CHROMIUM:-0}" != 1 ] && ! [ -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing Debian's chromium (browser tests)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null
    else
        log "warning: /usr/bin/chromium missing and not root: browser tests will be skipped"
        log "         (as root: apt-get update && apt-get install -y chromium)"
    fi
fi

# 5b. a C++ compiler: the native normal_/uniform_ kernels are built with it on first use (without
# one, torch's slower kernels are used and their tests are skipped) -----------------------------
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing Debian's g++ (the native fills)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq g++ >/dev/null
    else
        log "warning: no C++ compiler: the native fills stay off and their tests are skipped"
    fi
fi

# 6. front-end test dependencies (only when the labextension sources and npm are there) ---------
if [ "${SETUP_SKIP_NPM:-0}" != 1 ] && [ -f labextension/package.json ]; then
    if command -v npm >/dev/null 2>&1; then
        LOCK=labextension/package-lock.json
        NSTAMP=labextension/node_modules/.jupyter_metainit-setup
        NWANT="$(cat labextension/package.json "$LOCK" 2>/dev/null | sha256sum | cut -d' ' -f1)"
        if [ ! -f "$NSTAMP" ] || [ "$(cat "$NSTAMP")" != "$NWANT" ]; then
            log "npm ci in labextension/ (front-end tests)"
            if [ -f "$LOCK" ]; then
                (cd labextension && npm ci --no-audit --no-fund --loglevel=error)
            else
                (cd labextension && npm install --no-audit --no-fund --loglevel=error)
            fi
            printf '%s\n' "$NWANT" >"$NSTAMP"
        fi
    else
        log "warning: npm not found: the labextension's own tests will be skipped"
    fi
fi

log "ready: $("$VPY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
