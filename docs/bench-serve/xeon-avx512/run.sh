set -e
S=/work/main/.venv/bin/specchat; P=/work/main/.venv/bin/python; D=/tmp/bs
run() {  # name, serve args, predict flag
  $S serve --port 8791 $2 > $D/$1.log 2>&1 &
  pid=$!
  for i in $(seq 1 80); do sleep 0.5; curl -s localhost:8791/health >/dev/null 2>&1 && break; done
  $P /work/main/docs/bench-serve/predicted.py 8791 /work/main/docs/prompts/edit10.jsonl $D/$1.jsonl $3 | tail -1
  curl -s localhost:8791/metrics | grep -E "^specchat:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" > $D/$1.metrics || true
  kill -TERM $pid; wait $pid || true
}
run vanilla "--method vanilla" ""
run default "" ""
run default-predicted "" "--predict"
run vanilla-again "--method vanilla" ""
