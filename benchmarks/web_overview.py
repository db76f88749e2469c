"""How fast `dispatcher web` answers its overview (and /api/status, /jobs) over a big root.

Builds a root of N finished jobs straight into folders and the SQLite ledger
(tests/web_helpers.big_root), starts the real `dispatcher web` as a process,
and times GET / (the overview) a few times, each past the view's one-second
cache, so every answer is computed afresh. Run from the repository root:

    .venv/bin/python benchmarks/web_overview.py --jobs 10000 100000

It prints one line per size and, last, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from web_helpers import big_root  # noqa: E402 - after the tests folder is on the path


def timed_get(url: str) -> float:
    """Return the seconds one GET of url took (status 200 asserted)."""
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310 - a loopback URL this script made
        r.read()
        assert r.status == 200
    return time.perf_counter() - start


def measure(n: int, samples: int, tmp: Path) -> dict[str, float]:
    """Build a root of n jobs under tmp, serve it and return the median times in milliseconds."""
    work = Path(tempfile.mkdtemp(prefix=f"web-{n}-", dir=tmp))
    try:
        start = time.perf_counter()
        big_root(work / "dispatch", n)
        built = time.perf_counter() - start
        cfg = work / "dispatcher.yaml"
        cfg.write_text(json.dumps({"root": str(work / "dispatch"), "agents": {}}))
        out = (work / "web.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(cfg), "web", "--listen", "127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
        try:
            url = ""
            deadline = time.monotonic() + 30
            while not url and time.monotonic() < deadline:
                for line in (work / "web.log").read_text().splitlines():
                    if line.startswith("dispatcher web: "):
                        url = line.rsplit(" on ", 1)[1].rstrip("/")
                time.sleep(0.05)
            figures: dict[str, list[float]] = {"overview": [], "api_status": [], "jobs_page": []}
            for _ in range(samples):
                for name, path in (("overview", "/"), ("api_status", "/api/status"), ("jobs_page", "/jobs")):
                    time.sleep(1.1)  # past the one-second cache
                    figures[name].append(timed_get(url + path))
        finally:
            proc.terminate()
            proc.wait(30)
            out.close()
        result = {k: round(statistics.median(v) * 1000, 1) for k, v in figures.items()}
        result |= {"jobs": n, "build_s": round(built, 1)}
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    results = []
    for n in args.jobs:
        r = measure(n, args.samples, args.tmp)
        results.append(r)
        print(
            f"{n:>7} jobs: overview {r['overview']} ms, /api/status {r['api_status']} ms, "
            f"/jobs (first page of {n}) {r['jobs_page']} ms "
            f"(medians of {args.samples}; root built in {r['build_s']} s)",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
