"""The dense boolean Focus mask: the oracle for tests and small inputs (docs/method.md §4)."""

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
    """Validate group memberships (``owner``: the op named in an error about ``window``).

    Returns:
        ``(B, Nq, Nk, K)``.

    Raises:
        ValueError: non-boolean or wrongly shaped memberships or padding, ``K < 1``,
            ``Nq > Nk``, ``window`` not an int >= 1, tensors on different devices.
    """
    check_tensor("query_groups", query_groups, 3)
    check_tensor("key_groups", key_groups, 3)
    check_bool("query_groups", query_groups)
    check_bool("key_groups", key_groups)
    bsz, nq, k = query_groups.shape
    if key_groups.shape[0] != bsz or key_groups.shape[2] != k:
        fail(
            "key_groups",
            f"shape {tuple(key_groups.shape)}",
            f"[B={bsz}, Nk, K={k}] matching query_groups",
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
        query_groups: bool ``[B, Nq, K]`` group memberships of the queries.
        key_groups: bool ``[B, Nk, K]`` group memberships of the keys.
        window: local window in tokens, ``>= 1``.
        key_padding_mask: optional bool ``[B, Nk]``, True = real token.

    Returns:
        bool ``[B, Nq, Nk]``.

    Raises:
        ValueError: malformed shapes or dtypes, ``window < 1``, ``Nq > Nk``.
    """
    nk = check_groups(query_groups, key_groups, key_padding_mask, window)[2]
    window = effective_window(window, nk)
    return reference.focus_mask(query_groups, key_groups, window, key_padding_mask)
