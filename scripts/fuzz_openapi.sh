#!/usr/bin/env bash
# Fuzz the /v1 routes of `kestrel serve` from the server's own OpenAPI document with schemathesis: EXAMPLES test
# cases per route (positive and negative data), and any 5xx answer fails the run.
#
# Not part of CI: schemathesis brings ~40 packages of its own (it lives in a venv of its own here, ST_VENV, so it
# cannot move the test venv's pins) and a run of 200 examples per route takes minutes on 2 CPU cores. The CI part
# is tests/test_first_contact_http.py (hand-made out-of-range values and a small hypothesis fuzz over real HTTP).
#
#   scripts/fuzz_openapi.sh                 # the default model, 200 examples per route
#   EXAMPLES=500 scripts/fuzz_openapi.sh
#
# --max-model-len 64 keeps a fuzzed max_tokens (and n) from turning one case into minutes of CPU decoding; every
# validation rule still applies (the limits are the engine's, reported once it is ready).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# one intra-op thread: two threads of a tiny model beside the fuzzer on 2 cores run several times slower
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ST_VENV=${ST_VENV:-.fuzz-venv}
EXAMPLES=${EXAMPLES:-200}
PORT=${PORT:-8799}
SCHEMATHESIS=${SCHEMATHESIS:-schemathesis==4.32.5}

if [ ! -x "$ST_VENV/bin/st" ]; then
    python3 -m venv "$ST_VENV" && "$ST_VENV/bin/pip" install -q "$SCHEMATHESIS"
fi

LOG=${SERVER_LOG:-$(mktemp)}   # the server's log, with a line per request (SERVER_LOG=FILE keeps it)
"$PYTHON" -m kestrel.cli serve --device cpu --port "$PORT" --max-model-len 64 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; [ -n "${SERVER_LOG:-}" ] || rm -f "$LOG"' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 1
done

"$ST_VENV/bin/st" run "http://127.0.0.1:$PORT/openapi.json" --checks not_a_server_error \
    --include-path-regex '^/v1/' --max-examples "$EXAMPLES" --workers 1 --request-timeout 120 --seed "${SEED:-0}" \
    --no-color
