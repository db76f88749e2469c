"""The web view over a root of 10,000 jobs: the list pages page through them, the overview answers fast."""

from __future__ import annotations

import re
import time

from conftest import Env
from web_helpers import big_root, start_web

N = 10_000
OVERVIEW_LIMIT_S = 0.2


def test_a_root_of_10000_jobs_pages_and_answers_its_overview_under_200_ms(env: Env) -> None:
    """/jobs pages through 10,000 jobs 200 at a time, /api/jobs lists them all, and / answers in under 200 ms."""
    big_root(env.root, N)
    web = start_web(env)
    try:
        assert web.json("/api/status")["counts"] | {} == {
            "inbox": 0, "held": 0, "active": 0, "waiting": 0, "review": 20, "done": 8982, "failed": 998, "refused": 0,
        }  # fmt: skip
        assert len(web.json("/api/jobs")) == N
        assert len(web.json("/api/jobs?state=failed&agent=agent-0")) == 998
        status, page, _ = web.get("/jobs")
        assert status == 200 and b"page 1 of 50" in page and page.count(b'<tr class="state-') == 200
        status, page, _ = web.get("/jobs?page=50")
        assert status == 200 and b"BULK-000000" in page and b"page 50 of 50" in page
        status, page, _ = web.get("/jobs?state=review")
        assert status == 200 and page.count(b'<tr class="state-review">') == 20
        times = []
        for _ in range(5):
            time.sleep(1.1)  # past the overview's one-second cache: each answer is computed afresh
            start = time.perf_counter()
            status, page, _ = web.get("/")
            times.append(time.perf_counter() - start)
            assert status == 200 and re.search(rb'id="count-done"><span class="n">8982<', page)
        print(f"overview at {N} jobs: {[round(t * 1000, 1) for t in times]} ms")
        # the best of five: what the view can do; the other tests of a full run share the two CPUs meanwhile
        assert min(times) < OVERVIEW_LIMIT_S, times
    finally:
        web.stop()
