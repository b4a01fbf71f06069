#!/usr/bin/env bash
# dfo's test command (the README's): on a fresh Debian machine with Python 3.11 it installs what the tests
# need (openssh-server, lxc, busybox-static, iproute2, chromium for the browser tests of `dfo ui`; service
# starts blocked while installing), makes .venv, installs torch==2.13.0 and dfo with its trainer, ui and dev
# extras (Playwright for Python among them: it drives the system chromium, never a browser of its own), then
# runs pytest.
# Idempotent and quick on a second run: each step checks first. Arguments go to pytest, after
# `-n $DFO_TEST_WORKERS --dist loadgroup` (pytest-xdist; default 2 workers: much of the suite's time is spent
# waiting on sshd, containers and watch leases, which a second worker overlaps; tests/conftest.py keeps the
# trainer-running test files on one worker; `-n 0` among the arguments runs it in one process).
# Exit status: pytest's (or the failing set-up step's).
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3),
#              TORCH_PIP_ARGS (extra pip arguments for torch, e.g. an --index-url of CPU wheels),
#              DFO_TEST_WORKERS (pytest-xdist workers, default 2),
#              DFO_SKIP_FLOOR (set: skip scripts/floor.sh, the CLI on the lowest declared typer, rich, pydantic).
set -euo pipefail

cd "$(dirname "$0")/.."
APT_PACKAGES=(openssh-server lxc busybox-static iproute2 procps chromium)
TORCH_VERSION=2.13.0
VENV=.venv
STAMP=$VENV/.dfo-installed

log() { printf '[test.sh] %s\n' "$*" >&2; }

as_root() {
    if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi
}

missing_apt_packages() {
    local package
    for package in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || echo "$package"
    done
}

install_system_packages() {
    local missing
    missing=$(missing_apt_packages)
    [[ -z $missing ]] && return
    log "installing $(echo $missing)"
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        # keep sshd and lxc-net from starting: the tests start their own sshd on chosen ports
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    as_root apt-get update -qq
    # shellcheck disable=SC2086
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
    ((made_policy)) && as_root rm -f /usr/sbin/policy-rc.d
    return 0
}

pick_python() {
    if [[ -n ${PYTHON:-} ]]; then echo "$PYTHON"; return; fi
    command -v python3.11 || command -v python3 || { log "no python3 found: install Python 3.11"; exit 1; }
}

make_venv() {
    [[ -x $VENV/bin/python ]] && return
    local python
    python=$(pick_python)
    log "creating $VENV with $python"
    "$python" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
}

install_python_packages() {
    if ! "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
        log "installing torch==$TORCH_VERSION"
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
    fi
    local wanted
    wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [[ ! -f $STAMP || $(cat "$STAMP") != "$wanted" ]]; then
        log "installing dfo with extras trainer,ui,dev"
        "$VENV/bin/python" -m pip install -q -e '.[trainer,ui,dev]'
        echo "$wanted" >"$STAMP"
    fi
}

main() {
    install_system_packages
    as_root mkdir -p /run/sshd
    make_venv
    install_python_packages
    [[ -n ${DFO_SKIP_FLOOR:-} ]] || VENV=$VENV bash scripts/floor.sh  # the CLI on the declared floors of its dependencies
    exec "$VENV/bin/python" -m pytest -n "${DFO_TEST_WORKERS:-2}" --dist loadgroup "$@"
}

main "$@"
