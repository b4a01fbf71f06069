#!/usr/bin/env bash
# Usage: sudo bash scripts/cpu_of.sh COMMAND [ARG...]
# Runs COMMAND in a cgroup of its own and prints, on stderr after it ends, its wall time and the CPU time of
# everything it started: also what a test's sshd or a daemonised trainer left to init, which a shell's `time`
# (only waited-for children) does not count. For profiling dfo's test suite one file or test at a time
# (docs/benchmarks.md, "dfo's own test suite"). Needs root and cgroup v1's cpuacct or cgroup v2.
# Exit status: COMMAND's.
set -uo pipefail

if [[ -d /sys/fs/cgroup/cpuacct ]]; then
    group=/sys/fs/cgroup/cpuacct/dfo-cpu-of-$$
    read_ns() { cat "$group/cpuacct.usage"; }
else
    group=/sys/fs/cgroup/dfo-cpu-of-$$
    read_ns() { echo $(($(awk '$1 == "usage_usec" {print $2}' "$group/cpu.stat") * 1000)); }
fi
mkdir "$group" || { echo "cpu_of.sh: cannot make a cgroup (root and cgroup v1 cpuacct or v2 needed)" >&2; exit 2; }
parent=$(dirname "$group")
echo $$ >"$group/cgroup.procs"
started=$(date +%s.%N)
"$@"
status=$?
ended=$(date +%s.%N)
echo $$ >"$parent/cgroup.procs"
sleep 1  # what COMMAND left running: counted until now; the cgroup goes once it is empty
used=$(read_ns)
printf 'cpu_of: wall %.1f s, cpu %.1f s, load %s: %s\n' "$(echo "$ended - $started" | bc)" \
    "$(echo "$used / 1000000000" | bc -l)" "$(cut -d' ' -f1-3 /proc/loadavg)" "$*" >&2
rmdir "$group" 2>/dev/null
exit $status
