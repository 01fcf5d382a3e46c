"""What stands between a parsed OpenAI body and its decision: which instances may serve
it (its model's pool; vLLM's 404 when no instance serves the model), whether it may go
now (admission: a slot, a bounded wait, or 429), its LoRA adapter and its session.

One function for the proxy's hot path and ``/debug/route``, so what ``/debug/route``
explains is what a forwarded request gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.decision.request import RoutedRequest
from router.fleet.admission import Rejected, Ticket
from router.http.replies import Reply, error_reply, rejected_reply, unknown_model_reply

if TYPE_CHECKING:
    from router.dashboard import Dashboard
    from router.state import RouterState

__all__ = ["HeaderView", "route_request"]


class HeaderView:
    """``get`` over raw ASGI headers (lower-case names), without building a dict: most
    requests ask it nothing (no session header configured)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in self._raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default


async def route_request(
    state: RouterState,
    data: dict[str, Any],
    kind: str,
    headers: list[tuple[bytes, bytes]],
    *,
    forward: bool = True,
    dashboard: Dashboard | None = None,
) -> RoutedRequest | Reply:
    """The request's decision, or the reply that ends it here (404, 429, 503).

    With ``forward`` the request holds an admission ticket (``RoutedRequest.ticket``)
    until its forward starts: the caller ``release``s it if none does."""
    model = data.get("model")
    pool = state.models.pool(model, state.registry.healthy(), state.registry.all())
    if pool is None:
        return unknown_model_reply(str(model))  # None only for a model named, not served
    admission = state.admission
    gated = forward and admission.config.enabled  # off: no ticket, nothing to notify
    ticket: Ticket | None = None
    if gated:
        admitted = await admission.admit(pool)
        if isinstance(admitted, Rejected):
            return rejected_reply(admitted)
        ticket = admitted
    candidates = admission.open_instances(pool)
    lora = state.models.adapter(model, candidates)
    session = state.affinity.session_key(HeaderView(headers), data)
    decision = None
    try:
        decision = await state.router.decide(  # predicted once written upstream (proxy)
            data, kind, record=forward, instances=candidates, lora=lora, session=session,
            predict=False,
        )  # fmt: skip
    finally:
        if decision is None and ticket is not None:
            ticket.release()  # not routed: none healthy, an error, the client gone
    if decision is None:
        return error_reply("no healthy instance", 503, "ServiceUnavailableError")
    if forward and dashboard is not None:
        dashboard.record(decision, kind)
    return RoutedRequest(
        decision, state.router, pool=pool, lora=lora, ticket=ticket,
        admission=admission if gated else None,
    )  # fmt: skip
