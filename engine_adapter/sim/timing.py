"""The simulated engine's timing model: how long one engine step takes.

A step costs a fixed overhead, plus prefill time per uncached prompt token scheduled, plus
decode time per running sequence, plus the CPU->GPU copy time of loaded KV bytes. Defaults
are in the range of an 8B model on one H100 (prefill ~10k tok/s, ~15 ms decode steps,
~128 KiB of KV per token, ~20 GB/s host-to-device). ``time_scale`` makes everything run
that many times faster than real time, so trace replays finish quickly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 1e-4
    decode_s_per_seq: float = 2.5e-4
    decode_step_s: float = 0.012
    kv_bytes_per_token: int = 131_072
    load_bytes_per_s: float = 20e9
    time_scale: float = 1.0

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, loaded_tokens: int) -> float:
        """Simulated wall time of one step, already divided by ``time_scale``."""
        t = self.step_overhead_s + prefill_tokens * self.prefill_s_per_token
        if decode_seqs:
            t += self.decode_step_s + decode_seqs * self.decode_s_per_seq
        t += loaded_tokens * self.kv_bytes_per_token / self.load_bytes_per_s
        return t / self.time_scale
