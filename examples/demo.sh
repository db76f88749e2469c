#!/usr/bin/env bash
# The Kopi & Crumb demo: three agents hand work to each other through dispatcher, with a
# person's review between the second and the third.
#
#   bash examples/demo.sh
#
# No network, no API key: the agents are the deterministic scripts in examples/agents/.
# What it does, in a fresh temporary dispatch root (your checkout's dispatch/ stays clean):
#   1. intake reads five customer messages (examples/kopi/JOB-001.yaml) and hands them to
#      the assigner as a follow-up order; assigner writes assignments.csv and a receipt;
#      every check passes; the assigner's job waits in review/ until `dispatcher approve`,
#      which releases the next hop: the notifier tells each team its requests.
#   2. the same job id again is refused before any agent runs (by `submit`, and by the
#      daemon when the file is dropped straight into inbox/).
#   3. JOB-002's intake agent claims "done" but writes no handoff: the followups_valid
#      check fails the job and nothing reaches the assigner.
#   4. the assigner run by hand in an empty folder says STOP and writes nothing.
#
# Setup: uses .venv at the checkout's root, creating it with python3.11 (or python3 when
# that is 3.11 or newer) and `pip install -e .` when dispatcher cannot be imported there.
# DEMO_DIR=/some/new/folder keeps the demo's files there instead of a new folder under
# $TMPDIR; the folder is left in place for you to look around.
# Exit status: 0 when everything behaved as described above, 1 otherwise.

set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
CONFIG="$REPO/config/dispatcher.yaml"
cd "$REPO" || exit 1

if [ -t 1 ]; then BOLD=$'\033[1m'; RED=$'\033[31m'; GREEN=$'\033[32m'; OFF=$'\033[0m'
else BOLD=""; RED=""; GREEN=""; OFF=""; fi
heading() { printf '\n%s== %s%s\n' "$BOLD" "$*" "$OFF"; }
shows() { printf '%s$ %s%s\n' "$BOLD" "$*" "$OFF"; }
die() { printf 'demo.sh: %s\n' "$*" >&2; exit 1; }

problems=0
expect() {  # expect WHAT COMMAND...: run a check, say ok or UNEXPECTED
    if "${@:2}"; then
        printf '   %sok%s  %s\n' "$GREEN" "$OFF" "$1"
    else
        printf '   %sUNEXPECTED%s  %s\n' "$RED" "$OFF" "$1"
        problems=$((problems + 1))
    fi
}

# -- Python and the virtualenv ------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    BASE=""
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            BASE="$candidate"
            break
        fi
    done
    [ -n "$BASE" ] || die "needs Python 3.11 or newer as python3.11 or python3"
    heading "Creating .venv with $BASE"
    "$BASE" -m venv "$VENV" || die "cannot create $VENV"
fi
PY="$VENV/bin/python"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's dispatcher, always
if ! "$PY" -c 'import dispatcher.cli, watchdog, filelock, structlog, yaml' 2>/dev/null; then
    heading "Installing dispatcher into .venv (pip install -e .)"
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$REPO" ||
        die "pip install -e . failed (it needs the network the first time)"
fi
# byte-compiled once, as a wheel install is: with PYTHONDONTWRITEBYTECODE set, each command
# would otherwise compile the package again at its start
"$PY" -m compileall -q "$REPO/dispatcher" >/dev/null 2>&1 || true
# The agents' `python3` is the venv's, so they run on the same Python 3.11+.
export PATH="$VENV/bin:$PATH"
unset DISPATCHER_CONFIG NOTIFY_SOCKET WATCHDOG_USEC WATCHDOG_PID

# -- A fresh dispatch root -------------------------------------------------------------
if [ -n "${DEMO_DIR:-}" ]; then
    mkdir -p "$DEMO_DIR" || die "cannot create $DEMO_DIR"
    [ -z "$(ls -A "$DEMO_DIR")" ] || die "DEMO_DIR=$DEMO_DIR is not empty"
    WORK="$(cd "$DEMO_DIR" && pwd)"
else
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/kopi-demo.XXXXXX")" || die "mktemp failed"
fi
ROOT="$WORK/dispatch"

# Every call uses this checkout's config/dispatcher.yaml with the temporary root.
dispatcher() { "$PY" -m dispatcher --config "$CONFIG" --root "$ROOT" "$@"; }
json_get() {  # json_get FILE KEY: print one top-level value of a JSON file
    "$PY" -c 'import json, sys; v = json.load(open(sys.argv[1])).get(sys.argv[2]); print(v if isinstance(v, str) else json.dumps(v))' "$1" "$2" 2>/dev/null
}
state_is() { [ "$(json_get "$ROOT/$2/$1/result.json" state)" = "$2" ]; }
nowhere() { ! compgen -G "$ROOT/*/$1" >/dev/null; }
unknown_job() { dispatcher show "$1" >/dev/null 2>&1; [ $? -eq 1 ]; }
run_once() {  # run_once N: the daemon until the inbox is drained, one short line per event
    shows "dispatcher run --once"
    dispatcher run --once 2>&1 | tee "$WORK/run-$1.log" | dispatcher logs -
    return "${PIPESTATUS[0]}"
}

printf '%sKopi & Crumb: three agents, two handoffs, every result checked%s\n' "$BOLD" "$OFF"
printf 'config %s\nroot   %s\n' "${CONFIG#"$REPO"/}" "$ROOT"

heading "1. Make the dispatch root"
shows "dispatcher init"
dispatcher init
expect "inbox/ active/ done/ failed/ exist" test -d "$ROOT/inbox" -a -d "$ROOT/active" -a -d "$ROOT/done" -a -d "$ROOT/failed"

heading "2. Hand the five customer messages to intake"
shows "dispatcher submit examples/kopi/JOB-001.yaml"
dispatcher submit examples/kopi/JOB-001.yaml
expect "JOB-001 is queued in inbox/" test -f "$ROOT/inbox/JOB-001.yaml"

heading "3. Run the daemon until every job is finished"
run_once 1
rc=$?
expect "run --once exits 0 (nothing failed, nothing refused)" test "$rc" -eq 0
expect "JOB-001 (intake) is in done/" state_is JOB-001 done
expect "JOB-001.assign (assigner, released by JOB-001) waits in review/" state_is JOB-001.assign review
expect "the next hop is not released before the review" nowhere "JOB-001.assign.notify*"

heading "3b. A person reviews the assignments, then approves them"
shows "dispatcher list --state review"
dispatcher list --state review
shows "cat review/JOB-001.assign/work/assignments.csv"
cat "$ROOT/review/JOB-001.assign/work/assignments.csv"
shows "dispatcher approve JOB-001.assign"
dispatcher approve JOB-001.assign
expect "JOB-001.assign is in done/ once approved" state_is JOB-001.assign done
expect "its follow-up to the notifier is released into inbox/" test -f "$ROOT/inbox/JOB-001.assign.notify.json"
run_once 1b
rc=$?
expect "run --once exits 0" test "$rc" -eq 0
expect "JOB-001.assign.notify (notifier) is in done/" state_is JOB-001.assign.notify done
shows "cat done/JOB-001.assign.notify/work/notices.md"
cat "$ROOT/done/JOB-001.assign.notify/work/notices.md"

heading "4. What came out"
ASSIGN="$ROOT/done/JOB-001.assign"
shows "cat done/JOB-001.assign/work/assignments.csv"
cat "$ASSIGN/work/assignments.csv"
shows "cat done/JOB-001/work/receipt.json done/JOB-001.assign/work/receipt.json"
cat "$ROOT/done/JOB-001/work/receipt.json" "$ASSIGN/work/receipt.json"
shows "dispatcher show --tree JOB-001"
dispatcher show --tree JOB-001
shows "dispatcher show JOB-001.assign"
dispatcher show JOB-001.assign
rows=$("$PY" -c 'import csv, sys; print(len(list(csv.DictReader(open(sys.argv[1])))))' "$ASSIGN/work/assignments.csv" 2>/dev/null)
expect "assignments.csv has one row per request (5)" test "${rows:-0}" = 5
expect "JOB-001.assign names JOB-001 as its parent" test "$(json_get "$ASSIGN/result.json" parent)" = JOB-001

heading "5. First failure: the same job id again"
shows "dispatcher submit examples/kopi/JOB-001.yaml"
dispatcher submit examples/kopi/JOB-001.yaml 2>"$WORK/submit-again.err"
rc=$?
cat "$WORK/submit-again.err"
expect "submit refuses a known job id with exit 2, before any agent runs" test "$rc" -eq 2
expect "the error is one line" test "$(wc -l <"$WORK/submit-again.err")" -eq 1
echo "Dropping the file straight into inbox/ (write a hidden name, then rename) gets past submit:"
shows "cp examples/kopi/JOB-001.yaml inbox/.JOB-001.yaml.tmp && mv inbox/.JOB-001.yaml.tmp inbox/JOB-001.yaml"
cp examples/kopi/JOB-001.yaml "$ROOT/inbox/.JOB-001.yaml.tmp" &&
    mv "$ROOT/inbox/.JOB-001.yaml.tmp" "$ROOT/inbox/JOB-001.yaml"
run_once 2
rc=$?
expect "run --once exits 1 (a file was refused)" test "$rc" -eq 1
refusal=$(compgen -G "$ROOT/failed/JOB-001@*" | head -n 1)
if [ -n "$refusal" ]; then
    printf 'refused into failed/%s: %s\n' "${refusal##*/}" "$(json_get "$refusal/result.json" reason)"
fi
expect "the file is refused into failed/JOB-001@<timestamp>/" test -n "$refusal"
expect "the finished JOB-001 was not run again (one attempt)" test ! -e "$ROOT/done/JOB-001/attempts/2"

heading "6. Second failure: a sender that claims done but writes no handoff"
shows "dispatcher submit examples/kopi/JOB-002.yaml"
dispatcher submit examples/kopi/JOB-002.yaml
run_once 3
rc=$?
expect "run --once exits 1 (a job failed)" test "$rc" -eq 1
shows "dispatcher show JOB-002"
dispatcher show JOB-002
reason=$(json_get "$ROOT/failed/JOB-002/result.json" reason)
expect "JOB-002 is in failed/" state_is JOB-002 failed
expect "its reason starts with followups_valid" test "${reason#followups_valid}" != "$reason"
expect "JOB-002 has no children" test "$(json_get "$ROOT/failed/JOB-002/result.json" children)" = "[]"
expect "nothing reached the assigner (no JOB-002.assign anywhere)" nowhere "JOB-002.assign*"
expect "the ledger does not know JOB-002.assign (show exits 1)" unknown_job JOB-002.assign

heading "7. The assigner on its own, in an empty folder"
mkdir -p "$WORK/empty"
shows "python3 examples/agents/assigner.py    # run in an empty folder"
(cd "$WORK/empty" && python3 "$REPO/examples/agents/assigner.py")
rc=$?
expect "it stops (exit 1) and writes nothing" test "$rc" -eq 1 -a -z "$(ls -A "$WORK/empty")"

heading "Summary"
shows "dispatcher status"
dispatcher status
echo
echo "Everything is in $WORK (the daemon's JSON log lines in run-*.log)."
echo "Look around with: ls -R $ROOT    Remove it with: rm -rf $WORK"
if [ "$problems" -eq 0 ]; then
    printf '%sThe demo behaved as expected.%s\n' "$GREEN" "$OFF"
    exit 0
fi
printf '%s%d result(s) were not as expected: see UNEXPECTED above.%s\n' "$RED" "$problems" "$OFF"
exit 1
