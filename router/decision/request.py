"""One proxied request's life after its decision: ``RoutedRequest``.

The gate (``router.http.gate``) creates it; the forwarder takes it and tells it, per try,
when the request is written upstream (``sent``) and when that try is over (``ended``);
the proxy ``release``s it if no forward started. Everything that follows from those
moments happens here, in one place: the policy counts the work, predict-on-route records
and settles (``Router.routed`` / ``Router.settled``), the admission slot is given back
and the admission queue woken. The decision itself stays as it was made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.decision.decide import RouteDecision, Router
    from router.fleet.admission import AdmissionController, Ticket
    from router.fleet.instances import Instance

__all__ = ["RoutedRequest"]


class RoutedRequest:
    """A decision on its way: the model's pool, its LoRA adapter, its admission slot."""

    __slots__ = ("admission", "decision", "lora", "pool", "router", "ticket")

    def __init__(
        self,
        decision: RouteDecision,
        router: Router,
        *,
        pool: list[Instance] | None = None,
        lora: tuple[str, str | None] | None = None,
        ticket: Ticket | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        self.decision = decision
        self.router = router
        self.pool = pool if pool is not None else []  # the model's pool, busy ones included
        self.lora = lora
        # The slot admission gave it, held until a forward starts (then the instance's
        # in-flight count stands for it).
        self.ticket = ticket
        self.admission = admission

    def sent(self, instance: str) -> None:
        """Written to ``instance`` (no await since): counted and predicted there."""
        self.router.routed(self.decision, instance)
        if self.ticket is not None:
            self.ticket.release()

    def ended(self, instance: str) -> None:
        """The try on ``instance`` is over (answered, failed, or the client left)."""
        self.router.settled(self.decision, instance)
        if self.admission is not None:
            self.admission.notify()  # a slot may have freed

    def release(self) -> None:
        """No forward started (every try failed before one): give the slot back."""
        if self.ticket is not None:
            self.ticket.release()
