#!/bin/sh
# Benchmark agent that waits: sleeps SECONDS, then does what agent.sh does.
#
#   sh sleep_agent.sh SECONDS                      job id and work folder from the
#                                                  daemon's $DISPATCH_JOB_ID and
#                                                  $DISPATCH_WORKSPACE
#   sh sleep_agent.sh SECONDS JOB_ID WORKSPACE     the same from arguments (xargs baseline)
#
# bench.py runs 2,000 of these at once to see what many waiting agents cost the daemon
# (threads, memory) when the agents themselves cost almost nothing.
set -eu
seconds=$1
job_id=${2:-$DISPATCH_JOB_ID}
workspace=${3:-$DISPATCH_WORKSPACE}
sleep "$seconds"
printf 'id\nR1\n' >"$workspace/out.csv"
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": ["R1"], "status": "done", "outputs": ["out.csv"]}\n' \
    "$job_id" >"$workspace/receipt.json"
