"""The checks of contract section 5: one pure function per check, run in order.

Each check takes the Evidence gathered after an attempt (see ``evidence.py``)
and returns a CheckResult. ``ok`` is True or False, or None when the check's
input is missing or the check does not apply; the detail always says why, in
one printable line of at most ``DETAIL_MAX`` characters (longer ones are cut
with a note). The output file is seen through its OutputSummary, never as a
list of records. Nothing here touches the filesystem or the clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

from dispatcher.checks.facts import Evidence
from dispatcher.checks.summary import OTHERS_MAX, OutputSummary, id_key, id_shown, listed, shown, stored_key
from dispatcher.errors import cut, printable
from dispatcher.spec.result import CheckResult
from dispatcher.text import exit_text, number, plain, plural

DETAIL_MAX = 1000


def _made(name: str, ok: bool | None, detail: str) -> CheckResult:
    """Return a result of check ``name``; its detail is kept to one short printable line.

    Each check binds its name once (``r = partial(_made, "exit_ok")``). A detail that is
    short and printable (the usual one) is kept as it is without a further call: ``printable``
    and its ``oneline`` leave such text as it is (no control character, line break or surrogate).
    """
    if len(detail) > DETAIL_MAX or not detail.isprintable():
        detail = cut(printable(detail), DETAIL_MAX)
    return CheckResult(name, ok, detail)


def exit_ok(ev: Evidence) -> CheckResult:
    r = partial(_made, "exit_ok")
    e = ev.exit
    if e.lost:  # null only beside a receipt (section 5): without one the attempt counts as interrupted
        when = "while the agent ran" if e.started else "before its agent was seen to start (the attempt has no logs)"
        if ev.receipt.missing:
            return r(False, f"exit status lost: the daemon stopped {when}, and it left no receipt")
        return r(None, f"exit status lost: the daemon stopped {when}")
    if e.aborted:
        return r(False, f"{e.aborted} after {e.seconds:.2f} s")
    if e.timed_out and e.idle_s is not None:
        return r(False, f"timed out: idle {number(e.idle_s)} s (no output, no change in work/)")
    if e.timed_out:
        return r(False, f"timed out after {number(e.timeout_s)} s")
    if e.code is None:
        return r(False, "no exit status")
    if e.code < 0:
        return r(False, f"{exit_text(e.code)} after {e.seconds:.2f} s")
    return r(e.code == 0, f"exit {e.code} in {e.seconds:.2f} s")


def _receipt(ev: Evidence) -> dict[str, Any] | None:
    value = ev.receipt.value
    return value if isinstance(value, dict) and ev.receipt.error is None else None


def receipt_present(ev: Evidence) -> CheckResult:
    r = partial(_made, "receipt_present")
    if ev.receipt.missing:
        return r(False, "no receipt.json")
    if ev.receipt.error is not None:
        return r(False, f"receipt.json {ev.receipt.error}")
    if not isinstance(ev.receipt.value, dict):
        return r(False, "receipt.json is not a JSON object")
    return r(True, "receipt.json is a JSON object")


def receipt_job_id(ev: Evidence) -> CheckResult:
    r = partial(_made, "receipt_job_id")
    rec = _receipt(ev)
    if rec is None:
        return r(None, "no usable receipt")
    got = rec.get("job_id")
    if got == ev.order.job_id:
        return r(True, f"job_id is {got}")
    return r(False, f"job_id is {_got(got)}, expected {shown(ev.order.job_id)}")


def receipt_status(ev: Evidence) -> CheckResult:
    r = partial(_made, "receipt_status")
    rec = _receipt(ev)
    if rec is None:
        return r(None, "no usable receipt")
    status = rec.get("status")
    if status == "done":
        return r(True, "status is done")
    if status == "failed":
        why = rec.get("reason")
        # a reason that is not text is shown as a person reads it, never in Python notation: 3600, true, a, b, {...}
        text = why if isinstance(why, str) else shown(why) if isinstance(why, dict) else plain(why)
        return r(False, f"the agent reported failure: {text}" if why else "status is failed")
    return r(False, f'status is {_got(status)}, expected "done" or "failed"')


def _got(value: Any) -> str:
    """A receipt field as a detail shows it: missing, "text", 12, true, null (never Python's None)."""
    return "missing" if value is None else shown(value)


def _compare_ids(got: Sequence[Any], want: Sequence[str], what: str) -> str | None:
    """Return what is wrong between two id lists (missing, extra, repeated), or None."""
    have = Counter(id_key(i) for i in got)
    shown = {id_key(i): id_shown(i) for i in got}
    need = set(want)
    problems = []
    missing = [i for i in want if i not in have]
    extra = sorted({shown[k] for k in have if k not in need})
    repeated = sorted({shown[k] for k, n in have.items() if n > 1})
    if missing:
        problems.append("missing " + listed([id_shown(i) for i in missing]))
    if extra:
        problems.append("extra " + listed(extra))
    if repeated:
        problems.append("repeated " + listed(repeated))
    return f"{what}: " + "; ".join(problems) if problems else None


def receipt_inputs(ev: Evidence) -> CheckResult:
    r = partial(_made, "receipt_inputs")
    rec = _receipt(ev)
    if rec is None:
        return r(None, "no usable receipt")
    ids = rec.get("input_ids")
    if not isinstance(ids, list):
        return r(False, "input_ids is not a list")
    if ids == list(ev.order.item_ids):  # the usual receipt: the item ids in order, each once
        return r(True, _match(len(ids), "input id", "the order"))
    wrong = _compare_ids(ids, ev.order.item_ids, "input_ids")
    return r(False, wrong) if wrong else r(True, _match(len(ids), "input id", "the order"))


def _summary(ev: Evidence) -> OutputSummary | None:
    if ev.output is None or ev.output.error is not None or ev.output.missing:
        return None
    summary: OutputSummary = ev.output.value
    return summary


def output_rows(ev: Evidence) -> CheckResult:
    r = partial(_made, "output_rows")
    out = ev.order.accept.output
    if out is None or ev.output is None:
        return r(None, "no accept.output")
    if ev.output.missing:
        return r(False, f"{out} is missing")
    if ev.output.error is not None:
        return r(False, f"{out} {ev.output.error}")
    summary = _summary(ev)
    if summary is None:
        return r(False, f"{out} is not usable")
    if summary.one_per_item:  # no problem to look for
        return r(True, f"{plural(summary.records, 'record')}, one per item")
    problems = summary.problems(ev.order.item_ids)
    if problems:
        return r(False, f"{out} {ev.order.accept.key}: " + "; ".join(problems))
    return r(True, f"{plural(summary.records, 'record')}, one per item")


def receipt_outputs(ev: Evidence) -> CheckResult:
    r = partial(_made, "receipt_outputs")
    out = ev.order.accept.output
    if out is None:
        return r(None, "no accept.output")
    rec = _receipt(ev)
    summary = _summary(ev)
    if rec is None:
        return r(None, "no usable receipt")
    if summary is None:
        return r(None, "no usable output")
    got = rec.get("output_ids")
    if not isinstance(got, list):
        return r(False, "output_ids is not a list")
    if summary.one_per_item and got == list(summary.item_counts):  # the item ids in order, each in one record
        return r(True, _match(len(got), "output id", out))
    have = Counter(map(stored_key, got))
    want = summary.id_counts()
    if summary.complete and have == want:
        return r(True, _match(len(got), "output id", out))
    names = summary.shown_ids()
    missing = sorted(names[k] for k in want if k not in have)
    # Without every id of the output known, only ids known to be in it or known to be absent
    # (item ids no record carries) can be named; the rest is compared by count.
    absent = {k for k in have if k not in want and (summary.complete or k in summary.item_counts)}
    extra = sorted({id_shown(i) for i in got if stored_key(i) in absent})
    parts = [f"missing {listed(missing)}" if missing else "", f"extra {listed(extra)}" if extra else ""]
    text = "; ".join(p for p in parts if p)
    if not text and not summary.complete:
        known_differ = any(have[k] != n for k, n in want.items())
        if known_differ or sum(n for k, n in have.items() if k not in want) != summary.uncounted:
            text = "counts differ"
        else:
            return r(
                False,
                f"output_ids cannot be compared in full: {out} holds more than {OTHERS_MAX} ids that are not "
                f"item ids ({summary.uncounted} records not kept); no difference found among the rest",
            )
    return r(False, f"output_ids differ from {out}: {text or 'counts differ'}")


def allowed_values(ev: Evidence) -> CheckResult:
    r = partial(_made, "allowed_values")
    acc = ev.order.accept
    if acc.allowed is None and not acc.required:
        return r(None, "no accept.allowed or accept.required")
    summary = _summary(ev)
    if summary is None:
        return r(None, "no usable output")
    if summary.first_bad is not None:
        return r(False, summary.first_bad.describe())
    return r(True, f"{plural(summary.records, 'record')} {'uses' if summary.records == 1 else 'use'} allowed values")


def in_scope(path: str, writes: Sequence[str]) -> bool:
    """Return True if the agent may create or change work/<path>."""
    if path == "receipt.json" or path.startswith("outbox/"):
        return True
    return any(path == pat or fnmatchcase(path, pat) for pat in writes)


def writes_scope(ev: Evidence) -> CheckResult:
    r = partial(_made, "writes_scope")
    if not ev.work_exists:
        return r(False, "work/ is gone")
    present = {e.path: e for e in ev.entries}
    for path, digest in ev.given.items():
        e = present.get(path)
        if e is None:
            return r(False, f"{path} was given and is deleted")
        if e.kind != "file" or e.digest != digest:
            return r(False, f"{path} was given and is changed")
    if ev.changed_unknown is not None:
        return r(False, ev.changed_unknown)
    for e in ev.entries:
        if e.kind == "dir" or e.path in ev.given:
            continue
        if e.stamp is not None and e.stamp == ev.left.get(e.path):
            continue  # left by the agent's own checks, untouched since: not the agent's work
        if e.kind == "symlink" and not e.target_inside:
            return r(False, f"{e.path} is a link that points outside work/")
        if e.kind in ("fifo", "socket", "device"):
            return r(False, f"{e.path} is a {e.kind}")
        if e.kind == "unreadable":
            return r(False, f"{e.path} cannot be listed")
        if e.kind == "file" and e.nlink > 1:
            return r(False, f"{e.path} has {e.nlink} hard links")
        if ev.changed is not None:  # writes are the workspace's; work/ takes the receipt, outbox and output
            if not in_scope(e.path, (ev.order.accept.output,) if ev.order.accept.output else ()):
                return r(False, f"work/{e.path} is outside the receipt, outbox/ and the output")
        elif not in_scope(e.path, ev.writes):
            return r(False, f"{e.path} is outside writes ({', '.join(ev.writes) or 'none'})")
    if ev.changed is not None:
        outside = [p for p in ev.changed if not any(p == pat or fnmatchcase(p, pat) for pat in ev.writes)]
        if outside:
            shown = ", ".join(outside[:20]) + (f" and {len(outside) - 20} more" if len(outside) > 20 else "")
            return r(False, f"changed outside writes ({', '.join(ev.writes) or 'none'}): {shown}")
        return r(True, f"every changed path ({len(ev.changed)}) is inside writes")
    return r(True, "every change is inside writes")


def followups_valid(ev: Evidence) -> CheckResult:
    r = partial(_made, "followups_valid")
    wanted = ev.order.accept.followups
    if not ev.outbox_exists and not ev.followups and wanted is None:
        return r(None, "no outbox/")
    if len(ev.followups) > ev.max_followups:
        n = len(ev.followups)
        return r(False, f"{n} follow-up{'' if n == 1 else 's'}, more than max_followups ({ev.max_followups})")
    seen: set[str] = set()
    to_count: Counter[str] = Counter()
    for f in ev.followups:
        if f.order is None:
            return r(False, f"outbox/{f.name}: {f.error}")
        o = f.order
        if o.job_id == ev.order.job_id:
            return r(False, f"outbox/{f.name}: job_id {o.job_id} is this job's own")
        if o.job_id in seen:
            return r(False, f"outbox/{f.name}: job_id {o.job_id} is repeated in outbox/")
        if o.job_id in ev.known_ids:
            return r(False, f"outbox/{f.name}: job_id {o.job_id} is already known")
        if o.sender != ev.agent:
            return r(False, f"outbox/{f.name}: from is {shown(o.sender)}, expected {shown(ev.agent)}")
        if o.sets_lineage:
            return r(False, f"outbox/{f.name}: parent and hops are set by the daemon, not the agent")
        if ev.hops + 1 > ev.max_hops:
            return r(False, f"outbox/{f.name}: hops {ev.hops + 1} would exceed max_hops {ev.max_hops}")
        seen.add(o.job_id)
        to_count[o.to] += 1
    cycle = _after_cycle({f.order.job_id: f.order.after for f in ev.followups if f.order is not None})
    if cycle:
        return r(False, "after would make a cycle: " + " -> ".join(cycle))
    if wanted is not None:
        for name in wanted:
            if to_count[name] != 1:
                return r(False, f"expected exactly one follow-up to {name}, found {to_count[name]}")
        others = sorted(set(to_count) - set(wanted))
        if others:
            return r(False, f"follow-ups to agents not in accept.followups: {', '.join(others)}")
    n = len(ev.followups)
    return r(True, f"{n} follow-up{'s' if n != 1 else ''} valid" if n else "no follow-ups")


def _after_cycle(graph: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    """Return a cycle of ``after`` among sibling follow-ups (id -> the ids it waits for), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path, stack = [start], [iter(graph[start])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt in graph and nxt not in done:
                path.append(nxt)
                stack.append(iter(graph[nxt]))
    return None


CHECKS: tuple[Callable[[Evidence], CheckResult], ...] = (
    exit_ok,
    receipt_present,
    receipt_job_id,
    receipt_status,
    receipt_inputs,
    output_rows,
    receipt_outputs,
    allowed_values,
    writes_scope,
    followups_valid,
)
MUST_PASS = ("exit_ok", "receipt_present", "receipt_job_id")


def run_checks(ev: Evidence) -> list[CheckResult]:
    """Run every check in contract order; none is skipped after a failure.

    A check that raises on input nobody foresaw is recorded as failed, with the
    error as its detail, rather than losing the other checks.
    """
    try:
        return [check(ev) for check in CHECKS]
    except Exception:  # noqa: BLE001 - the checks are pure: run them again one by one, the others kept
        return _run_each(ev)


def _run_each(ev: Evidence) -> list[CheckResult]:
    """Run every check in contract order, one that raises recorded as failed with the error as its detail."""
    results = []
    for check in CHECKS:
        try:
            results.append(check(ev))
        except Exception as exc:  # noqa: BLE001 - a check must never take the job down with it
            detail = cut(printable(f"the check failed: {exc!r}"), DETAIL_MAX)
            results.append(CheckResult(check.__name__, False, detail))
    return results


def verdict(results: Sequence[CheckResult], *, exit_lost: bool = False) -> str | None:
    """Return None when the job is done, else the reason: the first failing check's name and detail.

    Done means no check is false and exit_ok, receipt_present and receipt_job_id
    are true (exit_ok may be null only when its status was lost in a crash).
    """
    for res in results:
        required = res.name in MUST_PASS and not (res.name == "exit_ok" and exit_lost)
        if res.ok is False or (required and res.ok is not True):
            return f"{res.name}: {res.detail}"
    return None


def _match(n: int, what: str, where: str) -> str:
    """Return `3 input ids match the order`, `1 input id matches the order`."""
    return f"{plural(n, what)} {'matches' if n == 1 else 'match'} {where}"
