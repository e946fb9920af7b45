"""Packed documents for the language model: ``cu_seqlens``, and Hugging Face flattening's ``position_ids``.

Pretraining without padding concatenates documents into one row.  flash-linear-attention's models take
the document offsets as ``cu_seqlens`` (``[N + 1]``, ``B = 1``); Hugging Face's
``DataCollatorWithFlattening`` writes ``position_ids`` that restart at 0 at every document
(``[[0, 1, 2, 0, 1]]`` for documents of 3 and 2 tokens), and with ``return_flash_attn_kwargs=True`` also
``cu_seq_lens_q``/``cu_seq_lens_k``.  :func:`resolve_packing` turns any of these into one ``cu_seqlens``
over the row-major flattened tokens, so every mixer starts each document from its own state::

    position_ids [B, T]  →  every row a run of documents: flattened to one packed row, offsets of all of them
                             (a row's start is a document start)
    position_ids counting up by 1 in every row (what ``generate()`` and plain batches pass): nothing packed

Nothing is ignored: ``position_ids`` that neither count up by 1 nor restart at 0 are refused, as are
offsets that disagree with them, packing with padding, and packing that would continue a cache.
Reading ``position_ids`` is one host read per call (none for a single token, as in decoding), so under
``torch.compile`` pass ``cu_seqlens`` instead.
"""

from __future__ import annotations

import torch

from ..ops.utils.validation import can_read_values, check_cu_seqlens

# what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds besides position_ids
FLASH_ATTENTION_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def take_flash_attention_kwargs(kwargs: dict, cu_seqlens):
    """Remove flash-attention's packing keywords from ``kwargs`` and return the ``cu_seqlens`` they give
    (``cu_seq_lens_q`` must equal ``cu_seq_lens_k``: one causal model reads one layout)."""
    given = {name: kwargs.pop(name) for name in FLASH_ATTENTION_KWARGS if name in kwargs}
    cu_q, cu_k = given.get("cu_seq_lens_q"), given.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return cu_seqlens
    if cu_q is None or cu_k is None or not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor) \
            or cu_q.shape != cu_k.shape or not bool(torch.equal(cu_q, cu_k)):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be the same offsets tensor (a causal language "
                         "model packs queries and keys alike)")
    if cu_seqlens is not None and (cu_seqlens.shape != cu_q.shape or not bool(torch.equal(cu_seqlens.cpu().long(),
                                                                                         cu_q.cpu().long()))):
        raise ValueError("cu_seqlens and cu_seq_lens_q give different document offsets; pass one of them")
    return cu_q if cu_seqlens is None else cu_seqlens


def flattening_offsets(position_ids, batch: int, length: int, valid: torch.Tensor | None) -> torch.Tensor | None:
    """The document offsets over the flattened ``[batch · length]`` tokens that ``position_ids`` mark by
    restarting at 0, or None when every row counts up by 1 (nothing packed).

    ``valid`` (``[B, T]`` bool, None = all) marks real tokens; padding positions are not read.  Refuses
    ``position_ids`` that are not integer ``[B, T]`` (or ``[1, T]``), and any real token whose position
    neither continues the previous real token's (+1) nor restarts at 0.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"position_ids must be an integer (int64/int32) tensor [B, T], got "
                        f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be [B, T] = [{batch}, {length}] (or [1, {length}]), got "
                         f"{tuple(position_ids.shape)}")
    if length == 1:
        return None  # one token (a decoding step): nothing to pack, nothing to read
    if not can_read_values():
        raise ValueError("position_ids are read on the host to find the documents they pack, which torch.compile "
                         "and torch.func transforms cannot do: pass cu_seqlens (the document offsets) instead")
    pos = position_ids.expand(batch, length).long()
    valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
    index = torch.arange(length, device=pos.device).expand(batch, length)
    # the latest real token before each token (-1: none), as generate() leaves padding in front
    latest = torch.cummax(torch.where(valid, index, -1), dim=1).values
    previous = torch.cat((latest.new_full((batch, 1), -1), latest[:, :-1]), dim=1)
    has_previous = valid & (previous >= 0)
    prev_pos = pos.gather(1, previous.clamp_min(0))
    restart = has_previous & (pos == 0) & (pos != prev_pos + 1)
    bad = has_previous & (pos != prev_pos + 1) & (pos != 0)
    n_bad, n_restart = torch.stack((bad.sum(), restart.sum())).tolist()
    if n_bad:
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"position_ids must count up by 1 within a document and restart at 0 where a new one "
                         f"starts (as DataCollatorWithFlattening writes them); row {b} goes from "
                         f"{int(prev_pos[b, t])} to {int(pos[b, t])} at token {t}")
    if not n_restart:
        return None
    if not bool(valid.all()):
        raise ValueError("position_ids restart at 0 (packed documents) but attention_mask marks padding: pack "
                         "documents without padding, or pad without restarting positions")
    starts = restart.clone()
    starts[:, 0] = True  # every row starts a document
    offsets = starts.flatten().nonzero()[:, 0]
    return torch.cat((offsets, offsets.new_tensor([batch * length])))


def resolve_packing(cu_seqlens, position_ids, *, batch: int, length: int, device: torch.device,
                    valid: torch.Tensor | None, continuing: bool) -> torch.Tensor | None:
    """One ``cu_seqlens`` (int64, over the flattened ``[batch · length]`` tokens) from the model's arguments,
    or None when nothing is packed (module docstring).  ``continuing``: a cache with tokens in it was passed."""
    cu = None
    if cu_seqlens is not None:
        if valid is not None and not bool(valid.all()):
            raise ValueError("pass attention_mask or cu_seqlens, not both: packed sequences (cu_seqlens) have no "
                             "padding to mask")
        cu = check_cu_seqlens(cu_seqlens, batch, length, device)
    if position_ids is not None:
        from_positions = flattening_offsets(position_ids, batch, length, valid)
        if cu is not None and can_read_values():
            implied = from_positions if from_positions is not None else cu.new_tensor([0, batch * length])
            if implied.shape != cu.shape or not bool(torch.equal(implied, cu)):
                raise ValueError(f"position_ids mark documents at {implied.tolist()} but cu_seqlens gives "
                                 f"{cu.tolist()}; pass one of them, or both in agreement")
        cu = cu if cu is not None else from_positions
    if cu is not None and continuing:
        raise ValueError("packed documents (cu_seqlens, or position_ids restarting at 0) start from the prior: "
                         "they cannot continue a cache that already holds tokens")
    return cu


def document_starts(cu: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``[batch, length]`` bool: True at the first token of every packed document (no gather on the host)."""
    starts = torch.zeros(batch * length + 1, dtype=torch.bool, device=cu.device)
    starts = starts.index_fill(0, cu[:-1], True)[:-1]
    return starts.view(batch, length)
