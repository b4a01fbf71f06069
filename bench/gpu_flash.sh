#!/usr/bin/env bash
# FlashAttention-4's CuTe kernels under FlexAttention (BACKEND=FLASH) against its Triton ones (the trainer's), on
# one H200 (nvidia-h200), from the repository root. flash-attn-4 and its libraries are not on the device image and
# their wheels (~70 MiB, one of them 92 MB) are over the device tool's 64 MiB a call, so they travel as a tar
# cut in two (`split -n 2`), one half a call, on one machine held between the calls:
#     here, once: pip download --no-deps (python 3.12, manylinux x86_64) flash-attn-4==4.0.0b36
#         nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
#         nvidia-cutlass-dsl-libs-cu13==4.8.1 (unpacked, then tar.xz: 60.6 MiB) apache-tvm-ffi torch-c-dlpack-ext
#         quack-kernels into one tar; `split -n 2 -d` into .fa4/a/p00 and .fa4/b/p01 (.git/info/exclude: /.fa4/)
#     bash bench/gpu_flash.sh stash     # call 1 (carry .fa4/a): keeps the first half in /root/fa4
#     bash bench/gpu_flash.sh install   # call 2 (carry .fa4/b): joins the halves, installs into python3's env
#     bash bench/gpu_flash.sh ab        # then: bench/gpu_probe.py --part flash (the drafter's attention alone,
#                                       # both kernels, at its real shapes)
# The whole trainer with these kernels was run once, at 24b10ca (a drafter.attention=flash option since taken
# out again: no gain; docs/benchmarks-archive.md, "Session 9").
# Output under $OUT as it comes (probe.jsonl, probe-flash.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
stash)
    mkdir -p /root/fa4 && cp .fa4/a/* /root/fa4/ && ls -la /root/fa4 ;;
install)
    cp .fa4/b/* /root/fa4/ && cd /root/fa4 && cat p00 p01 >bundle.tar && md5sum bundle.tar && mkdir -p x \
        && tar xf bundle.tar -C x || exit 1
    site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir x/*.whl || exit 1
    tar xJf x/cu13.tar.xz -C "$site" || exit 1
    python3 -c "import flash_attn.cute, cutlass; print('flash_attn.cute ok', cutlass.__file__)" ;;
ab)
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-flash-probe timeout 240 python3 bench/gpu_probe.py --out "$OUT" --part flash \
        --steps 12 >"$OUT/probe-flash.log" 2>&1
    echo "probe-flash rc=$?" | tee -a "$OUT/rc.txt" ;;
*) echo "usage: bash bench/gpu_flash.sh stash|install|ab" >&2; exit 2 ;;
esac
