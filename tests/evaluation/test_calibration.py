"""``calibrate_on``: the routing bias collected from several blocks is every block folded
in order (a cumulative mean, then an EMA at ``bias_momentum``, docs/method.md §4), starting
from nothing: the expectation is computed here from each block's bias taken alone."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, focus, ids
from tolerances import tolerance

from focus_attention.evaluation.calibration import calibrate_on


def bias_of_each_block_alone(fm, blocks: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each block's own column-bias mean: the bias after forgetting everything and feeding
    that block alone."""
    out = []
    for block in blocks:
        fm.calibrate(block[None], reset=True)
        out.append({i: r.routing_bias.double().clone() for i, r in fm.routers.items()})
    return out


def folded(parts: list[torch.Tensor], momentum: float) -> torch.Tensor:
    """The running mean of ``parts`` in order: weight ``max(momentum, 1 / (n + 1))``."""
    bias = torch.zeros_like(parts[0])
    for n, part in enumerate(parts):
        weight = max(momentum, 1.0 / (n + 1))
        bias = (1.0 - weight) * bias + weight * part
    return bias


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("momentum", [0.01, 0.4])
def test_every_block_is_folded_into_the_bias(arch, momentum):
    _, fm = focus(arch, window=4, bias_momentum=momentum)
    blocks = torch.stack([ids(1, 40, seed=s)[0] for s in (1, 2, 3)])
    alone = bias_of_each_block_alone(fm, blocks)
    assert any(not torch.allclose(alone[0][i], alone[2][i]) for i in alone[0])
    for router in fm.routers.values():  # a trained bias, which calibration must forget
        router.routing_bias.fill_(5.0)
        router.bias_updates.fill_(100)
    calibrate_on(fm, blocks)
    for i, router in fm.routers.items():
        assert int(router.bias_updates) == 3, i
        want = folded([a[i] for a in alone], momentum)
        torch.testing.assert_close(router.routing_bias.double(), want, **tolerance("reordered"))


def test_progress_counts_every_block():
    _, fm = focus("llama", window=4)

    class Bar:
        n = 0

        def update(self, k: int) -> None:
            self.n += k

    bar = Bar()
    calibrate_on(fm, ids(4, 24, seed=7), bar)
    assert bar.n == 4
