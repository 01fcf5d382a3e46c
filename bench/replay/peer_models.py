"""In-process models of the peer routers, so the simulator can replay whole traces with
them (the real binaries only run live). Each follows the behaviour documented in
/work/shared/docs/peer-routers.md for the versions benchmarked; live runs of the real
routers on a subset check them (the suite reports both).

* ``VllmKvAwareModel`` (vllm-router 0.1.17 ``kv_aware``): credited tokens from engine
  events, full-attention groups only (it scores one group; sliding-window and Mamba
  evictions are invisible to it), CPU tier credited 0.8; cost = new prefill tokens x
  (1 + requests in flight)^2, the minimum wins, ties go to the first worker.
* ``SglangCacheAwareModel`` (sglang-router 0.3.2 ``cache_aware``): an approximate radix
  tree of request text per worker, no engine events; match rate above ``threshold`` ->
  the worker with the longest match, else the least loaded (requests in flight), and the
  least loaded regardless when loads are imbalanced (max - min > 32 and max > 1.5 min).
  The doc notes its load counter did not move over HTTP on 0.3.2 (then low-match traffic
  all goes to the first worker: ``load_moves=False``); the issue's live run reused 73.7%,
  which only a moving counter explains, so the model defaults to ``load_moves=True`` --
  the stronger peer. The tree is matched at ``granularity``-character steps and never
  evicts (its default size limit is far above these workloads).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.decision.policy import Candidate, Decision, Policy

__all__ = ["PEER_MODELS", "SglangCacheAwareModel", "VllmKvAwareModel", "make_peer_model"]

PEER_MODELS = ("vllm-router", "sglang-router")


class VllmKvAwareModel(Policy):
    name = "model:vllm-router"
    uses_scores = True

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        def cost(c: Candidate) -> float:
            credited = c.gpu_tokens + 0.8 * c.cpu_tokens
            new = max(num_prompt_tokens - credited, 0.0)
            return new * (1 + c.inflight_requests + c.running_requests) ** 2

        ranked = [c.name for c in sorted(candidates, key=lambda c: (cost(c), c.name))]
        return Decision(ranked[0], ranked)


class SglangCacheAwareModel(Policy):
    name = "model:sglang-router"
    uses_scores = False
    wants_text = True

    def __init__(
        self, threshold: float = 0.3, granularity: int = 64, load_moves: bool = True
    ) -> None:
        self.threshold = threshold
        self.granularity = granularity
        self.load_moves = load_moves
        self.trees: dict[str, set[int]] = {}
        self.text = ""  # the prompt of the request being routed (set by the simulator)

    def _prefixes(self, text: str) -> list[int]:
        g, h, out = self.granularity, 0, []
        for i in range(0, len(text) - g + 1, g):
            h = hash((h, text[i : i + g]))
            out.append(h)
        return out

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        names = sorted(c.name for c in candidates)
        load = {c.name: c.inflight_requests + c.running_requests for c in candidates}
        if not self.load_moves:
            load = dict.fromkeys(names, 0)
        lo, hi = min(load.values()), max(load.values())
        prefixes = self._prefixes(self.text)
        best, best_len = names[0], -1
        for n in names:
            tree = self.trees.get(n, set())
            k = 0
            while k < len(prefixes) and prefixes[k] in tree:
                k += 1
            if k > best_len:
                best, best_len = n, k
        rate = best_len * self.granularity / max(len(self.text), 1)
        if rate <= self.threshold or (hi - lo > 32 and hi > 1.5 * lo):
            best = min(names, key=lambda n: (load[n], n))
        self.trees.setdefault(best, set()).update(prefixes)
        ranked = [best] + [n for n in names if n != best]
        return Decision(best, ranked)


def make_peer_model(name: str) -> Policy:
    if name == "vllm-router":
        return VllmKvAwareModel()
    if name == "sglang-router":
        return SglangCacheAwareModel()
    raise ValueError(f"no model of {name!r}; expected one of {PEER_MODELS}")
