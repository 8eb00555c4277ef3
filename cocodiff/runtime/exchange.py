"""Tensor layouts of the Ulysses head exchanges (rows of dim 0, grouped by peer).

A row is one head of one rank's token chunk: ``(batch, local_tokens, head_dim)`` values,
matching the plan's ``row_bytes``. Heads are contiguous per rank (rank r owns heads
``offsets[r] : offsets[r] + heads[r]``), so group order equals head order.
"""

from __future__ import annotations

import torch


def pack_scatter_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, s, H, D) local tokens, all heads -> rows (H, B, s, D), grouped by owner."""
    return x.permute(2, 0, 1, 3).contiguous()


def unpack_scatter_heads(received: torch.Tensor, num_peers: int) -> torch.Tensor:
    """Rows (P * h, B, s, D) from every peer -> (B, P * s, h, D): all tokens, my heads.

    The sequence is in *gathered* order: peer 0's chunk, then peer 1's, ...
    """
    rows, batch, local, dim = received.shape
    heads = rows // num_peers
    # (P, h, B, s, D) -> (B, P, s, h, D) -> (B, P*s, h, D)
    x = received.view(num_peers, heads, batch, local, dim).permute(2, 0, 3, 1, 4)
    return x.reshape(batch, num_peers * local, heads, dim)


def pack_gather_heads(x: torch.Tensor, num_peers: int) -> torch.Tensor:
    """(B, P * s, h, D) all tokens, my heads -> rows (P * h, B, s, D): each peer's
    chunk of tokens with my heads."""
    batch, total, heads, dim = x.shape
    local = total // num_peers
    # (B, P, s, h, D) -> (P, h, B, s, D) -> (P*h, B, s, D)
    x = x.view(batch, num_peers, local, heads, dim).permute(1, 3, 0, 2, 4)
    return x.reshape(num_peers * heads, batch, local, dim)


def unpack_gather_heads(received: torch.Tensor) -> torch.Tensor:
    """Rows (H, B, s, D) from every peer, in head order -> (B, s, H, D)."""
    return received.permute(1, 2, 0, 3)


def all_gather_rows(transport, x: torch.Tensor, group=None) -> torch.Tensor:
    """Every member's ``x`` stacked along a new dim 0, through the transport's
    all-to-all (sending the same tensor to each member)."""
    group = group or transport.world
    size = group.size
    send = x.unsqueeze(0).expand(size, *x.shape).contiguous()
    return transport.all_to_all(send, [1] * size, [1] * size, group).wait()

