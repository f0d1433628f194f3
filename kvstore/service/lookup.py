"""A prefix lookup's body: bounded while it streams, then parsed and hashed a slice at a time.

A lookup may name millions of token ids. Parsing them in one call holds the GIL throughout,
and the event loop waits on a worker thread that holds the GIL as surely as on work done on
the loop. So the body is refused (413) as soon as its length or its commas show more items
than max_lookup_tokens allows; then, on a worker thread, a flat `token_ids` or `chunk_hashes`
list is cut out of the JSON and validated ~256K characters at a time, and token ids are hashed
a slice at a time. No step holds the GIL long, so /healthz and other requests keep being
answered. A body whose lists cannot be cut out safely (nested, escaped, unusual) is parsed
whole, as bounded as ever.

The models parse strictly (no "1" for 1, no unknown fields), so the served schema (lookup_schemas)
states exactly what is accepted.
"""

from __future__ import annotations

from json.decoder import WHITESPACE, JSONDecoder, scanstring
from typing import Annotated

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, TypeAdapter, ValidationError, WithJsonSchema,
    model_validator,
)

from kvstore.service.guard import CLOSE
from kvstore.service.settings import TooLarge
from tiers.keys import ChunkKeys, chain_hashes
from tiers.remote.wire import WireError

MAX_CHUNKS = 1 << 20
# A lookup body may take this many bytes per item it is allowed (a chunk hash written with ", " takes 36,
# a token id below 2**62 at most 21), and hold this many commas outside its list (between fields, and
# in model_id's 256 characters at most).
_BYTES_PER_ITEM, _ENVELOPE_BYTES, _ENVELOPE_COMMAS = 40, 64 << 10, 1024
_SLICE_CHARS, _SLICE_TOKENS = 256 << 10, 64 << 10  # per GIL hold: JSON validated, token ids numpy converts

_STRICT = ConfigDict(extra="forbid", strict=True)
ChunkHash = Annotated[str, Field(pattern="^[0-9a-f]{32}$")]
# JSON Schema's integer takes 3.0 as 3, strict pydantic ints do not: an integral float is taken too (still
# no "3" or true). Token ids stay as parsed (numpy hashes 3.0 as 3); a Dim becomes an int.
TokenId = Annotated[
    Annotated[StrictInt, Field(ge=0, lt=1 << 62)] | Annotated[StrictFloat, Field(ge=0, lt=1 << 62, multiple_of=1)],
    Field(union_mode="left_to_right"), WithJsonSchema({"type": "integer", "minimum": 0, "exclusiveMaximum": 1 << 62})]
Dim = Annotated[
    Annotated[StrictInt, Field(ge=1, le=1 << 20)] | Annotated[StrictFloat, Field(ge=1, le=1 << 20, multiple_of=1)],
    Field(union_mode="left_to_right"), AfterValidator(int),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": 1 << 20})]


class ModelIdentity(BaseModel):
    """What the chain's root hash is made of: one model's keys never name another's chunks."""

    model_config = _STRICT
    model_id: str = Field(min_length=1, max_length=256)
    num_layers: Dim
    num_q_heads: Dim
    num_kv_heads: Dim
    head_dim: Dim


# The schema's statement of LookupRequest._one_form().
_ONE_FORM = {"oneOf": [
    {"required": ["token_ids", "model"], "properties": {
        "token_ids": {"type": "array"}, "model": {"type": "object"}, "chunk_hashes": {"type": "null"}}},
    {"required": ["chunk_hashes"], "properties": {"chunk_hashes": {"type": "array"}, "token_ids": {"type": "null"}}},
]}


class LookupRequest(BaseModel):
    """A prompt as token ids with the model they are hashed under, or as its chunk hashes; the lists'
    lengths are bounded by the server's max_lookup_tokens."""

    model_config = ConfigDict(**_STRICT, json_schema_extra=_ONE_FORM)
    block_tokens: Dim = Field(description="tokens per chunk")
    token_ids: list[TokenId] | None = Field(None, description="the prompt; needs `model`")
    model: ModelIdentity | None = None
    chunk_hashes: list[ChunkHash] | None = Field(
        None, description="the prompt's chunk hashes, in order (instead of token_ids)")

    @model_validator(mode="after")
    def _one_form(self) -> LookupRequest:
        if (self.token_ids is None) == (self.chunk_hashes is None):
            raise ValueError("a lookup needs exactly one of token_ids (with model) or chunk_hashes")
        if self.token_ids is not None and self.model is None:
            raise ValueError("token_ids need the model identity they were hashed under: "
                             "model = {model_id, num_layers, num_q_heads, num_kv_heads, head_dim}")
        return self

    def hashes(self, slice_tokens: int = _SLICE_TOKENS) -> list[str]:
        """The prompt's chunk hashes; token ids are hashed (tiers/keys.py) a slice at a time."""
        if self.chunk_hashes is not None:
            return self.chunk_hashes
        keys = ChunkKeys(**self.model.model_dump(), block_tokens=self.block_tokens)
        parent, hashes = keys.root, []
        step = keys.block_tokens * max(1, slice_tokens // keys.block_tokens)  # whole blocks per slice
        for start in range(0, len(self.token_ids), step):
            chain = chain_hashes(parent, self.token_ids[start: start + step], keys.block_tokens)
            parent = chain[-1] if chain else parent
            hashes += [h.hex() for h in chain]
        return hashes


_REQUEST = TypeAdapter(LookupRequest)
_LISTS = {"token_ids": TypeAdapter(list[TokenId]), "chunk_hashes": TypeAdapter(list[ChunkHash])}


def lookup_schemas(max_tokens: int) -> dict[str, dict]:
    """LookupRequest and ModelIdentity as the served schema states them, with this server's list limits."""
    schema = LookupRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs")
    schema["properties"]["token_ids"]["anyOf"][0]["maxItems"] = max_tokens
    schema["properties"]["chunk_hashes"]["anyOf"][0]["maxItems"] = min(MAX_CHUNKS, max_tokens)
    return {"LookupRequest": schema, **defs}


async def read_lookup(request: Request, max_tokens: int) -> list[bytes]:
    """The body's pieces, refused (413, connection closed) as soon as its length or its commas show more
    than max_tokens items: a JSON list of n items holds n - 1 commas, so counting them as the bytes
    arrive bounds the parse before it starts."""
    max_bytes, max_commas = _BYTES_PER_ITEM * max_tokens + _ENVELOPE_BYTES, max_tokens + _ENVELOPE_COMMAS
    too_many = f"a lookup names at most {max_tokens} token ids or chunk hashes (max_lookup_tokens)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"{too_many}; a body of {declared} bytes names more", headers=CLOSE)
    pieces, size, commas = [], 0, 0
    async for piece in request.stream():
        size, commas = size + len(piece), commas + piece.count(b",")
        if size > max_bytes or commas > max_commas:
            raise HTTPException(413, f"{too_many}; this body names more", headers=CLOSE)
        pieces.append(piece)
    return pieces


def parse_lookup(pieces: list[bytes], max_tokens: int, slice_chars: int = _SLICE_CHARS) -> LookupRequest:
    """The lookup a body names: RequestValidationError (400) unless valid, TooLarge (413) past the limits."""
    try:
        text = b"".join(pieces).decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"a lookup body is JSON in UTF-8; byte {exc.start} is not UTF-8") from None
    spans = _flat_lists(text)
    if spans is None:
        body = _validated(_REQUEST, text, ())
    else:  # the envelope with each list emptied, then the lists a slice at a time
        cuts = sorted(spans.values())
        ends, starts = [0] + [end for _, end in cuts], [start for start, _ in cuts] + [len(text)]
        body = _validated(_REQUEST, "".join(text[a:b] for a, b in zip(ends, starts)), ())
        body = body.model_copy(update={name: _items(name, text, *span, slice_chars) for name, span in spans.items()})
    num_items = len(body.token_ids if body.token_ids is not None else body.chunk_hashes)
    if num_items > (max_tokens if body.token_ids is not None else min(MAX_CHUNKS, max_tokens)):
        raise TooLarge(f"a lookup names at most {max_tokens} token ids or {min(MAX_CHUNKS, max_tokens)} chunk "
                       f"hashes (max_lookup_tokens); this one names {num_items}")
    return body


def _validated(adapter, text: str, where: tuple, first: int = 0):
    """adapter's validate_json(text); errors become a 400 naming their place in the body (list items from `first`)."""
    try:
        return adapter.validate_json(text)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *where, *(
            (e["loc"][0] + first, *e["loc"][1:]) if e["loc"] and isinstance(e["loc"][0], int) else e["loc"]))}
            for e in errors]) from None


def _items(name: str, text: str, start: int, end: int, slice_chars: int) -> list:
    """The list text[start:end] (between its brackets) holds, validated a slice of ~slice_chars at a time.
    A cut falls on a comma; one inside a string leaves both slices unterminated, so invalid."""
    items: list = []
    after_comma = False
    while True:
        cut = text.find(",", min(start + slice_chars, end), end)
        piece = text[start: end if cut < 0 else cut]
        if after_comma and not piece.strip():  # "[1, 2,]": a slice ends at the last comma, nothing follows it
            raise RequestValidationError([{"loc": ("body", name), "msg": "Invalid JSON: trailing comma",
                                           "type": "json_invalid"}])
        items += _validated(_LISTS[name], f"[{piece}]", (name,), len(items))
        if cut < 0:
            return items
        start, after_comma = cut + 1, True


def _flat_lists(text: str) -> dict[str, tuple[int, int]] | None:
    """Where the top-level token_ids / chunk_hashes lists' items lie in `text`, for lists that can be cut out
    safely: no nested list or object, no escapes, whole strings. None when the body is not such an object."""
    spans, decoder, i = {}, JSONDecoder(), WHITESPACE.match(text).end()
    if not text.startswith("{", i):
        return None
    i = WHITESPACE.match(text, i + 1).end()
    try:
        while text.startswith('"', i):
            key, i = scanstring(text, i + 1)
            i = WHITESPACE.match(text, i).end()
            if not text.startswith(":", i):
                return None
            i = WHITESPACE.match(text, i + 1).end()
            if key in _LISTS and text.startswith("[", i) and _is_flat(text, i + 1, close := text.find("]", i)):
                spans[key], i = (i + 1, close), close + 1
            else:
                spans.pop(key, None)  # a later value replaces an earlier one, as in the whole parse
                i = decoder.raw_decode(text, i)[1]
            i = WHITESPACE.match(text, i).end()
            if not text.startswith(",", i):
                break
            i = WHITESPACE.match(text, i + 1).end()
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    return spans if text.startswith("}", i) and WHITESPACE.match(text, i + 1).end() == len(text) else None


def _is_flat(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] can only be the inside of a list of scalars: with no nesting and no escapes,
    an even count of quotes means the ']' at `end` is outside every string."""
    return end >= 0 and all(text.find(c, start, end) < 0 for c in '[{\\') and text.count('"', start, end) % 2 == 0
