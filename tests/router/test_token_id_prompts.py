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


async def test_the_check_packing_is_handed_on_once_and_only_for_its_own_prompt():
    """The decision hashes from the packing the check made (a 240k-token prompt packed
    once, not twice); what the check did not pack (past u32, text) hands on nothing."""
    from events.hashing import native_hashing, packed_u32

    tok = RoutingTokenizer("byte")
    prompt = list(range(240_000))
    ids, packed = await tok.prompt_ids_packed({"model": "m", "prompt": prompt}, "completion")
    assert ids is prompt
    assert packed == (packed_u32(prompt) if native_hashing() else None)
    for other in ([0, 2**32], "text"):
        ids, packed = await tok.prompt_ids_packed({"model": "m", "prompt": other}, "completion")
        assert ids is not None and packed is None  # the earlier packing is not handed on
