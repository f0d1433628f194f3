"""The masks kvtier attention applies for transformers: causal within each batch row, over the row's own tokens.

A KVTierCache holds one store sequence per batch row, and the store attends every position a sequence holds.
A row's padding is therefore never stored, and the store cannot leave out a position it holds: the masks it
applies exactly are causal attention over each row's tokens, with the row's padding before its first token
(left padding, as generate() needs: it predicts each row's next token from the last column). transformers
derives position_ids from a 2-D mask (cumsum), so a row's tokens get the positions they have alone.

- kvtier_mask, transformers' mask builder for "kvtier", runs once per forward before any layer: it refuses
  other mask patterns (sliding window, packed sequences, overlays) and 2-D masks with zeros after a row's first
  token (right padding, zeros between tokens), and hands the checked 2-D mask [B, positions] to the attention.
- real_queries, in the attention before a layer's K/V go into the store: which of this step's queries are a
  row's tokens, checked against what the cache holds (its earlier columns: each row's padding, then its held
  tokens). A 4-D mask the caller built arrives as-is; it is accepted when it allows exactly what the cache
  attends: per row, each token sees the row's tokens up to itself, and a pad query sees nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SUPPORTED_MASKS = ("no mask, a 2-D attention_mask with zeros only before each row's first token (left padding), "
                   "or a 4-D mask that allows exactly what the cache attends (each row's tokens, causally)")
CHECKED_ATTRIBUTE = "kvtier_checked"  # set by real_queries on a mask: (cache state, its answer)


def kvtier_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor | None:
    """transformers' mask builder for "kvtier": None without a mask, else the checked 2-D mask [B, kv_length] bool
    (True: a token) for kvtier attention, which applies it itself; refuses what the store cannot apply."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not causal_mask_function:
        raise ValueError(f"kvtier attention applies a causal mask within each row only ({SUPPORTED_MASKS}); the model "
                         f"asked for the mask pattern {getattr(mask_function, '__qualname__', mask_function)!r} "
                         "(a sliding window, packed sequences or an overlay)")
    if attention_mask is None:
        return None
    mask = attention_mask.bool()  # [B, positions]
    if tuple(mask.shape) != (batch_size, kv_length):
        raise ValueError(f"a 2-D attention_mask covers the {kv_length - q_length} positions the cache holds and this "
                         f"step's {q_length}, for each of the {batch_size} rows: expected [{batch_size}, {kv_length}], "
                         f"got {list(mask.shape)}")
    check_left_padded(mask)
    return mask


def check_left_padded(columns: torch.Tensor) -> None:
    """columns [B, positions] bool (True: a token of the row): ValueError unless every zero of a row lies before
    its first token."""
    holes = (columns.long().cumsum(1) > 0) & ~columns  # zeros after the row's first token
    if not bool(holes.any()):
        return
    row = int(holes.any(1).nonzero()[0])
    zeros = holes[row].nonzero()[:, 0].tolist()
    shown = f"{zeros[:8]}{' ...' if len(zeros) > 8 else ''}"
    if not bool(columns[row, zeros[0]:].any()):  # nothing after the zeros: padding on the right
        raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS}; row {row} of the mask has {len(zeros)} zeros "
                         f"after its tokens (right padding) at positions {shown}: generate() would predict that "
                         "row's next token from a pad. Pad on the left (tokenizer.padding_side = 'left')")
    raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS}; row {row} of the mask has {len(zeros)} zeros "
                     f"between its tokens at positions {shown}: the store holds a row's tokens in order and attends "
                     "every one of them, so it cannot leave a position out in mid-sequence")


def real_queries(mask: object, held: list[int], num_columns: int, num_queries: int) -> torch.Tensor | None:
    """Which of this step's num_queries queries are tokens of their row: [B, T] bool, or None when all are.

    mask: what kvtier attention got (None, kvtier_mask's 2-D mask, or the caller's 4-D mask); held: the tokens
    each row's sequence holds (B = len(held)); num_columns: the positions the cache was given before this step,
    padding included (the last held[b] of them are row b's tokens). ValueError for a mask the cache cannot apply.
    Every layer of a step gets the same mask and cache state: the answer is kept on the mask, so the check (and
    its host sync) runs once per step, not per layer."""
    if not isinstance(mask, torch.Tensor):
        return _real_queries(mask, held, num_columns, num_queries)
    state = (tuple(held), num_columns, num_queries)
    checked = getattr(mask, CHECKED_ATTRIBUTE, None)
    if checked is None or checked[0] != state:
        checked = (state, _real_queries(mask, held, num_columns, num_queries))
        setattr(mask, CHECKED_ATTRIBUTE, checked)
    return checked[1]


def _real_queries(mask: object, held: list[int], num_columns: int, num_queries: int) -> torch.Tensor | None:
    if mask is None:
        padded = [row for row, n in enumerate(held) if n != num_columns]
        if padded:
            raise ValueError(f"rows {padded} of the cache hold padding (positions left out of their sequences); "
                             "pass the 2-D attention_mask of every position the cache was given, as generate() does")
        return None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool:  # kvtier_mask's, checked
        columns = mask
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        columns = _columns_of_4d(mask, held, num_columns, num_queries)
    else:
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS}; got a {shape} attention mask")
    if tuple(columns.shape) != (len(held), num_columns + num_queries):
        raise ValueError(f"the cache holds {len(held)} rows of {num_columns} positions and this step brings "
                         f"{num_queries}: expected a mask over [{len(held)}, {num_columns + num_queries}], got "
                         f"{list(columns.shape)}")
    past = columns[:, :num_columns].sum(1).tolist()
    if past != held:
        raise ValueError(f"the attention_mask marks {past} tokens per row in the {num_columns} positions the cache "
                         f"was given, but the rows hold {held}: pass the mask those positions came with")
    real = columns[:, num_columns:]
    return None if bool(real.all()) else real


def _columns_of_4d(mask: torch.Tensor, held: list[int], num_columns: int, num_queries: int) -> torch.Tensor:
    """The caller's 4-D mask [1 or B, heads, T, C + T] -> its rows' tokens [B, C + T] bool, when it allows exactly
    what the cache attends: the earlier positions as the cache holds them, this step's tokens from the diagonal
    (a query that sees itself is a token, a pad sees nothing); else ValueError."""
    num_rows, num_keys = len(held), num_columns + num_queries
    allowed = _allowed(mask) if mask.shape[0] in (1, num_rows) and tuple(mask.shape[-2:]) == (
        num_queries, num_keys) else None
    if allowed is not None:
        t = torch.arange(num_queries, device=mask.device)
        diagonal = allowed[:, 0, t, num_columns + t].expand(num_rows, num_queries)  # [B, T]
        first = num_columns - torch.tensor(held, device=mask.device)  # each row's first held position
        past = torch.arange(num_columns, device=mask.device)[None] >= first[:, None]  # [B, C]
        columns = torch.cat([past, diagonal], 1)  # [B, C + T]
        check_left_padded(columns)
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=mask.device).tril(num_columns)
        expected = causal[None] & columns[:, None, :] & columns[:, num_columns:, None]  # [B, T, C + T]
        if bool((allowed == expected[:, None]).all()):
            return columns
    raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS} over the {num_keys} positions the cache holds "
                     f"with this step's {num_queries}; got a {list(mask.shape)} attention mask that allows other "
                     "positions (a custom pattern or a soft bias)")


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """A 4-D mask's allowed positions (bool), or None when it holds values other than allow / block."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    allowed = mask == 0  # additive: 0 attends, -inf or the dtype's minimum blocks
    blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return allowed if bool((allowed | blocked).all()) else None
