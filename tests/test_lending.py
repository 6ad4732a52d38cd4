"""Spares lent between the jobs of one `baton serve` (baton/control/lending.py): the decision
on its own, then the broker driving three real orchestrators through their agent links (the
end-to-end run with real processes is in test_serve.py)."""

from __future__ import annotations

import time

from baton.control import messages as m
from baton.control.agent_link import AgentLink
from baton.control.lending import Idle, Party, SpareBroker, Want, match
from baton.control.orchestrator import Config, Orchestrator
from baton.store.sqlite import SqliteStore
from tests.test_orchestrator import LOOP, _bundle, report


def test_the_highest_priority_is_served_first_from_the_lowest_priority_lender():
    wants = [Want("mid", 5, since=1.0), Want("high", 9, since=2.0)]
    assert match(wants, [Idle("low", 1, 1)]) == [("high", "low")]  # asked later, served first
    assert match(wants, [Idle("low", 1, 1), Idle("lower", 0, 1)]) == [("high", "lower"), ("mid", "low")]
    assert match(wants, [Idle("low", 1, 2)]) == [("high", "low"), ("mid", "low")]


def test_no_job_takes_a_spare_of_equal_or_higher_priority():
    assert match([Want("a", 5, 1.0)], [Idle("b", 5, 3), Idle("c", 7, 1)]) == []
    assert match([Want("a", 5, 1.0)], [Idle("a", 1, 1)]) == []  # nor its own (it would have used it)
    assert match([Want("a", 5, 1.0), Want("b", 5, 0.5)], [Idle("c", 1, 1)]) == [("b", "c")]  # equals: oldest


class Jobs:
    """Orchestrators as `baton serve` hosts them: an agent link each, one broker."""

    def __init__(self, tmp_path):
        self.parties: dict[str, Party] = {}
        self.broker = SpareBroker(lambda: self.parties)
        self.tmp = tmp_path

    def add(self, name: str, priority: int, world: int, spares: int) -> Orchestrator:
        link = AgentLink([f"local/{i}" for i in range(world + spares)], [], name, self.broker)
        orch = Orchestrator(Config(world_size=world, spares=spares, job_id=name, borrow_spares=True),
                            SqliteStore(self.tmp / f"{name}.db"), link)
        orch.start()
        for wid in list(orch.workers):
            orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
        for r in range(world):
            report(orch, f"w{r}", {"type": "ready", "loop": LOOP, "bundle": _bundle(r)})
            report(orch, f"w{r}", {"type": "heartbeat", "step": 10})
        self.parties[name] = Party(name, priority, "host", True, orch)
        return orch


def _lose_rank_1(orch: Orchestrator) -> None:
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    report(orch, "w0", {"type": "recover", "generation": orch.generation, "pos": [10, 0]})
    assert orch.wants_spare


def test_a_contested_spare_is_lent_to_the_higher_priority_job_and_comes_back(tmp_path):
    jobs = Jobs(tmp_path)
    low, mid, high = jobs.add("low", 1, 2, 1), jobs.add("mid", 5, 2, 0), jobs.add("high", 9, 2, 0)
    low.handle(m.WorkerExited(worker_id="w2", returncode=-9))  # low's spare: another one starts
    low.handle(m.Tick(now=time.time()))
    restarted = next(w for w in low.workers.values() if w.role.value == "starting")
    _lose_rank_1(mid)
    _lose_rank_1(high)
    jobs.broker.step()
    assert mid.wants_spare and high.wants_spare  # nothing idle to lend yet

    low.register(restarted.id, m.Register(pid=1, transfer_addr=("127.0.0.1", 2000)))
    jobs.broker.step()  # lent to high; low stops its spare first
    assert low.slots[restarted.slot].lent_to == "high" and restarted.role.value == "gone"
    assert not any(n.lender for n in high.nodes.values())  # not before that process exited
    low.handle(m.WorkerExited(worker_id=restarted.id, returncode=-9))
    low.handle(m.Tick(now=restarted.last_seen + 1))
    assert not [w for w in low.workers.values() if w.slot == restarted.slot and w.role.value != "gone"]

    jobs.broker.step()  # handed over: high starts its own worker there
    lent = f"low:{restarted.slot}"  # keeps its index (its GPU); its node is low's node
    assert high.nodes["low:local"].lender == "baton job low (priority 1)"
    joiner = next(w for w in high.workers.values() if w.slot == lent)
    high.register(joiner.id, m.Register(pid=1, transfer_addr=("127.0.0.1", 3000)))
    assert high.op.moves[1].to_worker == joiner.id
    assert mid.wants_spare and "mid" in jobs.broker._requests  # still waiting, still asking

    with high._lock:
        high._release(high.nodes["low:local"])  # its rank moved off (return home): the slot goes back
    high.handle(m.WorkerExited(worker_id=joiner.id, returncode=0))
    jobs.broker.step()
    assert low.slots[restarted.slot].lent_to is None
    again = next(w for w in low.workers.values() if w.slot == restarted.slot and w.role.value == "starting")
    low.register(again.id, m.Register(pid=1, transfer_addr=("127.0.0.1", 2001)))
    jobs.broker.step()
    assert low.slots[restarted.slot].lent_to == "mid"  # now the one still waiting gets it
