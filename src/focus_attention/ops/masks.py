"""Group memberships as masks: their checks, the dense boolean Focus mask (the oracle for tests
and small inputs, docs/method.md §4) and the bit codes the sparse kernels read them as."""

from __future__ import annotations

import torch

from ..utils.checks import check_int
from . import reference
from .checks import check_bool, check_device, check_shape, check_tensor, fail


def check_groups(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    window: int,
    *,
    owner: str = "focus_mask",
) -> tuple[int, int, int, int]:
    """Validate group memberships (``owner``: the op named in an error about ``window``):
    bool ``query_groups [B, Nq, K]`` and ``key_groups [B, Nk, K]`` (one routing for every
    head), or both per key-value head, ``[B, Nq, H_kv, K]`` and ``[B, Nk, H_kv, K]``.

    Returns:
        ``(B, Nq, Nk, K)``.

    Raises:
        ValueError: non-boolean or wrongly shaped memberships or padding (ranks other than
            3 or 4, or differing; another ``B``, ``H_kv`` or ``K``), ``K < 1``, ``Nq > Nk``,
            ``window`` not an int >= 1, tensors on different devices.
    """
    rank = query_groups.dim() if isinstance(query_groups, torch.Tensor) else 3
    if rank != 4:
        rank = 3  # the shared form; a wrong rank is reported as such by check_tensor
    check_tensor("query_groups", query_groups, rank)
    check_tensor("key_groups", key_groups, rank)
    check_bool("query_groups", query_groups)
    check_bool("key_groups", key_groups)
    bsz, nq, k = query_groups.shape[0], query_groups.shape[1], query_groups.shape[-1]
    same = (key_groups.shape[0], *key_groups.shape[2:]) == (bsz, *query_groups.shape[2:])
    if not same:
        heads = f"H_kv={query_groups.shape[2]}, " if rank == 4 else ""
        fail(
            "key_groups",
            f"shape {tuple(key_groups.shape)}",
            f"[B={bsz}, Nk, {heads}K={k}] matching query_groups",
        )
    if k < 1:
        fail("query_groups", f"K = {k} groups", "K >= 1")
    nk = key_groups.shape[1]
    if nq > nk:
        fail("query_groups", f"Nq = {nq} queries for Nk = {nk} keys", "Nq <= Nk")
    check_int(owner, "window", window, 1)
    check_device("key_groups", key_groups, query_groups.device, "query_groups")
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, 2)
        check_bool("key_padding_mask", key_padding_mask)
        check_shape("key_padding_mask", key_padding_mask, (bsz, nk), "[B, Nk], True = real")
        check_device("key_padding_mask", key_padding_mask, query_groups.device, "query_groups")
    return bsz, nq, nk, k


def effective_window(window: int, num_keys: int) -> int:
    """``window`` capped at ``Nk``: no pair is further apart than ``Nk - 1``, so the mask is
    the same, and a huge window (e.g. ``2**63``) cannot overflow int64 arithmetic."""
    return min(int(window), max(1, num_keys))


def focus_mask(
    query_groups: torch.Tensor,
    key_groups: torch.Tensor,
    window: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense Focus attention mask, ``O(Nq * Nk)`` memory: use it as an oracle only.

    Queries are bottom-right aligned: query ``t`` sits at absolute position ``Nk - Nq + t``.
    Query ``i`` may attend key ``j`` iff ``j <= i``, key ``j`` is real, and either
    ``i - j < window`` (the window counts the query itself) or the two tokens share at least
    one group (docs/method.md §3-§4; the window convention is this package's choice, §3).

    Args:
        query_groups: bool ``[B, Nq, K]`` group memberships of the queries, or
            ``[B, Nq, H_kv, K]``: a routing per key-value head.
        key_groups: bool ``[B, Nk, K]`` group memberships of the keys (``[B, Nk, H_kv, K]``
            with per-head query memberships).
        window: local window in tokens, ``>= 1``.
        key_padding_mask: optional bool ``[B, Nk]``, True = real token.

    Returns:
        bool ``[B, Nq, Nk]``; ``[B, H_kv, Nq, Nk]`` for per-head memberships (key-value head
        ``h``'s mask from its memberships ``[:, :, h]``).

    Raises:
        ValueError: malformed shapes or dtypes, ``window < 1``, ``Nq > Nk``.
    """
    nk = check_groups(query_groups, key_groups, key_padding_mask, window)[2]
    window = effective_window(window, nk)
    return reference.focus_mask(query_groups, key_groups, window, key_padding_mask)


#: groups per int64 code word (its sign bit unused).
CODE_BITS = 62


def group_codes(groups: torch.Tensor) -> torch.Tensor:
    """Bit codes of bool memberships ``[..., K]``: int64 ``[...]``, bit ``g`` set iff group
    ``g`` is held; two tokens share a group iff their codes have a common bit. The one
    packer of the package (the kernels, FlexAttention's masks and the decomposition's
    membership classes read these codes).

    Raises:
        ValueError: ``K > CODE_BITS`` or memberships that are not boolean.
    """
    if groups.dtype != torch.bool:
        raise ValueError(f"groups: received dtype {groups.dtype}, expected torch.bool")
    k = groups.shape[-1]
    if k > CODE_BITS:
        raise ValueError(f"groups: received K = {k}, expected K <= {CODE_BITS}")
    return (groups.to(torch.int64) * _bits(k, groups.device)).sum(dim=-1)


def group_code_words(groups: torch.Tensor) -> list[torch.Tensor]:
    """Bit codes of bool memberships ``[..., K]`` of any ``K``: a list of ``ceil(K / 62)``
    int64 tensors ``[...]``, word ``w`` the :func:`group_codes` of groups ``62 w .. 62 w +
    61`` (two rows share a group iff some word of theirs has a common bit)."""
    k = groups.shape[-1]
    return [group_codes(groups[..., w : w + CODE_BITS]) for w in range(0, k, CODE_BITS)]


def code_groups(codes: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The memberships bool ``[..., K]`` of :func:`group_codes`'s int64 ``codes [...]``."""
    return (codes[..., None] & _bits(num_groups, codes.device)) != 0


def _bits(num_groups: int, device) -> torch.Tensor:
    """int64 ``[K]``: ``2 ** g`` for each group ``g``."""
    return torch.pow(2, torch.arange(num_groups, device=device, dtype=torch.int64))
