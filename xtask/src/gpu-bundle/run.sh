#!/usr/bin/env bash
# The cmm GPU bundle: every GPU check of the CUDA backend in one command, on a machine
# with an NVIDIA GPU and CUDA 13 but no Rust toolchain. Built by `cargo xtask gpu-bundle`
# (see docs/cuda.md); the folder holds the binaries, the corpus, the goldens and this
# script.
#
#   bash run.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./out beside this script
#
# Writes under OUT_DIR: summary.md, summary.json, bench-kernels.json, bench-memops.json
# and logs.tar.gz. Steps run in order of importance under one time budget
# (CMM_BUNDLE_BUDGET seconds, default 560: a device call may last 600); a step that no
# longer fits is skipped and says so. CMM_BUNDLE_STEPS="a b …" runs only the named steps.
# CMM_BUNDLE_DRY_RUN=1 walks the GPU path without a GPU and runs none of its steps: each
# step's program must exist and its `bash -c` script parse (`cargo xtask gpu-bundle
# --check` does this, so that a shell error in the GPU path shows here, not on the GPU).
# Exit status: 0 when every step passed, 1 when one failed or was skipped, 3 without a GPU.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-${OUT:-$here/out}}"
budget="${CMM_BUNDLE_BUDGET:-560}"
# The budget counts from here: the library search and the start checks below take time of
# the same device call.
start=$SECONDS
wanted="${CMM_BUNDLE_STEPS:-all}"
dry="${CMM_BUNDLE_DRY_RUN:-0}"
mkdir -p "$out"
scratch="$(mktemp -d)"
logs="$scratch/logs"
mkdir -p "$logs"
export CMM_REQUIRE_GPU=1
# The gate needs every kernel loaded before the lanes are held (lazy loading, CUDA's
# default, makes a first launch wait for the running kernels: docs/cuda.md).
export CUDA_MODULE_LOADING="${CUDA_MODULE_LOADING:-EAGER}"
export CMM_CASES_DIR="$here/cases" CMM_GOLDEN_DIR="$here/golden" CMM_STAMP_DIR="$scratch/stamps"
CMM_COMMIT="$(cat "$here/COMMIT" 2>/dev/null || echo unknown)"
export CMM_COMMIT
# The kernels' cubins as `cargo xtask cuda-check` checked them: the backend loads them
# rather than compile (NVRTC and the driver took most of a minute on hopper.cu); a file
# whose image is missing or refused is compiled, and each `adapter:` line says which.
if [ -d "$here/kernels" ]; then
    export CMM_KERNEL_IMAGES="$here/kernels"
fi
printf 'step\trc\tseconds\tnote\n' >"$logs/steps.tsv"

finish() {
    if ! "$here/bin/xtask" gpu-bundle-summary --logs "$logs" --out "$out"; then
        echo "bundle: the summary could not be written; the raw step table:"
        cat "$logs/steps.tsv"
        cp "$logs/steps.tsv" "$out/steps.tsv"
    fi
    tar -czf "$out/logs.tar.gz" -C "$scratch" logs
    cat "$out/summary.md" 2>/dev/null
}

# --- libraries: the driver, NVRTC and cuBLAS, wherever this machine keeps them -------
find_lib() {
    local name="$1" dir="" ld
    local IFS_saved="$IFS"
    IFS=:
    for ld in ${LD_LIBRARY_PATH:-}; do
        if [ -n "$ld" ] && [ -e "$ld/$name" ]; then
            IFS="$IFS_saved"
            echo "$ld"
            return 0
        fi
    done
    IFS="$IFS_saved"
    dir="$(ldconfig -p 2>/dev/null | awk -v l="$name" '$1 == l { print $NF; exit }')"
    if [ -z "$dir" ]; then
        local roots=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia /usr/lib/x86_64-linux-gnu /opt /usr/local/lib)
        local py
        py="$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)"
        # shellcheck disable=SC2206
        roots+=($py)
        dir="$(find "${roots[@]}" -name "$name" 2>/dev/null | head -n 1)"
    fi
    [ -n "$dir" ] && dirname "$dir"
}
{
    echo "libraries:"
    for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
        if dir="$(find_lib "$lib")" && [ -n "$dir" ]; then
            echo "  $lib: $dir"
            case ":${LD_LIBRARY_PATH:-}:" in *":$dir:"*) ;; *) export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
        else
            echo "  $lib: not found"
        fi
    done
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} >"$logs/libraries.log" 2>&1

# --- the bundle's binaries must start here (they were built against another glibc) -------
for bin in xtask cuda-device-tests conformance-cuda-tests; do
    if ! "$here/bin/$bin" --help >/dev/null 2>"$logs/start-$bin.log"; then
        {
            echo "bundle: bin/$bin does not start on this machine; nothing can run:"
            head -n 3 "$logs/start-$bin.log"
            echo "It needs glibc >= $(cat "$here/GLIBC" 2>/dev/null || echo '?'); this machine has: $(ldd --version 2>&1 | head -n 1)."
            echo "Build the bundle on a machine whose glibc is no newer than this one's (docs/cuda.md)."
        } | tee -a "$logs/env.log"
        printf 'start-%s\t1\t0\t%s\n' "$bin" "does not start: $(head -n 1 "$logs/start-$bin.log" | tr '\t' ' ')" >>"$logs/steps.tsv"
        cp "$logs/steps.tsv" "$out/steps.tsv"
        tar -czf "$out/logs.tar.gz" -C "$scratch" logs
        exit 1
    fi
done

# --- steps -----------------------------------------------------------------------------
failed=0
step() { # step NAME LIMIT_SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    if [ "$wanted" != all ] && [[ " $wanted " != *" $name "* ]]; then
        return
    fi
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 20 ]; then
        printf '%s\t-\t0\tskipped: the time budget is spent\n' "$name" >>"$logs/steps.tsv"
        echo "bundle: $name skipped (time budget spent)"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$dry" = 1 ]; then
        dry_step "$name" "$@"
        return
    fi
    echo "bundle: $name (limit ${limit} s)"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    local note=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="time limit of ${limit} s reached"
    # Some GPU machines' runtimes (gVisor) refuse compute-sanitizer the device: say so,
    # rather than let the step read as a finding of cmm's.
    if [ "$rc" -ne 0 ] && grep -q "Device not supported" "$logs/$name.log"; then
        note="compute-sanitizer refused the device (as on a gVisor runtime): nothing was checked"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" >>"$logs/steps.tsv"
    # The table so far where the call returns it: a run stopped before `finish` (the device
    # call's limit) still says which steps ran, passed and took how long.
    cp "$logs/steps.tsv" "$out/steps.tsv"
    [ "$rc" -eq 0 ] || failed=1
}
x="$here/bin/xtask"
dry_step() { # dry_step NAME COMMAND...: what `step` would run exists, and a script parses
    local name="$1" program
    shift
    program="$1"
    if [ "$program" = env ]; then
        shift
        while [[ "${1:-}" == *=* ]]; do shift; done
        program="${1:-}"
    fi
    local problem=""
    if ! command -v "$program" >/dev/null 2>&1; then
        problem="dry run: no program \`$program\`"
    elif [ "$program" = bash ] && [ "${2:-}" = -c ]; then
        # The script parses, and its first word means something to the bash that runs it:
        # a keyword, a command, or a function this script exported.
        local first="${3%%[[:space:];]*}"
        if ! bash -n -c "$3" >"$logs/$name.log" 2>&1; then
            problem="dry run: its script does not parse: $(head -n 1 "$logs/$name.log" | tr '\t' ' ')"
        elif [ -z "$(bash -c "type -t '$first'" 2>/dev/null)" ]; then
            problem="dry run: its script starts with \`$first\`, neither a command nor an exported function"
        fi
    fi
    if [ -n "$problem" ]; then
        printf '%s\t2\t0\t%s\n' "$name" "$problem" >>"$logs/steps.tsv"
        failed=1
    else
        printf '%s\t-\t0\tdry run: not executed\n' "$name" >>"$logs/steps.tsv"
    fi
}

# --- rehearsal: the folder's own binaries and data, without a GPU -----------------------
# With NVRTC at hand, the GPU steps themselves run on the fake CUDA driver (cmm-cuda
# `fake`: the backend's driver and cuBLAS calls on the CPU, the kernels on the host
# twin), the memops corpus on a single hardware queue; without it, the host twin alone.
if [ "${CMM_BUNDLE_REHEARSAL:-0}" = 1 ]; then
    if grep -q "libnvrtc.so.13: /" "$logs/libraries.log"; then
        export CMM_FAKE_CUDA=1
        {
            echo "rehearsal: no GPU used; the CUDA backend runs on the fake CUDA driver (C++ compiler: ${CXX:-c++})"
            echo "commit: $CMM_COMMIT"
            uname -a
        } >"$logs/env.log" 2>&1
        # The device tests in parallel here (on a GPU one at a time, for the GEMM timer);
        # on the fake driver they take the host twin's sizes.
        step rehearsal-device-tests 150 "$here/bin/cuda-device-tests" --skip host_
        step rehearsal-conformance-kernels 150 "$x" conformance --backend cuda --sync kernels --case-timeout 30
        step rehearsal-conformance-processes 150 "$x" conformance --backend cuda --sync kernels --processes --case-timeout 30
        # The lowering's variants on a sample that holds every op/algorithm pair of the
        # corpus at its smallest D (a third of the cases: the GPU steps run them all;
        # xtask's test `the_rehearsal_sample_holds_every_op_algorithm_pair` keeps it so).
        sample=_d2_,_d3_,2x2,megatron_d4
        step rehearsal-conformance-staggered 90 "$x" conformance --backend cuda --sync kernels --stagger \
            --filter "$sample" --case-timeout 30 --stamps "$scratch/staggered-stamps"
        step rehearsal-conformance-offsets 90 "$x" conformance --backend cuda --sync kernels --offset-starts \
            --filter "$sample" --case-timeout 30 --stamps "$scratch/offset-stamps"
        step rehearsal-conformance-wide-tiles 90 "$x" conformance --backend cuda --sync kernels --wide-tiles \
            --no-hopper --filter "$sample" --case-timeout 30 --stamps "$scratch/wide-stamps"
        step rehearsal-conformance-copy-engines 90 "$x" conformance --backend cuda --sync kernels \
            --copies copy-engines --filter "$sample" --case-timeout 30 --stamps "$scratch/copy-engines-stamps"
        step rehearsal-conformance-driver-copies 90 "$x" conformance --backend cuda --sync kernels \
            --copies driver --filter "$sample" --case-timeout 30 --stamps "$scratch/driver-copies-stamps"
        # (The whole corpus on the clusters of two and on the ping-pong kernels runs in
        # `cargo test` on the host twin: here the commands' paths, on two-device cases.)
        step rehearsal-conformance-hopper-pair 90 "$x" conformance --backend cuda --sync kernels --hopper \
            --hopper-variant pair --filter _d2_ --case-timeout 30 --stamps "$scratch/hopper-pair-stamps"
        step rehearsal-conformance-hopper-pingpong 90 "$x" conformance --backend cuda --sync kernels --hopper \
            --hopper-tile narrow --hopper-variant pingpong --filter fused_d2_,moe_ag_ring_d2_,moe_rs_ring_d2_ \
            --case-timeout 30 --stamps "$scratch/hopper-pingpong-stamps"
        step rehearsal-conformance-fused-ctas 60 "$x" conformance --backend cuda --sync kernels --no-hopper \
            --filter fused --input f16,bf16 --fused-ctas-per-sm 2 --case-timeout 30 --stamps "$scratch/fused-ctas-stamps"
        # The benches' paths (the fake driver's times mean nothing): two runs, one for the
        # variants.
        step rehearsal-bench 120 "$x" bench --backend cuda --sync kernels --shrink 64 --reps 2 \
            --json "$out/bench-rehearsal.json" --timelines "$scratch/timelines"
        step rehearsal-model-vs-bench 30 "$x" simulate --validate-bench "$out/bench-rehearsal.json"
        step rehearsal-bench-8-queues 90 env CUDA_DEVICE_MAX_CONNECTIONS=8 "$x" bench --backend cuda --sync kernels \
            --shrink 64 --reps 1 --algorithms fused,ring --json "$scratch/bench-8-queues.json"
        step rehearsal-bench-narrow 90 "$x" bench --backend cuda --sync kernels --shrink 64 --reps 1 \
            --algorithms fused --hopper-tile narrow --json "$scratch/bench-narrow.json"
        # fused_push's persistent kernels wait for each other: one queue cannot hold them,
        # and the lowering refuses them there (conformance/tests/queues.rs).
        step rehearsal-conformance-memops-one-queue 150 env CUDA_DEVICE_MAX_CONNECTIONS=1 \
            "$x" conformance --backend cuda --sync memops --case-timeout 30 --filter '!fused_push'
        step rehearsal-cuda-tests 90 "$here/bin/conformance-cuda-tests" --test-threads=1 reversed_ring_fails missing_signal_deadlocks baselines_pass_with_their_sums_beside
        step rehearsal-conformance-repeated 90 "$x" conformance --backend cuda --sync kernels --filter _d8_ \
            --schedules 2 --case-timeout 30 --stamps "$scratch/repeated-stamps"
        # The sanitizer steps' command, with every launch blocking as under a tool that
        # serialises GPU work.
        step rehearsal-sanitizer-command 90 env CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 \
            "$x" conformance --backend cuda --filter ring_d2_,ring_push_d2_ --case-timeout 60 --ungated --stamps "$scratch/sanitizer-stamps"
        step rehearsal-sanitizer-fused-command 90 env CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 \
            "$x" conformance --backend cuda --filter fused_d2_ --case-timeout 60 --ungated --stamps "$scratch/sanitizer-stamps"
        step rehearsal-sanitizer-hopper-command 90 env CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 \
            "$x" conformance --backend cuda --filter ring_d2_,fused_d2_ --hopper --case-timeout 60 --ungated \
            --stamps "$scratch/sanitizer-stamps"
        step rehearsal-sanitizer-hopper-staged-command 90 env CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 \
            "$x" conformance --backend cuda --filter moe_ag_ring_d2_ --hopper --hopper-variant staged-gather \
            --case-timeout 60 --ungated --stamps "$scratch/sanitizer-stamps"
        step rehearsal-sanitizer-hopper-tma-store-command 90 env CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 \
            "$x" conformance --backend cuda --filter fused_d2_,moe_ag_ring_d2_,moe_rs_ring_d2_ --hopper \
            --hopper-variant tma-store --case-timeout 60 --ungated --stamps "$scratch/sanitizer-stamps"
        # The GEMM sweep's path (its spot checks included) on shapes 32 times smaller: the
        # fake driver's times mean nothing.
        step rehearsal-gemm-sweep 120 "$x" gemm-sweep --shrink 32 --reps 2 --json "$scratch/gemm-sweep.json"
        # What the ncu step runs under the profiler (no profiler here).
        step rehearsal-gemm-sweep-profile 60 "$x" gemm-sweep --shrink 32 --profile
    else
        unset CMM_REQUIRE_GPU
        {
            echo "rehearsal: no GPU used and no libnvrtc.so.13: the CUDA kernels run on the host twin (C++ compiler: ${CXX:-c++})"
            echo "commit: $CMM_COMMIT"
            uname -a
        } >"$logs/env.log" 2>&1
        step rehearsal-device-tests 120 "$here/bin/cuda-device-tests" --test-threads=1 host_
        step rehearsal-conformance-kernels 150 "$x" conformance --backend cuda-host --sync kernels --filter _d2_
        step rehearsal-conformance-memops 150 "$x" conformance --backend cuda-host --sync memops --filter _d2_
    fi
    finish
    exit "$failed"
fi

# --- no GPU: say so and stop -----------------------------------------------------------
# Only a rehearsal may put the fake driver in place of the real one.
unset CMM_FAKE_CUDA
if [ "$dry" = 1 ]; then
    echo "dry run: no GPU used, no step run; the GPU path walked as a GPU machine would" >"$logs/env.log"
elif ! nvidia-smi -L >"$logs/env.log" 2>&1 || ! grep -q "libcuda.so.1: /" "$logs/libraries.log"; then
    {
        echo "no GPU: this machine has no working NVIDIA driver (nvidia-smi -L and libcuda.so.1 are needed)."
        echo "Run this bundle on a GPU machine; see docs/cuda.md."
    } | tee -a "$logs/env.log"
    printf 'env\t3\t0\tno GPU\n' >>"$logs/steps.tsv"
    finish >/dev/null
    exit 3
fi

export here scratch x
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    # (No apostrophe inside ${…:-…}: within double quotes bash reads it as opening a
    # single-quoted string, and the whole script then fails to parse.)
    echo "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset (the binaries of cmm set 32)}"
    echo "CUDA_MODULE_LOADING=$CUDA_MODULE_LOADING"
    echo "CMM_KERNEL_IMAGES=${CMM_KERNEL_IMAGES:-unset (the kernels are compiled here)}"
    echo "commit: $CMM_COMMIT"
    uname -a
    ldd --version 2>&1 | head -n 1
} >>"$logs/env.log" 2>&1

# The gate holds every lane until the whole plan is enqueued. Should a launch still wait
# for the running kernels here, the host would sit at it until the gate's deadline and
# every case would take that long: two small gated cases first, briefly; if they do not
# pass, every later step runs ungated (CMM_CUDA_GATE=0), and env.log says so.
step gate-probe 45 "$x" conformance --backend cuda --filter ag_gemm_baseline_d2_ --case-timeout 10 \
    --stamps "$scratch/probe-stamps"
if [ "$(tail -n 1 "$logs/steps.tsv" | cut -f 1)" = gate-probe ] && [ "$(tail -n 1 "$logs/steps.tsv" | cut -f 2)" != 0 ]; then
    export CMM_CUDA_GATE=0
    echo "gate-probe failed: every later step runs ungated (CMM_CUDA_GATE=0)" >>"$logs/env.log"
fi
# fused_push's persistent kernels wait for each other round the ring (from D = 3): they
# must all run at once on the one GPU, which no GPU has shown yet. Two such cases first,
# briefly; if they do not pass, every later corpus step leaves fused_push out
# (CMM_CONFORMANCE_EXCLUDE), so that a hang does not spend their time limits, and env.log
# says so. The bench then refuses its rows for want of a stamp.
step fused-push-probe 40 "$x" conformance --backend cuda --sync kernels \
    --filter gemm_rs_fused_push_d4_,gemm_rs_fused_push_d8_ --case-timeout 10 --stamps "$scratch/probe-stamps"
if [ "$(tail -n 1 "$logs/steps.tsv" | cut -f 1)" = fused-push-probe ] && [ "$(tail -n 1 "$logs/steps.tsv" | cut -f 2)" != 0 ]; then
    export CMM_CONFORMANCE_EXCLUDE=fused_push
    echo "fused-push-probe failed: every later corpus step leaves fused_push out (CMM_CONFORMANCE_EXCLUDE)" >>"$logs/env.log"
fi
# The Hopper engine (hopper.cu) first: its local GEMM against cuBLAS on the overlapped
# plans' shapes, every variant spot-checked before it is timed; then the corpus with every
# GEMM on cmm's own kernels and the Hopper engine wherever it applies, on each tile.
step gemm-sweep 180 "$x" gemm-sweep --json "$out/gemm-sweep.json"
step conformance-hopper 90 "$x" conformance --backend cuda --sync kernels --hopper --case-timeout 30 \
    --stamps "$scratch/hopper-stamps"
step conformance-hopper-wide 90 "$x" conformance --backend cuda --sync kernels --hopper --hopper-tile wide \
    --case-timeout 30 --stamps "$scratch/hopper-wide-stamps"
# Every plain GEMM whose B is N-major on the engine's clusters of two (the sweep's
# `cluster 2` rows), which plans never take: right on every shape of the corpus.
step conformance-hopper-pair 90 "$x" conformance --backend cuda --sync kernels --hopper --hopper-variant pair \
    --case-timeout 30 --stamps "$scratch/hopper-pair-stamps"
# Every GEMM the engine takes on its 128×128 ping-pong kernels (the sweep's `pingpong`
# rows; plain, fused and grouped), which plans never take: right on every shape.
step conformance-hopper-pingpong 90 "$x" conformance --backend cuda --sync kernels --hopper --hopper-tile narrow \
    --hopper-variant pingpong --case-timeout 30 --stamps "$scratch/hopper-pingpong-stamps"
# Every GEMM the engine takes on its TMA-store kernels (the sweep's `tma store` rows),
# which plans never take: right on every shape (the corpus's tiles are mostly partial and
# leave from registers; the device tests' TMA-store case has whole ones).
step conformance-hopper-tma-store 90 "$x" conformance --backend cuda --sync kernels --hopper \
    --hopper-variant tma-store --case-timeout 30 --stamps "$scratch/hopper-tma-store-stamps"
# ag_moe's cases with their gathered rows staged first and loaded by TMA, which the
# engine does from 512 columns (the sweep's grouped rows), more than the corpus's have.
step conformance-hopper-staged-gather 60 "$x" conformance --backend cuda --sync kernels --hopper \
    --hopper-variant staged-gather --filter moe_ag --case-timeout 30 --stamps "$scratch/hopper-staged-stamps"
# The host-twin tests (host_*) need a C++ compiler, not a GPU: they run in CI.
step device-tests 150 "$here/bin/cuda-device-tests" --test-threads=1 --skip host_
step conformance-kernels 150 "$x" conformance --backend cuda --sync kernels --case-timeout 30
# The corpus with every copy-engine copy asked of the copy engines, strided ones a row at
# a time (the default asks only the contiguous ones, one call each), and with every copy
# left to the driver (cuMemcpy2DAsync, the default before 2026-11-27 and where the driver
# lacks cuMemcpyBatchAsync; the bench's `driver copies` column).
step conformance-copy-engines 90 "$x" conformance --backend cuda --sync kernels --copies copy-engines \
    --case-timeout 30 --stamps "$scratch/copy-engines-stamps"
step conformance-driver-copies 60 "$x" conformance --backend cuda --sync kernels --copies driver \
    --case-timeout 30 --stamps "$scratch/driver-copies-stamps"
# The same corpus with each virtual device's lanes at its staggered priority, and with the
# devices' starts offset (the bench's `staggered` and `offsets` columns): only priorities
# change, or waits are added, so results must not.
step conformance-staggered 90 "$x" conformance --backend cuda --sync kernels --stagger --case-timeout 30 \
    --stamps "$scratch/staggered-stamps"
step conformance-offsets 90 "$x" conformance --backend cuda --sync kernels --offset-starts --case-timeout 30 \
    --stamps "$scratch/offset-stamps"
# The tile kernels on 128×128 tiles (the fused plans' GEMMs, the Hopper engine off; the
# bench times them both ways).
step conformance-wide-tiles 60 "$x" conformance --backend cuda --sync kernels --wide-tiles --no-hopper --case-timeout 30 \
    --stamps "$scratch/wide-stamps"
# The fused plans' persistent kernel at 2 CTAs per SM (64×64 tensor-core tiles), which the
# bench times too; f32 inputs run the SIMT tile, of which an SM holds 2, so 2 are refused.
step conformance-fused-ctas 45 "$x" conformance --backend cuda --sync kernels --no-hopper --filter fused --input f16,bf16 \
    --fused-ctas-per-sm 2 --case-timeout 30 --stamps "$scratch/fused-ctas-stamps"
# Its timelines (dozens of files) travel in logs.tar.gz: a device call returns 8 files.
step bench-kernels 300 "$x" bench --backend cuda --sync kernels --json "$out/bench-kernels.json" \
    --timelines "$logs/timelines"
# The bench's times beside the one-GPU simulator profile, as it stands and calibrated by the
# bench's own figures (CPU only, seconds).
step model-vs-bench 30 "$x" simulate --validate-bench "$out/bench-kernels.json"
# cmm.cuda.run on the machine's PyTorch CUDA tensors through DLPack, in one process and in
# one process per device as torchrun launches it, with the cmm wheel the bundle carries.
python_torch() {
    if ! compgen -G "$here/python/*.whl" >/dev/null; then
        echo "python: not bundled (the bundle's build line says why); nothing run"
        return 0
    fi
    local site="$scratch/python"
    python3 -m pip install --quiet --no-index --no-deps --target "$site" "$here"/python/*.whl || return 1
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 "$here/python/test_torch_gpu.py"
}
export -f python_torch
step python-torch 150 bash -c python_torch
step cuda-tests 90 "$here/bin/conformance-cuda-tests" --test-threads=1 reversed_ring_fails missing_signal_deadlocks baselines_pass_with_their_sums_beside
sanitize() { # corpus cases (the smallest ring ones, and ring_push's GEMMs on a peer's c,
    # unless $2 names others) under one tool; further arguments go to conformance
    # Ungated: a tool that makes launches blocking or runs GPU work one item at a time
    # would hold the host at the gate's launch; the schedule order runs either way.
    local tool="$1" filter="${2:-ring_d2_,ring_push_d2_}"
    if [ $# -ge 2 ]; then shift 2; else shift $#; fi
    compute-sanitizer --tool "$tool" --error-exitcode 17 --print-limit 20 \
        "$x" conformance --backend cuda --filter "$filter" --case-timeout 60 --ungated \
        --stamps "$scratch/sanitizer-stamps" "$@"
}
export -f sanitize
# The Hopper engine's kernels (plain and fused, both tiles, and the ping-pong ones) under
# every tool, first: the engine's kernels are the newest. (ring_d2_ takes in the MoE ring cases, whose grouped GEMMs run on the engine:
# moe_rs's A through TMA, ag_moe's gathered rows through cp.async; the wide tile and the
# ping-pong kernels get them too.) Then the kernels no GPU tool has yet seen (2026-11-28):
# ag_moe's rows staged by cmm_gather_rows and loaded by TMA, and the TMA-store kernels.
# fused_push_d2_ (since 2026-11-29): persistent kernels adding into a peer's c.
step sanitizer-hopper 240 bash -c 'for tool in memcheck racecheck synccheck; do
    sanitize "$tool" ring_d2_,fused_d2_,fused_push_d2_ --hopper || exit $?
    sanitize "$tool" fused_d2_,moe_ag_ring_d2_,moe_rs_ring_d2_ --hopper --hopper-tile wide || exit $?
    sanitize "$tool" fused_d2_,moe_ag_ring_d2_,moe_rs_ring_d2_ --hopper --hopper-tile narrow \
        --hopper-variant pingpong || exit $?
    sanitize "$tool" moe_ag_ring_d2_ --hopper --hopper-variant staged-gather || exit $?
    sanitize "$tool" fused_d2_,moe_ag_ring_d2_,moe_rs_ring_d2_ --hopper --hopper-variant tma-store || exit $?; done'
# The engine's kernels under Nsight Compute where the machine has it: each kernel's speed
# of light (SM, memory, DRAM and L2 throughput) and occupancy, at 8192³ and on the MoE
# grouped GEMMs beside the plain GEMM on their dense shapes, on both tiles and the
# ping-pong kernels (`gemm-sweep --profile` runs them ungated: a profiler serialises
# launches): 53 launches, every one the profile mode makes of these kernels (the sweep's
# `profiled_launches`, which a test holds this count to, and which it prints). 48 of
# cmm_hopper kernels: each of the 17 plain and dense GEMMs twice (its warm-up, then its
# run), each of the 14 grouped ones once. 5 of cmm_gather_rows, which stage ag_moe's rows
# on the engine's own variants: what the staging costs, and at what DRAM throughput.
# Until 2026-11-28 the count was 32, under the 46 launches then made, so the last runs
# (moe_rs's) would have gone unprofiled. It comes after the steps that decide the
# engine's targets and its correctness, so that a slow profiler cannot starve them.
ncu_hopper() {
    local ncu
    ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    if [ -z "$ncu" ]; then
        echo "ncu: not on this machine; nothing profiled"
        return 0
    fi
    echo "ncu: $ncu"
    "$ncu" --clock-control none -k 'regex:cmm_hopper|cmm_gather_rows' --launch-count 53 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats "$x" gemm-sweep --profile
}
export -f ncu_hopper
step ncu-hopper 120 bash -c ncu_hopper
# The sanitizers on cmm's other kernels (the signals, waits and copies of the smallest ring
# cases, and ring_push's GEMMs on a peer's c), under every tool.
step sanitizer-memcheck 90 bash -c 'sanitize memcheck'
step sanitizer-racecheck 90 bash -c 'sanitize racecheck'
step sanitizer-synccheck 90 bash -c 'sanitize synccheck'
# Hangs and races that show only under repetition: the 8-device cases (the most streams
# contending for queues and SMs) five times each, every run's outputs bit-identical.
# (Its stamps go aside: a filtered run must not stand for the corpus run's.)
step conformance-repeated 90 "$x" conformance --backend cuda --sync kernels --filter _d8_ \
    --schedules 5 --case-timeout 30 --stamps "$scratch/repeated-stamps"
# The fused plans and their twins again with every GEMM on the engine's own 128×128 kernels
# (`--hopper-tile narrow`), which the tile rule gives every plain GEMM with K under 8192 but
# the fused rule does not (128×256 wherever those tiles fill a device's SMs): the fused
# plans' GEMMs have K = 4096 (gemm_rs's write f32 partial sums), where plain GEMMs ran
# faster on 128×128 (0.80 against 0.71–0.76 of cuBLAS; 0.69 against 0.53 on moe_rs's f32
# rows). Only the ping-pong 128×128 kernels had been timed in fused plans (2026-11-27, 12 %
# slower than the engine's own 128×128 at 1024×4096×4096); that step, measured, gave way to
# this one. Summarised beside the bench's rows; the JSON travels in logs.tar.gz. This and
# the next two come after the sanitizers since 2026-11-27, when, with the bench before
# them, the sanitizers did not fit the budget.
step bench-kernels-narrow 150 "$x" bench --backend cuda --sync kernels --algorithms fused \
    --hopper-tile narrow --json "$logs/bench-kernels-narrow.json"
# The same on the TMA-store kernels (C staged in shared memory and stored by TMA, a fused
# block released once its stores have completed): whether the epilogue is part of the
# fused plans' excess.
step bench-kernels-tma-store 150 "$x" bench --backend cuda --sync kernels --algorithms fused \
    --hopper-variant tma-store --json "$logs/bench-kernels-tma-store.json"
# The fused and ring plans again on the 8 hardware queues CUDA gives unasked (cmm's
# binaries ask for 32, since 2026-11-26's last runs): how much of the fused plans' excess
# over their twins was lanes queued behind other devices' spinning waits (measured
# 2026-11-27, with the driver's copies: the ring plans within 0.5 % of the bench's times,
# the fused ones 0.41 to 1.08 of them). The JSON travels in logs.tar.gz.
step bench-kernels-8-queues 150 env CUDA_DEVICE_MAX_CONNECTIONS=8 "$x" bench --backend cuda --sync kernels \
    --algorithms fused,ring --json "$logs/bench-kernels-8-queues.json"
# The corpus and the bench with stream memory operations for signals and waits: the bench
# was within a few per cent of kernel waits on both GPUs measured, so it comes after the
# sanitizers, which the new kernels need.
step conformance-memops 120 "$x" conformance --backend cuda --sync memops --case-timeout 30
step bench-memops 200 "$x" bench --backend cuda --sync memops --json "$out/bench-memops.json"
reference_on_vulkan() { # the wgpu reference on this GPU's Vulkan driver
    if { ! ldconfig -p | grep -q libvulkan.so.1 || ! ldconfig -p | grep -q libGLdispatch.so.0; } \
        && compgen -G "$here/vulkan/*.deb" >/dev/null; then
        local root="$scratch/vulkan-root"
        for deb in "$here"/vulkan/*.deb; do dpkg -x "$deb" "$root"; done
        export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
    fi
    for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json; do
        if [ -e "$icd" ]; then
            export VK_DRIVER_FILES="$icd" VK_ICD_FILENAMES="$icd"
            break
        fi
    done
    echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}"
    # The loader's errors name the library a driver could not load.
    VK_LOADER_DEBUG=error WGPU_BACKEND=vulkan "$x" conformance --backend reference --export "$scratch/vulkan-export" || return
    # Whether this driver gives the CPU twin's bits, as Mesa's do (docs/conformance.md):
    # a finding either way, not a failure, since a GPU compiler may fuse a·b + c.
    "$x" conformance --backend cpu --export "$scratch/twin-export" >/dev/null || return
    local files differ
    files=$(find "$scratch/twin-export" -type f | wc -l)
    differ=$(diff -rq "$scratch/twin-export" "$scratch/vulkan-export" | sed "s|$scratch/||g")
    echo "bits: $(grep -c . <<<"$differ") of $files exported files (every case's inputs, outputs and index.json) differ from the CPU twin's"
    head -n 8 <<<"$differ" | sed '/^$/d; s/^/bits: /'
    return 0
}
export -f reference_on_vulkan
step reference-vulkan 120 bash -c reference_on_vulkan
# One process per device, all on this GPU (rank workers sharing a symmetric heap through
# CUDA VMM handles), as a torchrun job on one GPU. The ranks' contexts time-slice the GPU
# (no MPS), so it checks results, not speed; late, so that a slow run starves nothing the
# earlier steps measure.
step conformance-processes 220 "$x" conformance --backend cuda --sync kernels --processes --case-timeout 30
# Last, so that it can starve nothing: the persistent fused GEMM (its CTAs spin on flags
# and on each other, its scheduler words live in shared memory) on its three
# two-device cases under every tool.
step sanitizer-fused 90 bash -c 'sanitize memcheck fused_d2_ --no-hopper && sanitize racecheck fused_d2_ --no-hopper \
    && sanitize synccheck fused_d2_ --no-hopper'

finish
exit "$failed"
