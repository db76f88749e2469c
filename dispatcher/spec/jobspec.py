"""What a job is, as typed values: its frozen spec and its attempts.

``JobSpec`` is what ``job.json`` holds: the validated order with its lineage,
and the agent's settings frozen when the job was claimed (refreshed from the
config when an operator retries it). ``Attempt`` is one run of the agent as
``attempts/<n>/attempt.json`` records it. Nothing here touches the disk.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from dispatcher.clock import iso, parse_iso
from dispatcher.spec.settings import Agent
from dispatcher.text import redact


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A claimed job's frozen description (``job.json``)."""

    job_id: str
    source: str
    received: float
    parent: str | None
    hops: int
    agent: Agent
    timeout_s: float
    max_attempts: int
    budget: int  # the last attempt number this job may run
    writes: tuple[str, ...]
    given: Mapping[str, str]  # files given to the agent in work/ -> sha256
    order: Mapping[str, Any]  # the validated order, with parent and hops
    parent_chain_cost_usd: float | None = None
    claimed: float | None = None  # Unix time of the claim that placed the job (None in a job.json from before)
    since: float | None = None  # when it last came back to active/: a retry, a revision, a join let go, a limit's wait
    checks_left: Mapping[str, str] = field(default_factory=dict)  # files its user checks left in work/ -> stamp
    base_commit: str | None = None  # its workspace's base, resolved to a commit at the claim (section 15)
    tree_left: Mapping[str, str] = field(default_factory=dict)  # what its checks left in its worktree (``worktree``)

    def to_json(self) -> dict[str, Any]:
        """Return the spec as plain JSON values (to be encoded: its agent's part is shared, never change it)."""
        return {
            "job_id": self.job_id,
            "source": self.source,
            "received": self.received,
            "parent": self.parent,
            "hops": self.hops,
            "agent": _agent_json(self.agent),
            "timeout": self.timeout_s,
            "max_attempts": self.max_attempts,
            "budget": self.budget,
            "writes": list(self.writes),
            "given": dict(self.given),
            "order": dict(self.order),
            "parent_chain_cost_usd": self.parent_chain_cost_usd,
            "claimed": self.claimed,
            "since": self.since,
            **({"checks_left": dict(self.checks_left)} if self.checks_left else {}),
            **({"base_commit": self.base_commit} if self.base_commit else {}),
            **({"tree_left": dict(self.tree_left)} if self.tree_left else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Rebuild a spec from ``to_json`` output (KeyError/TypeError/ValueError if damaged)."""
        return cls(
            job_id=str(data["job_id"]),
            source=str(data.get("source") or ""),
            received=float(data["received"]),
            parent=data.get("parent"),
            hops=int(data.get("hops", 0)),
            agent=Agent.from_json(data["agent"]),
            timeout_s=float(data["timeout"]),
            max_attempts=int(data["max_attempts"]),
            budget=int(data["budget"]),
            writes=tuple(data["writes"]),
            given=dict(data.get("given") or {}),
            order=dict(data.get("order") or {}),
            parent_chain_cost_usd=data.get("parent_chain_cost_usd"),
            claimed=_time_or_none(data.get("claimed")),
            since=_time_or_none(data.get("since")),
            checks_left=dict(data.get("checks_left") or {}),
            base_commit=str(data["base_commit"]) if data.get("base_commit") else None,
            tree_left=dict(data.get("tree_left") or {}),
        )

    def with_agent(self, agent: Agent, budget: int) -> JobSpec:
        """Return the spec with the agent's current settings and a new attempt budget (a retry).

        The timeout and the writes follow the agent unless the order sets its own.
        """
        timeout = self.order.get("timeout")
        writes = self.order.get("writes")
        return replace(
            self,
            agent=agent,
            budget=budget,
            timeout_s=float(timeout) if timeout is not None else agent.timeout_s,
            writes=tuple(writes) if writes is not None else agent.writes,
        )

    def with_given(self, name: str, sha: str) -> JobSpec:
        """Return the spec with one more file given to the agent."""
        return replace(self, given={**self.given, name: sha})

    def without_given(self, name: str) -> JobSpec:
        """Return the spec without the file ``name`` given to the agent (moved aside: not for the next attempt)."""
        return replace(self, given={k: v for k, v in self.given.items() if k != name})


_SNAPSHOTS: dict[int, tuple[Agent, dict[str, Any]]] = {}  # id(agent) -> (agent, agent.to_json())
_SNAPSHOTS_MAX = 64


def _agent_json(agent: Agent) -> dict[str, Any]:
    """Return ``agent.to_json()``, made once per Agent: every job of a config's agent snapshots the same values.

    The agent is kept beside its values, so an id reused by another object never matches.
    """
    known = _SNAPSHOTS.get(id(agent))
    if known is None or known[0] is not agent:
        if len(_SNAPSHOTS) >= _SNAPSHOTS_MAX:  # agents of configs reloaded since
            _SNAPSHOTS.clear()
        known = _SNAPSHOTS[id(agent)] = (agent, agent.to_json())
    return known[1]


MAX_COST_USD = 1e12  # a reported cost above this is no cost (a float would overflow in a chain's sum, or at once)


def is_cost(value: Any) -> TypeGuard[int | float]:
    """Is value a cost an agent may report: a number from 0 to ``MAX_COST_USD`` (never true or false)?"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_COST_USD


@dataclass(frozen=True, slots=True)
class Attempt:
    """One run of the agent (``attempts/<n>/attempt.json``)."""

    n: int
    started: float
    ended: float
    exit_code: int | None
    timed_out: bool = False
    argv: tuple[str, ...] = ()
    host: str | None = None
    agent_result: Mapping[str, Any] | None = None
    aborted: str | None = None
    interrupted: bool = False
    retry_next: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: the record as result.json keeps it, made once (attempt.json and result.json hold the same values)
    _record: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def duration_ms(self) -> int:
        return max(0, round((self.ended - self.started) * 1000))

    @property
    def cost_usd(self) -> float | None:
        """The cost the agent reported (``total_cost_usd`` of its final JSON), if any.

        An attempt that resumed a session costs the difference from the session's
        earlier total (``session_cost_before_usd``): a resumed CLI reports the
        whole session's running cost.
        """
        ar = self.agent_result
        cost = ar.get("total_cost_usd") if isinstance(ar, Mapping) else None
        if not is_cost(cost):
            return None
        before = self.extra.get("session_cost_before_usd")
        if isinstance(before, (int, float)) and not isinstance(before, bool):
            return round(max(0.0, float(cost) - float(before)), 10)
        return float(cost)

    def to_json(self, *, internal: bool = True) -> dict[str, Any]:
        """Return the record (a new dict); ``internal`` keeps the retry mark that result.json leaves out."""
        if internal and self.retry_next:
            return self._build(internal=True)
        record = self._record
        if record is None:
            record = self._build(internal=False)
            object.__setattr__(self, "_record", record)
        return dict(record)

    def _build(self, *, internal: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "n": self.n,
            "started": iso(self.started),
            "ended": iso(self.ended),
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "duration_ms": self.duration_ms,
            "argv": [redact(a) for a in self.argv],  # a password in a URL of the command is shown as ***
            "host": self.host,
            "cost_usd": self.cost_usd,
        }
        if self.agent_result is not None:
            out["agent_result"] = dict(self.agent_result)
            if "usage" in self.agent_result:
                out["usage"] = self.agent_result["usage"]
        if self.aborted:
            out["aborted"] = self.aborted
        if self.interrupted:
            out["interrupted"] = True
        if internal and self.retry_next:
            out["next"] = "retry"
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attempt:
        """Rebuild a record (KeyError/TypeError/ValueError if damaged)."""
        known = {
            "n", "started", "ended", "exit_code", "timed_out", "duration_ms", "argv", "host", "cost_usd",
            "agent_result", "usage", "aborted", "interrupted", "next",
        }  # fmt: skip
        ar = data.get("agent_result")
        return cls(
            n=int(data["n"]),
            started=parse_iso(data["started"]),
            ended=parse_iso(data["ended"]),
            exit_code=data.get("exit_code"),
            timed_out=bool(data.get("timed_out", False)),
            argv=tuple(data.get("argv") or ()),
            host=data.get("host"),
            agent_result=ar if isinstance(ar, dict) else None,
            aborted=data.get("aborted"),
            interrupted=bool(data.get("interrupted", False)),
            retry_next=data.get("next") == "retry",
            extra={k: v for k, v in data.items() if k not in known},
        )


def total_cost(attempts: list[Attempt]) -> float | None:
    """Return the sum of the attempts' reported costs, or None when none reported one."""
    costs = [a.cost_usd for a in attempts if a.cost_usd is not None]
    return round(sum(costs), 10) if costs else None


def prompt_values(
    order: Mapping[str, Any], writes: tuple[str, ...], work: Path, workspace: Path | None = None
) -> dict[str, str]:
    """Return the prompt template's placeholder values for one order in its work/ folder (and worktree)."""
    w = os.fspath(work)
    vals = {
        "job_id": order["job_id"],
        "from": order["from"],
        "to": order["to"],
        "task": order["task"],
        "items_json": json.dumps(order["items"], ensure_ascii=False),
        "writes": ", ".join(writes),
        "accept_json": json.dumps(order.get("accept") or {}, ensure_ascii=False),
        "order": f"{w}/order.json",
        "workspace": os.fspath(workspace or work),
        "receipt": f"{w}/receipt.json",
    }
    if order.get("after"):  # `{parents}` is a join's (section 16): elsewhere it passes unchanged
        vals["parents"] = f"{w}/parents.json"
    return vals


ARGV_PLACEHOLDERS = ("job_id", "order", "workspace", "receipt", "prompt", "prompt_file", "parents")
PROMPT_PLACEHOLDERS = (
    "job_id", "from", "to", "task", "items_json", "writes", "accept_json", "order", "workspace", "receipt", "parents",
)  # fmt: skip


def _pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(r"\{(" + "|".join(re.escape(n) for n in names) + r")\}")


_ARGV_RE = _pattern(ARGV_PLACEHOLDERS)
_PROMPT_RE = _pattern(PROMPT_PLACEHOLDERS)
_RESUME_RE = _pattern((*ARGV_PLACEHOLDERS, "session_id"))


def render(text: str, values: Mapping[str, str], *, prompt: bool = False, resume: bool = False) -> str:
    """Replace the contract's exact placeholders in text, in one pass; leave every other brace alone.

    ``resume``: an argv of the agent's ``resume`` command, where ``{session_id}`` is one of them.
    """
    regex = _PROMPT_RE if prompt else _RESUME_RE if resume else _ARGV_RE
    return regex.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def _time_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
