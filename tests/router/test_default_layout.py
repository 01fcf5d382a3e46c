"""The router's default layout is written in the engine profiles' grammar
(``events.groups.parse_layout``); a hybrid named alone sits beside full attention."""

from __future__ import annotations

import pytest

from engine_adapter.profiles import get_profile
from events.groups import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from router.decision.layout import default_layout


def test_the_short_forms_mean_a_hybrid_beside_one_full_attention_group() -> None:
    assert default_layout("full", 32).groups == (FullAttentionSpec(32),)
    assert default_layout("swa:64", 32).groups == (FullAttentionSpec(32), SlidingWindowSpec(32, 64))
    assert default_layout("mamba", 16).groups == (FullAttentionSpec(16), MambaSpec(16))


def test_a_profile_layout_is_taken_as_the_engine_builds_it() -> None:
    text = "swa:1024*5,full"
    assert default_layout(text, 16) == get_profile("x", layout=text, block_size=16).layout
    assert len(default_layout(text, 16).groups) == 6


@pytest.mark.parametrize("bad", ["", "swa", "swa:0", "window:64", "full*0"])
def test_a_layout_outside_the_grammar_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="layout"):
        default_layout(bad, 16)
