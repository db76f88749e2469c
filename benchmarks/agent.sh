#!/bin/sh
# Trivial benchmark agent: one item (R1) in, one row out, and a receipt.
#
# Reads only $DISPATCH_JOB_ID and $DISPATCH_WORKSPACE, so it needs no JSON parser.
# With $STAMP_DIR set (through the agent's `env:` in the config) it first writes its own
# start time, `date +%s.%N`, to $STAMP_DIR/$DISPATCH_JOB_ID: bench.py reads it to time pickup.
# Everything else is shell builtins, so a run costs one fork+exec of sh (plus `date` when stamping).
set -eu
if [ -n "${STAMP_DIR:-}" ]; then
    date +%s.%N >"$STAMP_DIR/$DISPATCH_JOB_ID"
fi
printf 'id\nR1\n' >"$DISPATCH_WORKSPACE/out.csv"
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": ["R1"], "status": "done", "outputs": ["out.csv"]}\n' \
    "$DISPATCH_JOB_ID" >"$DISPATCH_WORKSPACE/receipt.json"
