#!/usr/bin/env bash
# The record of what ran in the 2026-11-26 second H200 block (docs/bench-gpu/README.md), kept as it ran;
# `python -m specchat.train.agenda device --detach / --wait` does this now (docs/gpu-agenda.md).
# The second 15-minute block (2026-11-26): the check runs in its own process session while the
# model's pieces arrive, then the answers, then training beside the CUDA tests, all chained on the
# machine so that no gap between calls leaves the GPU idle. Calls:
#   1: agenda device .gpu/pieces/00 && bash gpu-block.sh start
#   2-8: agenda device .gpu/pieces/0N && bash gpu-block.sh peek
#   9: agenda device .gpu/pieces/08 && bash gpu-block.sh ready DEADLINE_EPOCH && bash gpu-block.sh wait answer 560
#   10: bash gpu-block.sh wait train 580
set -u
A=/tmp/agenda; B=$A/bg; SRC=$A/src
mkdir -p "$B"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
start)
  rm -rf "$SRC"; mkdir -p "$SRC"
  tar --exclude=./.gpu -cf - . | tar -C "$SRC" -xf -
  setsid nohup bash "$SRC/gpu-block.sh" chain > "$B/chain.log" 2>&1 < /dev/null &
  sleep 2; cat "$B/chain.log"
  ;;
chain)
  cd "$SRC"; export PYTHONPATH=$A/site:$SRC XDG_CACHE_HOME=$A/cache
  nvidia-smi -L; date +%s > "$B/chain.start"
  R=(python3 -m specchat runtime-check --shape qwen2.5-0.5b --runtime fixed --tokens 128 --head --nodes 7 63 --repeats 1)
  mkdir -p "$B/check"
  s=$(date +%s); timeout 90 "${R[@]}" --trace $A/trace/eager -o "$B/check/runtime-0.5b.json" > "$B/check/runtime-0.5b.log" 2>&1
  echo "eager rc=$? $(( $(date +%s) - s ))s" | tee -a "$B/status"
  s=$(date +%s); timeout 150 "${R[@]}" --compile --trace $A/trace/compiled -o "$B/check/runtime-0.5b-compiled.json" > "$B/check/runtime-0.5b-compiled.log" 2>&1
  echo "compiled rc=$? $(( $(date +%s) - s ))s" | tee -a "$B/status"
  (cd $A && tar czf "$B/check/trace.tgz" trace 2>/dev/null)
  touch "$B/check.done"
  while [ ! -e "$B/model.ready" ]; do sleep 1; done
  s=$(date +%s); OUT=$B/answer python3 -m specchat.train.agenda device --answer-minutes 2.5 --back > "$B/answer.log" 2>&1
  echo "answer rc=$? $(( $(date +%s) - s ))s" | tee -a "$B/status"
  touch "$B/answer.done"
  # The CUDA tests beside training: they check correctness, not speed.
  ( s=$(date +%s); timeout 170 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_layouts.py tests/test_compile.py \
      tests/test_data.py::test_captured_steps_answer_as_eager_ones tests/test_train.py::test_training_on_cuda > "$B/test-cuda.log" 2>&1
    echo "tests rc=$? $(( $(date +%s) - s ))s" | tee -a "$B/status" ) &
  # Training takes what the block has left: the deadline less model loading, the last evaluation and the way back.
  minutes=$(python3 -c "import time; print(max(1.0, min(4.5, ($(cat $B/deadline) - time.time() - 90) / 60)))")
  echo "train minutes=$minutes" | tee -a "$B/status"
  s=$(date +%s); OUT=$B/train python3 -m specchat.train.agenda device --train-minutes "$minutes" --back > "$B/train.log" 2>&1
  echo "train rc=$? $(( $(date +%s) - s ))s" | tee -a "$B/status"
  wait; touch "$B/train.done"
  ;;
peek)
  cat "$B/status" 2>/dev/null; tail -n 3 "$B/chain.log" "$B"/check/*.log 2>/dev/null | cut -c1-200
  ;;
ready)
  echo "$2" > "$B/deadline"; touch "$B/model.ready"; echo "deadline in $(( $2 - $(date +%s) ))s"
  ;;
wait)  # wait STAGE LIMIT: until the stage is done (or LIMIT seconds), then its results into $OUT
  end=$(( $(date +%s) + $3 ))
  while [ ! -e "$B/$2.done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 2; done
  cat "$B/status"
  if [ "$2" = answer ]; then
    tar -C "$B" -czf "$OUT/check.tgz" check status chain.log
    tar -C "$B/answer" -czf "$OUT/answer-logs.tgz" --exclude='answers.tgz.*' . ; cp "$B/answer.log" "$OUT/"
    cp "$B"/answer/answers.tgz.* "$OUT/" 2>/dev/null
    tail -n 25 "$B/answer.log"
  else
    tar -C "$B" -czf "$OUT/train-logs.tgz" --exclude='head.tgz.*' --exclude='answers.tgz.*' train status test-cuda.log train.log chain.log
    cp "$B"/train/head.tgz.* "$B"/train/answers.tgz.* "$OUT/" 2>/dev/null
    tail -n 30 "$B/train.log"; tail -n 15 "$B/test-cuda.log"
  fi
  ls -la "$OUT"
  ;;
esac
