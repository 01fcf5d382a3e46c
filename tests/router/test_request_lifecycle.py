"""One request's life: a frozen decision, a ``RoutedRequest`` the forwarder tells when it
is sent and when each try ends, and predict-on-route's one owner behind it."""

from __future__ import annotations

import dataclasses

import pytest
from routerkit import StaticRegistry

from router.build import build_router
from router.config import RouterSettings
from router.decision.decide import RouteDecision, Router
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.request import RoutedRequest
from router.fleet.admission import AdmissionConfig, AdmissionController, Ticket
from router.fleet.instances import Instance
from router.index.memory import MemoryIndex

PROMPT = "".join(chr(65 + (i * 5) % 26) for i in range(600))


def make_router() -> Router:
    settings = RouterSettings(policy="cost", block_size=16, tokenizer="byte")
    layouts = LayoutRegistry(default=InstanceLayout.full(16))
    return build_router(
        settings, index=MemoryIndex(), layouts=layouts, registry=StaticRegistry("a", "b")
    )


async def admitted(
    router: Router,
) -> tuple[AdmissionController, list[Instance], Ticket, RouteDecision]:
    """A slot admitted under ``max_inflight=1`` and a decision for ``PROMPT`` made without
    predicting: what the gate hands a ``RoutedRequest``."""
    admission = AdmissionController(AdmissionConfig(max_inflight=1))
    pool = router.registry.healthy()
    ticket = await admission.admit(pool)
    assert isinstance(ticket, Ticket)
    decision = await router.decide({"prompt": PROMPT}, "completion", predict=False)
    assert decision is not None
    return admission, pool, ticket, decision


async def test_a_decision_cannot_be_written_after_it_is_made() -> None:
    router = make_router()
    decision = await router.decide({"prompt": PROMPT}, "completion", predict=False)
    assert decision is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.hash_size = {}  # type: ignore[misc]


async def test_sent_predicts_and_frees_the_slot_ended_settles_and_wakes_admission() -> None:
    router = make_router()
    admission, pool, ticket, decision = await admitted(router)
    url = decision.decision.instance
    request = RoutedRequest(decision, router, pool=pool, ticket=ticket, admission=admission)
    assert router.prediction.inflight(url) == 0  # decided, not yet sent: nothing predicted
    assert len(admission._pending) == 1

    request.sent(url)
    assert router.prediction.inflight(url) == 1
    assert len(admission._pending) == 0  # the in-flight count stands for it now
    nxt = await router.decide({"prompt": PROMPT + "more"}, "completion", record=False)
    assert nxt is not None and nxt.speculative_blocks[url] == len(PROMPT) // 16

    request.ended(url)
    assert router.prediction.inflight(url) == 0
    request.release()  # idempotent once sent: nothing left to free
    assert len(admission._pending) == 0


async def test_a_request_never_sent_releases_its_slot_and_predicts_nothing() -> None:
    router = make_router()
    admission, pool, ticket, decision = await admitted(router)
    RoutedRequest(decision, router, pool=pool, ticket=ticket, admission=admission).release()
    assert len(admission._pending) == 0
    assert router.prediction.inflight("a") == router.prediction.inflight("b") == 0
