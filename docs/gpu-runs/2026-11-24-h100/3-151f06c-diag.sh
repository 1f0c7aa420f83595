#!/usr/bin/env bash
# Why does a gated run stop? Two small gated runs (own cuBLAS workspace; cuBLAS's default)
# and a backtrace of the host while the second is stuck. Copied into target/gpu-bundle/ and
# run there on the device machine (output: 3-151f06c-diag.log).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CUDA_MODULE_LOADING=EAGER CMM_REQUIRE_GPU=1 CMM_CASES_DIR="$here/cases" CMM_GOLDEN_DIR="$here/golden" CMM_STAMP_DIR=/tmp/diag-stamps
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib
echo "== own workspace"
timeout 40 "$here/bin/xtask" conformance --backend cuda --filter ag_gemm_baseline_d2_ --case-timeout 10; echo "rc=$?"
echo "== cuBLAS default workspace, backtrace after 12 s"
CMM_CUBLAS_WORKSPACE=0 "$here/bin/xtask" conformance --backend cuda --filter ag_gemm_baseline_d2_ --case-timeout 10 > /tmp/second.log 2>&1 &
pid=$!
sleep 12
timeout 60 cuda-gdb -p $pid -batch -ex "thread apply all bt 25" 2>&1 | grep -v "^\[New\|^warning" | head -120
kill -9 $pid; head -5 /tmp/second.log
