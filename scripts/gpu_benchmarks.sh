#!/usr/bin/env bash
# The benchmarks of benchmarks/RESULTS.md on a GPU host (after scripts/gpu_install.sh), on random-
# weight targets at published shapes (nothing to download). Each named benchmark writes
# OUT_DIR/<name>.log (what it printed: tables, the machine, the exact overrides) and prints its
# tables; with no name, all that fit one GPU run one after another.
#   bash scripts/gpu_benchmarks.sh OUT_DIR [step|target|experts|decode|decode_hybrid|pipeline|train|layouts|fp8 ...]
# step           the paper-shape drafter step (Qwen3-8B shape, 5-layer b16 drafter, 512 anchors,
#                3072 tokens): reference vs fast paths, phases, memory (scripts/bench_step.py)
# target         a MoE hybrid target's feature forward (Qwen3-Next-80B-A3B shape, 12 of 48 layers):
#                samples per forward, eager vs regional compile, time per layer part (bench_target.py)
# experts        the fused MoE experts kernels' launch shapes at both MoE presets' expert shapes,
#                bf16 and FP8 weights (scripts/bench_experts.py)
# decode         a DFlash round against a plain step at 8B, static caches + CUDA graphs (bench_decode.py)
# decode_hybrid  the same on a hybrid target (Qwen3.5-9B shape), compiled per layer kind
# pipeline       pipeline=sync vs async on a small target (scripts/bench_pipeline.py)
# train          dflash-train at the paper shape on one GPU: the reference paths vs the fast ones
#                vs experiment=qwen3_8b, compared by scripts/compare_runs.py (runs in OUT_DIR/runs)
# layouts        every gpu= layout on 2 or more GPUs (a Qwen3-4B shape, scripts/bench_pipeline.py)
# fp8            Qwen3-Next-80B-A3B in FP8, all 48 layers (target=qwen3_next_80b_fp8_random): its
#                feature forward (bench_target.py), then dflash-train 50 steps with both roles
#                on one GPU (samples/s and peak memory in the summary)
set -uo pipefail
OUT_DIR=$(realpath -m "$1"); shift
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
CACHE="paths.cache_dir=$OUT_DIR/cache"
tables() { grep "^|\|^NVIDIA\|^H[0-9]\|Error\|error:" "$1" || true; }
SMALL_TARGET=(gpu=single drafter=b16 drafter.mask_token_id=31999 drafter.num_anchors=64
  target.arch.vocab_size=32000 target.arch.hidden_size=1024 target.arch.intermediate_size=3072
  target.arch.num_hidden_layers=16 target.arch.num_attention_heads=16 target.arch.num_key_value_heads=8
  target.arch.head_dim=64 data.num_samples=512 data.gen_len_max=300 data.max_length=384
  'data.bucket_edges=[128,256,384]' data.tokens_per_batch=8192 "$CACHE")
for name in ${@:-step target decode decode_hybrid pipeline train}; do
  log="$OUT_DIR/$name.log"
  case "$name" in
  step)
    $PY scripts/bench_step.py --profile "$OUT_DIR/profile_step" > "$log" 2>&1; tables "$log" ;;
  target)
    $PY scripts/bench_target.py --samples 1,4,16 --experts grouped_mm --compile eager,layers > "$log" 2>&1
    tables "$log" ;;
  experts)
    for shape in qwen3_next qwen3_5_35b; do
      $PY scripts/bench_experts.py --shape $shape >> "$log" 2>&1
      $PY scripts/bench_experts.py --shape $shape --fp8 >> "$log" 2>&1
    done
    grep -A1 "^qwen\|^default:" "$log" ;;
  decode)
    $PY scripts/bench_decode.py --reps 30 --context 1024 --skip-dynamic --compile target=qwen3_8b_random \
      drafter=b16 drafter.mask_token_id=151669 gpu=single "$CACHE" > "$log" 2>&1
    grep -v "INFO\|Loading weights\|Warning" "$log" | tail -14 ;;
  decode_hybrid)
    $PY scripts/bench_decode.py --reps 20 --compile target=qwen3_5_9b_random drafter=b16 \
      drafter.mask_token_id=248070 gpu=single "$CACHE" > "$log" 2>&1
    grep -v "INFO\|Loading weights\|Warning" "$log" | tail -14 ;;
  pipeline)
    for compare in pipeline monitor; do
      $PY scripts/bench_pipeline.py --compare $compare --steps 150 --warmup-steps 20 "${SMALL_TARGET[@]}" \
        > "$OUT_DIR/$name-$compare.log" 2>&1
      tables "$OUT_DIR/$name-$compare.log"
    done ;;
  train)
    PAPER=(experiment=qwen3_8b target=qwen3_8b_random data=random_3072 gpu=single pipeline=async logger=jsonl
      monitor.cuda_stats=true monitor.interval_s=5 checkpoint.every_steps=100000 "$CACHE")
    ONE=(data.block_tokens_per_batch=8192 train.total_steps=200 logger.every_steps=1)
    $PY -m dflash.train "${PAPER[@]}" "${ONE[@]}" debug.max_steps=50 drafter.attention=sdpa target.compile=false \
      drafter.compile=false loss.logits_chunk=0 paths.output_dir="$OUT_DIR/runs/reference" > "$OUT_DIR/train_reference.log" 2>&1
    $PY -m dflash.train "${PAPER[@]}" "${ONE[@]}" target.compile=true target.compile_dynamic=null \
      drafter.compile_dynamic=null paths.output_dir="$OUT_DIR/runs/fast" > "$OUT_DIR/train_fast.log" 2>&1
    $PY -m dflash.train "${PAPER[@]}" train.total_steps=40 target.compile=true target.compile_dynamic=null \
      drafter.compile_dynamic=null paths.output_dir="$OUT_DIR/runs/preset" > "$OUT_DIR/train_preset.log" 2>&1
    $PY scripts/compare_runs.py "$OUT_DIR/runs/reference" "$OUT_DIR/runs/fast" "$OUT_DIR/runs/preset" | tee "$log" ;;
  layouts)
    QWEN3_4B=(target.arch.vocab_size=151936 target.arch.hidden_size=2560 target.arch.intermediate_size=9728
      target.arch.num_hidden_layers=36 target.arch.num_attention_heads=32 target.arch.num_key_value_heads=8
      target.arch.head_dim=128 target.arch.max_position_embeddings=4096 target.arch.tie_word_embeddings=true
      drafter=b16 drafter.mask_token_id=151669 drafter.num_anchors=128 data.num_samples=256
      data.prompt_len_min=1024 data.prompt_len_max=1760 data.gen_len_min=256 data.gen_len_max=288
      data.max_length=2048 'data.bucket_edges=[2048]' data.tokens_per_batch=8192 logger=jsonl "$CACHE")
    $PY scripts/bench_pipeline.py --compare layout --steps 30 --warmup-steps 4 "${QWEN3_4B[@]}" > "$log" 2>&1
    tables "$log" ;;
  fp8)
    NEXT_FP8=(target=qwen3_next_80b_fp8_random target.experts=grouped_mm drafter=b16 drafter.mask_token_id=151669)
    $PY scripts/bench_target.py --samples 4 --compile eager,layers --experts grouped_mm "${NEXT_FP8[@]}" \
      > "$OUT_DIR/fp8_target.log" 2>&1
    tables "$OUT_DIR/fp8_target.log"
    $PY -m dflash.train "${NEXT_FP8[@]}" data=random_3072 gpu=single pipeline=sync logger=jsonl train.total_steps=50 \
      logger.every_steps=10 target.compile=true target.compile_scope=layers monitor.cuda_stats=true \
      checkpoint.every_steps=100000 "$CACHE" paths.output_dir="$OUT_DIR/runs/fp8" > "$log" 2>&1
    grep -v "INFO\|Loading weights\|Warning" "$log" | tail -16 ;;
  *)
    echo "gpu_benchmarks: no benchmark named '$name' (step target decode decode_hybrid pipeline train layouts fp8)" >&2
    exit 2 ;;
  esac
done
