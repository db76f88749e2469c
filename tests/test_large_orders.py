"""A large order's JSON text is made off the ledger lane; the files a claim writes stay byte for byte the same."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from conftest import Env, order

from dispatcher import fsutil
from dispatcher.ledger.records import Claimed
from dispatcher.spec.jobspec import JobSpec
from dispatcher.spec.orders import parse_order, to_json
from dispatcher.spec.settings import Agent
from dispatcher.store import placing
from dispatcher.store.placing import AHEAD_TEXT_BYTES, Inspected, body_text

NOTES = ["a line of notes, é and ü and 日本, one of many"] * 4000


def inspected(body: dict[str, Any]) -> Inspected:
    """Return body as an order read with its text made ahead (what a large order carries)."""
    data = json.dumps(body).encode()
    parsed = parse_order(data, f"{body['job_id']}.json")
    return Inspected(f"{body['job_id']}.json", data, parsed, "", 0.0, (0, 0), body_text(parsed.body))


@pytest.mark.parametrize(
    "claimed",
    [Claimed("X", 1), Claimed("X", 1, parent="PARENT-ü", hops=3, parent_chain_cost_usd=1.25)],
    ids=["root", "follow-up"],
)
def test_the_body_with_its_lineage_is_what_the_plain_encoder_writes(claimed: Claimed) -> None:
    """work/order.json from the text made ahead equals to_json of the body with the claim's parent and hops."""
    item = inspected(order("BIG-1", meta={"notes": NOTES, "n": [1.5, -0.0, 10**30, None, True]}))
    text = placing._with_lineage(item, claimed)
    assert text is not None
    body = {**item.order.body, "parent": claimed.parent, "hops": claimed.hops}
    assert (text + "\n").encode() == to_json(body)


def test_an_order_naming_its_own_parent_or_hops_is_encoded_whole() -> None:
    """The keys would keep their place in the body: no splice, the claim encodes it as before."""
    for extra in ({"parent": None}, {"hops": 0}):
        assert placing._with_lineage(inspected(order("BIG-2", **extra)), Claimed("BIG-2", 1)) is None


def test_job_json_with_the_text_put_in_is_dump_json_of_the_spec() -> None:
    """_spec_json(spec, text) gives the very bytes fsutil.dump_json(spec.to_json()) gives."""
    body = {**order("BIG-3", meta={"notes": NOTES}), "parent": "P-ü", "hops": 1}
    spec = JobSpec(
        job_id="BIG-3",
        source="BIG-3.json",
        received=1796252481.25,
        parent="P-ü",
        hops=1,
        agent=Agent("worker", ("sh", "agent.sh"), env={"NOTE": "ü"}),
        timeout_s=60.0,
        max_attempts=2,
        budget=2,
        writes=("out.csv",),
        given={"order.json": "0" * 64},
        order=body,
        parent_chain_cost_usd=0.5,
    )
    text = body_text(spec.order)
    assert placing._spec_json(spec, text) == fsutil.dump_json(spec.to_json())


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_a_large_order_ends_done_with_the_same_files_a_small_one_gets(env: Env, fmt: str) -> None:
    """A 200 KB order: done; work/order.json is to_json of its body with lineage; job.json holds the same body."""
    body = order(f"LARGE-{fmt.upper()}", meta={"notes": NOTES})
    dropped = env.drop(body, f"{body['job_id']}.{fmt}")
    assert dropped.stat().st_size > AHEAD_TEXT_BYTES
    d = env.daemon()
    d.wait_ready()
    env.wait_job(body["job_id"], "done")
    folder = env.root / "done" / body["job_id"]
    given = (folder / "work" / "order.json").read_bytes()
    as_read = parse_order((folder / f"order.{fmt}").read_bytes(), dropped.name)  # the file as dropped
    assert given == to_json({**as_read.body, "parent": None, "hops": 0})  # YAML's keys in the file's order
    job = (folder / "job.json").read_bytes()
    assert job == fsutil.dump_json(json.loads(job))  # the same encoder's bytes, keys in their order
    spec = json.loads(job)
    assert spec["order"] == json.loads(given)
    assert spec["given"]["order.json"] == hashlib.sha256(given).hexdigest()
