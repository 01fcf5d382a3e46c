"""Admission's queue discipline on real ``Instance`` objects (no I/O): FIFO, one queued
request per freed slot, cancelled waiters leave the queue, thresholds per instance."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from router.fleet.admission import AdmissionConfig, AdmissionController, Rejected, Ticket
from router.fleet.instances import Instance
from router.fleet.specs import InstanceSpec


def _inst(name: str = "http://a:1") -> Instance:
    return Instance(InstanceSpec(name))


async def test_a_freed_slot_admits_exactly_the_oldest_waiter():
    inst = _inst()
    reg = CollectorRegistry()
    ctl = AdmissionController(AdmissionConfig(max_inflight=1, timeout_s=30), registry=reg)
    first = await ctl.admit([inst])
    assert isinstance(first, Ticket)
    inst.inflight_requests = 1  # its forward started ...
    first.release()  # ... so the ticket hands over to the instance's in-flight count
    waiters = [asyncio.create_task(ctl.admit([inst])) for _ in range(3)]
    await asyncio.sleep(0)
    assert ctl.describe([inst])["queue_depth"] == 3
    assert reg.get_sample_value("kvroute_router_admission_queue_depth") == 3
    inst.inflight_requests = 0  # the request ended
    ctl.notify()  # synchronous: the queue's head is admitted now, and only it
    assert ctl.describe([inst])["queue_depth"] == 2
    assert isinstance(await asyncio.wait_for(waiters[0], 5), Ticket)
    assert not waiters[1].done() and not waiters[2].done()
    waiters[1].cancel()  # a client that went away leaves the queue
    await asyncio.gather(waiters[1], return_exceptions=True)
    assert ctl.describe([inst])["queue_depth"] == 1
    assert reg.get_sample_value("kvroute_router_admission_queue_depth") == 1  # read when scraped
    waiters[0].result().release()  # never forwarded: its slot frees again
    assert ctl.describe([inst])["queue_depth"] == 0
    assert isinstance(await asyncio.wait_for(waiters[2], 5), Ticket)


async def test_engine_thresholds_mark_busy_and_a_full_queue_rejects_at_once():
    a, b = _inst("http://a:1"), _inst("http://b:1")
    ctl = AdmissionController(
        AdmissionConfig(max_waiting=4, max_kv_usage=0.9, queue_size=0, retry_after_s=2.5)
    )
    a.engine_waiting = 4
    b.engine_stats = {"kv_gpu_usage": 0.95}
    assert ctl.busy_reason(a).startswith("engine_waiting")
    assert ctl.busy_reason(b).startswith("kv_usage")
    out = await ctl.admit([a, b])
    assert isinstance(out, Rejected) and out.reason == "queue_full" and out.retry_after_s == 3
    assert ctl.open_instances([a, b]) == [a, b]  # all busy: the queue decides, not this
    b.engine_stats = {"kv_gpu_usage": 0.5}
    assert isinstance(await ctl.admit([a, b]), Ticket)
    assert ctl.open_instances([a, b]) == [b]


async def test_no_threshold_means_no_admission_control():
    inst = _inst()
    inst.inflight_requests = 10_000
    ctl = AdmissionController(AdmissionConfig(queue_size=0))
    assert not ctl.config.enabled
    assert isinstance(await ctl.admit([inst]), Ticket)


async def test_a_full_pool_does_not_hold_up_requests_for_another_models_pool():
    a, b = _inst("http://a:1"), _inst("http://b:1")
    ctl = AdmissionController(AdmissionConfig(max_inflight=1, timeout_s=30))
    a.running_requests = 1  # model A's only instance is busy
    waiting_for_a = asyncio.create_task(ctl.admit([a]))
    await asyncio.sleep(0)
    assert ctl.describe([a])["queue_depth"] == 1
    assert isinstance(await ctl.admit([b]), Ticket)  # model B's pool has room: no queue
    a.running_requests = 0
    ctl.notify()
    assert isinstance(await asyncio.wait_for(waiting_for_a, 5), Ticket)
