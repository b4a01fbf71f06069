#!/usr/bin/env bash
# The declared floors hold: installs the lowest version pyproject.toml allows of each CLI-facing dependency
# (typer, rich, pydantic, PyYAML, ruamel.yaml: FLOORED below) into a separate venv, .venv-floor, and runs the
# CLI on it: `dfo --help` and every command's --help (with its example), `dfo inventory check` (also of the lab example),
# `dfo runs --json` and a usage error. Everything else comes from .venv (scripts/test.sh makes it), seen
# through a .pth behind the floor's own site-packages, so the floors win and nothing else is installed twice.
# Called by scripts/test.sh before the tests (DFO_SKIP_FLOOR=1 skips it); on its own: bash scripts/floor.sh
# Exit status: 0 when every command behaved, else 1 (the failing command and its output are printed).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FLOOR=.venv-floor
FLOORED=(typer rich pydantic PyYAML ruamel.yaml)

log() { printf '[floor.sh] %s\n' "$*" >&2; }

floors=$("$VENV/bin/python" - "${FLOORED[@]}" <<'EOF'
import re, sys, tomllib
wanted = {name.lower() for name in sys.argv[1:]}
with open("pyproject.toml", "rb") as file:
    for requirement in tomllib.load(file)["project"]["dependencies"]:
        name, low = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", requirement).groups()
        if name.lower() in wanted:
            print(f"{name}=={low}")
EOF
)
stamp=$(echo "$floors" | sha256sum | cut -d' ' -f1)
if [[ ! -f $FLOOR/.dfo-floor || $(cat "$FLOOR/.dfo-floor") != "$stamp" ]]; then
    log "installing the declared floors into $FLOOR: $(echo $floors)"
    rm -rf "$FLOOR"
    "$VENV/bin/python" -m venv "$FLOOR"
    base=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$FLOOR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$base')" >"$own/zz-dfo-base.pth"  # after the floor's own packages
    # shellcheck disable=SC2086
    if ! "$FLOOR/bin/python" -m pip install -q --disable-pip-version-check $floors 2>"$FLOOR/pip.log"; then
        cat "$FLOOR/pip.log" >&2; exit 1
    fi
    echo "$stamp" >"$FLOOR/.dfo-floor"
fi

failed=0
dfo() {
    local out
    if ! out=$(DFO_HOME=$home "$FLOOR/bin/python" -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' "$@" 2>&1); then
        log "FAILED on the floors: dfo $*"; printf '%s\n' "$out" | tail -20 >&2; failed=1
    fi
}
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
"$FLOOR/bin/python" -c 'from importlib.metadata import version as v; print("[floor.sh] on " + ", ".join(f"{n} {v(n)}" for n in ("typer", "click", "rich", "pydantic")))' >&2
dfo --help
"$FLOOR/bin/python" - <<'EOF' || failed=1  # every command's --help, with its example, in one process
import sys
import typer.main
from typer.testing import CliRunner
from orchestrator.cli import app

def paths(group, prefix=()):
    for name, command in getattr(group, "commands", {}).items():
        yield (*prefix, name)
        yield from paths(command, (*prefix, name))

bad = [(path, result.output[-600:]) for path in paths(typer.main.get_command(app))
       for result in [CliRunner().invoke(app, [*path, "--help"])] if result.exit_code != 0 or "Example: dfo " not in result.output]
for path, output in bad:
    print(f"[floor.sh] FAILED on the floors: dfo {' '.join(path)} --help\n{output}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
dfo inventory check
dfo inventory check -i inventory/lab.example.yaml
dfo runs --json
if DFO_HOME=$home "$FLOOR/bin/python" -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' preflight --host nosuch >/dev/null 2>"$home/err"; then
    log "FAILED on the floors: dfo preflight --host nosuch exited 0"; failed=1
elif ! grep -q "^dfo: error: .*unknown target 'nosuch'" "$home/err"; then
    log "FAILED on the floors: dfo preflight --host nosuch said:"; cat "$home/err" >&2; failed=1
fi
((failed)) || log "the CLI runs on the declared floors"
exit "$failed"
