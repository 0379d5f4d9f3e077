#!/usr/bin/env bash
# The GPU tests on a CUDA host (CI has no GPU): the `-m gpu` tests, engine-level files first, then the engine
# API tests with NBGEN_TEST_DEVICE=cuda (the CPU suite's engines on the GPU), then the multi-GPU files where
# the host has several GPUs. Each group's full log goes to LOGDIR (default /tmp/nbgen-gpu-tests); the failures
# are printed at the end.   Usage: bash tests/run_gpu.sh [LOGDIR [GROUP...]], GROUP one of engine, engine2,
# kernels, on_device, multi_gpu (default: all of them; each group is sized to fit one 10-minute device call).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-/tmp/nbgen-gpu-tests}
shift || true
GROUPS_WANTED=${*:-engine engine2 kernels on_device multi_gpu}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
# the engine-level files in two groups (together about 10 minutes on one H200)
ENGINE="test_gpu test_hidden_states test_mixed_decode test_mixed_chunks test_prefill_overlap_gpu test_spec_gpu"
ENGINE2="test_verify_graphs test_lora_prefill_graphs test_gpu_cascade test_sampler_masks test_masked_heads
  test_embeddings_gpu test_weights_gpu test_cpu_offload test_fp8 test_fp8_kv test_extend_routing test_vlm_gpu
  test_vlm_llava_gpu test_spec_draft_graphs test_spec_eagle_batch test_lora test_prefill_standin test_gpu_ops_switch"
KERNELS="test_triton_decode test_triton_extend test_triton_norm test_triton_precompile test_cascade_kernel
  test_ew_kernels test_fp8_early_tiles test_fp8_fused test_fp8_qkv_rope test_fp8_scaled test_fp8_small_gemm
  test_small_gemm test_norm_fold test_lora_kernels test_lora_sgmv_configs test_side_copy test_vision_ops"
ON_DEVICE="test_hidden_states test_sessions test_engine_api test_grammar test_jump_forward test_parity"
files() { for f in $*; do echo "tests/$f.py"; done; }
run() {  # name, then pytest arguments
  local name=$1; shift
  case " $GROUPS_WANTED " in *" $name "*) ;; *) return 0 ;; esac
  $PY -m pytest -v -p no:cacheprovider --timeout=600 -rf "$@" > "$LOG/$name.txt" 2>&1
  echo "$name: $(tail -1 "$LOG/$name.txt")"
}
run engine -m gpu $(files $ENGINE)
run engine2 -m gpu $(files $ENGINE2)
run kernels -m gpu $(files $KERNELS)
NBGEN_TEST_DEVICE=cuda run on_device $(files $ON_DEVICE)
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run multi_gpu -m gpu tests/test_tp.py tests/test_peer_all_reduce.py
fi
grep -h "^FAILED\|^ERROR" "$LOG"/*.txt || echo "no failures"
