"""The lookup body parsed a slice at a time against one parse of the whole body: the same lookups,
the same refusals, the same chunk hashes, over random and mangled bodies."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvstore.service.lookup import LookupRequest, parse_lookup
from kvstore.service.settings import TooLarge
from tiers.keys import ChunkKeys

MODEL = {"model_id": "m,[x]", "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8}


def random_body(rng: random.Random) -> str:
    fields = [("block_tokens", rng.choice([1, 3, 16]))]
    if rng.random() < 0.6:
        fields += [("token_ids", [rng.randrange(1 << rng.choice([4, 20, 62])) for _ in range(rng.randrange(60))]),
                   ("model", MODEL)]
    else:
        fields += [("chunk_hashes", [f"{rng.getrandbits(128):032x}" for _ in range(rng.randrange(12))])]
    if rng.random() < 0.3:  # the other form's list, given as null
        fields.append(("chunk_hashes" if fields[1][0] == "token_ids" else "token_ids", None))
    rng.shuffle(fields)
    for _ in range(rng.choice([0, 0, 1, 2])):  # a repeated key, before or after the other: the last one counts
        value = rng.choice([None, [rng.randrange(9) for _ in range(5)], [[1]]])
        fields.insert(rng.randrange(len(fields) + 1), (rng.choice(["token_ids", "chunk_hashes"]), value))
    comma, colon = rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :\t")])
    members = (f"{json.dumps(k)}{colon}{json.dumps(v, separators=(comma, colon))}" for k, v in fields)
    return "{" + comma.join(members) + "}"


def mangled(rng: random.Random, text: str) -> str:
    at = rng.randrange(len(text))
    if rng.random() < 0.5:
        return text[:at] + text[at + 1:]
    return text[:at] + rng.choice(',[]{}"\\ 0a.-e') + text[at:]


def whole(text: str) -> dict | None:
    try:
        return LookupRequest.model_validate_json(text).model_dump()
    except ValidationError:
        return None


def sliced(text: str, slice_chars: int) -> dict | None:
    try:
        return parse_lookup([text.encode()], max_tokens=1 << 20, slice_chars=slice_chars).model_dump()
    except RequestValidationError:
        return None


@pytest.mark.parametrize("slice_chars", [1, 7, 64, 1 << 18])
def test_slices_parse_exactly_what_the_whole_body_parses(slice_chars):
    rng = random.Random(slice_chars)
    num_valid = 0
    for _ in range(1500):
        text = random_body(rng)
        if rng.random() < 0.5:
            text = mangled(rng, text)
        expected = whole(text)
        assert sliced(text, slice_chars) == expected, text
        num_valid += expected is not None
    assert num_valid > 500  # mangled bodies are mostly refused; every valid one was compared


def test_a_trailing_comma_at_a_slice_boundary_is_refused():
    text = '{"block_tokens": 1, "chunk_hashes": ["' + "a" * 32 + '", ]}'
    with pytest.raises(RequestValidationError, match="trailing comma"):
        parse_lookup([text.encode()], max_tokens=100, slice_chars=36)


def test_too_many_items_are_413_and_each_limit_is_exact():
    ids = list(range(100))
    body = json.dumps({"block_tokens": 16, "token_ids": ids, "model": MODEL}).encode()
    assert parse_lookup([body], max_tokens=100, slice_chars=16).token_ids == ids
    with pytest.raises(TooLarge, match="at most 99 token ids"):
        parse_lookup([body], max_tokens=99, slice_chars=16)


@pytest.mark.parametrize("block_tokens", [1, 3, 16, 64])
def test_hashing_a_slice_at_a_time_is_the_chain_of_the_whole_prompt(block_tokens):
    rng = random.Random(block_tokens)
    keys = ChunkKeys(**MODEL, block_tokens=block_tokens)
    for num_tokens in (0, block_tokens - 1, block_tokens, 5 * block_tokens + 2, 999):
        ids = [rng.randrange(1 << 40) for _ in range(num_tokens)]
        body = LookupRequest(block_tokens=block_tokens, token_ids=ids, model=MODEL)
        for slice_tokens in (1, 10, 100, 1 << 16):
            assert body.hashes(slice_tokens) == keys.hashes(ids), (num_tokens, slice_tokens)
