"""A completion's ``prompt`` given as token ids is used as is only when every item is a
non-negative int (bools are not token ids), whatever the ids' size."""

from __future__ import annotations

import pytest

from router.decision.tokenize import RoutingTokenizer


@pytest.mark.parametrize(
    ("prompt", "used"),
    [
        ([1, 2, 3], True),
        ([0, 2**32 - 1], True),
        ([0, 2**32, 2**70], True),  # past u32: the Python check decides
        ([1, True, 3], False),
        ([1, -1], False),
        ([1, 2.0], False),
        ([1, "2"], False),
        (list(range(240_000)), True),
        ([*range(240_000), -5], False),
    ],
)
async def test_token_id_prompts_are_taken_only_when_every_id_is_a_non_negative_int(prompt, used):
    tok = RoutingTokenizer("byte")
    ids = await tok.prompt_ids({"model": "m", "prompt": prompt}, "completion")
    if used:
        assert ids is prompt
    else:
        assert ids is None
