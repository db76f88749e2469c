#!/bin/sh
# Trivial benchmark agent: one item (R1) in, one row out, and a receipt.
#
#   sh agent.sh                     job id and work folder from $DISPATCH_JOB_ID and
#                                   $DISPATCH_WORKSPACE, as the daemon sets them
#   sh agent.sh JOB_ID WORKSPACE    the same from arguments, so that a baseline such as
#                                   `xargs -n 2 sh agent.sh` spawns nothing but the agent
#
# It needs no JSON parser. With $STAMP_DIR set (through the agent's `env:` in the config)
# it first writes its own start time, `date +%s.%N`, to $STAMP_DIR/<job id>: bench.py reads
# it to time pickup. Everything else is shell builtins, so a run costs one fork+exec of sh
# (plus `date` when stamping).
set -eu
job_id=${1:-$DISPATCH_JOB_ID}
workspace=${2:-$DISPATCH_WORKSPACE}
if [ -n "${STAMP_DIR:-}" ]; then
    date +%s.%N >"$STAMP_DIR/$job_id"
fi
printf 'id\nR1\n' >"$workspace/out.csv"
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": ["R1"], "status": "done", "outputs": ["out.csv"]}\n' \
    "$job_id" >"$workspace/receipt.json"
