#!/usr/bin/env bash
# Fan-out and join with three agents: a planner hands out three research jobs and a merger
# that waits for all of them (`after`, contract section 16); the merger reads its parents
# through work/parents.json and writes one summary.
#
#   bash examples/fanout/run.sh
#
# It runs in a fresh temporary root (FANOUT_DIR=/some/new/folder to keep it elsewhere) with
# `dispatcher run --once`, then shows the tree and the summary. Exit 0 when the merger ran
# once, after its three parents, and its summary holds the three topics.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DIR="${FANOUT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fanout.XXXXXX")}"
mkdir -p "$DIR"
AGENTS="$HERE/agents.py"
cat > "$DIR/dispatcher.yaml" <<YAML
root: $DIR/dispatch
max_jobs: 3
settle: 0.2
agents:
  planner:
    command: [$PY, $AGENTS, plan]
    writes: []
  researcher:
    command: [$PY, $AGENTS, research]
    writes: [notes.json]
    concurrency: 3
  merger:
    command: [$PY, $AGENTS, merge, "{parents}"]
    writes: [summary.json]
YAML
mkdir -p "$DIR/dispatch"
dispatcher() { PYTHONPATH="$REPO" "$PY" -m dispatcher --config "$DIR/dispatcher.yaml" "$@"; }
echo "\$ dispatcher submit examples/fanout/PLAN-001.yaml"
dispatcher init >/dev/null
dispatcher submit "$HERE/PLAN-001.yaml"
echo "\$ dispatcher run --once"
dispatcher run --once >"$DIR/daemon.log" 2>&1
echo "\$ dispatcher show --tree PLAN-001.merge"
dispatcher show --tree PLAN-001.merge
echo "\$ cat done/PLAN-001.merge/work/summary.json"
cat "$DIR/dispatch/done/PLAN-001.merge/work/summary.json"
echo
"$PY" - "$DIR/dispatch" <<'CHECK'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
summary = json.loads((root / "done/PLAN-001.merge/work/summary.json").read_text())
assert sorted(s["id"] for s in summary) == ["loyalty-card", "oat-milk", "opening-hours"], summary
parents = json.loads((root / "done/PLAN-001.merge/work/parents.json").read_text())
assert [p["state"] for p in parents] == ["done"] * 3, parents
assert len(list((root / "done/PLAN-001.merge/attempts").iterdir())) == 1
print(f"ok: the merger ran once, after its 3 parents ({root})")
CHECK
