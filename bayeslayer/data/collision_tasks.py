"""Generators of the learned collision studies (docs/theory.md §8.2 recall, §8.3 crowding).

Both tasks use one token layout: a WRITE/QUERY marker, a unit address and a
one-hot value::

    x[..., 0]                          marker: +1 WRITE, −1 QUERY
    x[..., 1 : 1 + D]                  address (unit vector; the model's key and query)
    x[..., 1 + D : 1 + D + V]          value label, one-hot on WRITE tokens, zero on QUERY tokens
    labels                             the value label on QUERY tokens, −100 (no loss) elsewhere

Each generator is a single vectorised function of a ``torch.Generator``: the same
generator state gives the same batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_int

IGNORE_INDEX = -100
WRITE, QUERY = 1.0, -1.0


class CollisionBatch(NamedTuple):
    """``inputs [B, T, 1 + D + V]`` (float32), ``labels [B, T]`` (long, −100 = no loss),
    ``distractor_labels [B, T]`` (recall: the value of the queried target's distractor on
    QUERY tokens, −100 elsewhere; crowding: all −100)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    distractor_labels: torch.Tensor



def _check_generator(generator) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return generator


def _shuffle_rows(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Independently permute each row of ``x [B, N]``."""
    order = torch.rand(x.shape, generator=generator).argsort(dim=1)
    return torch.gather(x, 1, order)


def _tokens(marker, address, value_label, num_values) -> torch.Tensor:
    """Assemble features; ``value_label`` −1 means no value (QUERY)."""
    onehot = torch.zeros(*value_label.shape, num_values)
    has = value_label >= 0
    onehot[has] = torch.nn.functional.one_hot(value_label[has], num_values).float()
    return torch.cat([marker.unsqueeze(-1), address, onehot], dim=-1)


def collision_recall_batch(
    batch_size: int,
    *,
    n_f: int,
    rho,
    generator: torch.Generator,
    n_b: int = 4,
    num_pairs: int = 8,
    address_dim: int = 16,
) -> CollisionBatch:
    """Controlled collision recall: targets written ``n_b`` times, then colliding distractors ``n_f`` times.

    Per sequence: a random orthonormal basis ``{e_1..e_D}`` of R^D; pair ``p``
    has target address ``a_p = e_{2p}`` and distractor address
    ``d_p = ρ e_{2p} + √(1−ρ²) e_{2p+1}`` (so ``a_pᵀ d_p = ρ`` exactly and pairs are
    mutually orthogonal). The ``2P`` addresses get the value labels of a fresh random
    permutation of ``0..2P−1`` (target ``p``: ``perm[p]``, distractor ``p``: ``perm[P+p]``).
    Layout, ``T = P·n_b + P·n_f + P``::

        [P·n_b target WRITEs, shuffled] [P·n_f distractor WRITEs, shuffled] [P target QUERYs, shuffled]

    Loss only on the QUERY tokens (label: the target's value); ``distractor_labels``
    holds the distractor's value there (for the target-vs-distractor margin).

    Args:
        batch_size: ``B``.
        n_f: distractor writes per pair (≥ 0).
        rho: overlap ``ρ ∈ [0, 1)``: a float, or a tensor ``[B]`` (one per sequence).
        generator: the source of randomness.
        n_b: target writes per pair (≥ 1).  num_pairs: ``P`` (``2P ≤ D``).  address_dim: ``D``.

    Returns:
        :class:`CollisionBatch` with inputs ``[B, T, 1 + D + 2P]`` (33 features for D = 16, P = 8).

    Example (``P = 1``, ``D = 2``, ``n_b = 2``, ``n_f = 1``, ρ = 0.8, basis ``e_1, e_2``, ``perm = [1, 0]``)::

        t  marker  address      value   label
        0  WRITE   e_1          1       -100     target written n_b = 2 times
        1  WRITE   e_1          1       -100
        2  WRITE   .8e_1+.6e_2  0       -100     distractor written n_f = 1 time
        3  QUERY   e_1          (none)  1        query the target; distractor_labels[3] = 0
    """
    B = check_int("batch_size", batch_size, minimum=1)
    n_f = check_int("n_f", n_f, minimum=0)
    n_b = check_int("n_b", n_b, minimum=1)
    P = check_int("num_pairs", num_pairs, minimum=1)
    D = check_int("address_dim", address_dim, minimum=2)
    g = _check_generator(generator)
    if 2 * P > D:
        raise ValueError(f"num_pairs={P} needs 2·num_pairs <= address_dim, got address_dim={D}")
    rho_t = torch.as_tensor(rho, dtype=torch.float32)
    if rho_t.dim() == 0:
        rho_t = rho_t.expand(B)
    if rho_t.shape != (B,):
        raise ValueError(f"rho must be a float or a tensor of shape [B] = ({B},), got {tuple(rho_t.shape)}")
    if not bool(((rho_t >= 0) & (rho_t < 1)).all()):
        raise ValueError(f"rho must lie in [0, 1), got values in [{rho_t.min():.3g}, {rho_t.max():.3g}]")

    # Random orthonormal basis per sequence (QR of a Gaussian, sign-fixed to be Haar).
    Qm, R = torch.linalg.qr(torch.randn(B, D, D, generator=g, dtype=torch.float64))
    basis = (Qm * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)).transpose(1, 2).float()
    r = rho_t[:, None, None]
    targets = basis[:, 0 : 2 * P : 2]  # [B, P, D]
    distractors = r * targets + torch.sqrt(1 - r * r) * basis[:, 1 : 2 * P : 2]
    perm = torch.rand(B, 2 * P, generator=g).argsort(dim=1)  # value label of each address

    pairs = torch.arange(P)
    tgt_ev = _shuffle_rows(pairs.repeat(n_b).expand(B, -1), g)  # [B, P·n_b]
    dis_ev = _shuffle_rows(pairs.repeat(n_f).expand(B, -1), g)  # [B, P·n_f]
    qry_ev = _shuffle_rows(pairs.expand(B, -1), g)  # [B, P]
    bidx = torch.arange(B)[:, None]

    def gather(addr, ev):
        return addr[bidx, ev]

    address = torch.cat([gather(targets, tgt_ev), gather(distractors, dis_ev), gather(targets, qry_ev)], 1)
    value = torch.cat([perm[bidx, tgt_ev], perm[bidx, P + dis_ev], torch.full((B, P), -1)], 1)
    T = address.shape[1]
    marker = torch.full((B, T), WRITE)
    marker[:, -P:] = QUERY
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    labels[:, -P:] = perm[bidx, qry_ev]
    dlabels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    dlabels[:, -P:] = perm[bidx, P + qry_ev]
    return CollisionBatch(_tokens(marker, address, value, 2 * P), labels, dlabels)


def crowding_projection(address_dim: int = 16, source_dim: int = 64, seed: int = 0) -> torch.Tensor:
    """The frozen row-orthogonal projection ``W [address_dim, source_dim]`` (``W Wᵀ = I``), fixed by ``seed``.

    Every model and every run of an experiment uses the same ``W`` (same seed).
    """
    d = check_int("address_dim", address_dim, minimum=1)
    s = check_int("source_dim", source_dim, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if d > s:
        raise ValueError(f"address_dim ({d}) must be <= source_dim ({s}) for orthonormal rows")
    g = torch.Generator().manual_seed(seed)
    Qm, R = torch.linalg.qr(torch.randn(s, d, generator=g, dtype=torch.float64))
    Qm = Qm * torch.sign(torch.diagonal(R)).unsqueeze(0)
    return Qm.T.contiguous().float()


def crowding_batch(
    batch_size: int,
    *,
    n: int,
    projection: torch.Tensor,
    generator: torch.Generator,
    num_queries: int = 8,
    num_values: int = 64,
) -> CollisionBatch:
    """Random-key crowding: write ``n`` random associations, then query ``num_queries`` of them.

    Address ``i``: ``a_i = W z_i / ‖W z_i‖`` with ``z_i ~ N(0, I_S)`` and ``W = projection``
    (``[D, S]``, row-orthogonal; :func:`crowding_projection`). Value ``i``: a label drawn
    uniformly from ``num_values`` (labels may repeat). Layout, ``T = n + num_queries``::

        [n WRITEs (a_i, value_i)] [num_queries QUERYs of distinct written addresses, random order]

    Loss only on the QUERY tokens (label: the value written at that address).

    Returns:
        :class:`CollisionBatch` with inputs ``[B, T, 1 + D + num_values]`` (81 for D = 16, 64 values).

    Example (``n = 3``, ``num_queries = 2``, drawn addresses ``a_0, a_1, a_2``, values ``5, 9, 5``,
    queried ``2`` then ``0``)::

        t  marker  address  value   label
        0  WRITE   a_0      5       -100
        1  WRITE   a_1      9       -100
        2  WRITE   a_2      5       -100
        3  QUERY   a_2      (none)  5
        4  QUERY   a_0      (none)  5
    """
    B = check_int("batch_size", batch_size, minimum=1)
    n = check_int("n", n, minimum=1)
    nq = check_int("num_queries", num_queries, minimum=1)
    V = check_int("num_values", num_values, minimum=1)
    g = _check_generator(generator)
    if not isinstance(projection, torch.Tensor) or projection.dim() != 2:
        got = getattr(projection, "shape", projection)
        raise ValueError(f"projection must be a 2-D tensor [D, S], got {got}")
    D, S = projection.shape
    if nq > n:
        raise ValueError(f"num_queries={nq} distinct queries need at least that many writes, got n={n}")
    gram = projection.double() @ projection.double().T
    if not torch.allclose(gram, torch.eye(D, dtype=torch.float64), atol=1e-5):
        raise ValueError("projection rows must be orthonormal (W Wᵀ = I); use crowding_projection()")

    z = torch.randn(B, n, S, generator=g)
    keys = z @ projection.T
    keys = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    values = torch.randint(0, V, (B, n), generator=g)
    asked = torch.rand(B, n, generator=g).argsort(dim=1)[:, :nq]  # distinct written slots
    bidx = torch.arange(B)[:, None]
    address = torch.cat([keys, keys[bidx, asked]], dim=1)
    value = torch.cat([values, torch.full((B, nq), -1)], dim=1)
    T = n + nq
    marker = torch.full((B, T), WRITE)
    marker[:, n:] = QUERY
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    labels[:, n:] = values[bidx, asked]
    dlabels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    return CollisionBatch(_tokens(marker, address, value, V), labels, dlabels)


def recall_sequence_length(n_f: int, n_b: int = 4, num_pairs: int = 8) -> int:
    """``T = P·(n_b + n_f + 1)`` of :func:`collision_recall_batch`."""
    return num_pairs * (n_b + n_f + 1)


__all__ = [
    "CollisionBatch", "IGNORE_INDEX", "QUERY", "WRITE", "collision_recall_batch", "crowding_batch",
    "crowding_projection", "recall_sequence_length",
]
