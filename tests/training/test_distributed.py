"""end_process_group: the ranks of a launched run leave the default process group together."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from focus_attention.training.distributed import end_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_without_a_process_group_nothing_happens():
    assert not dist.is_initialized()
    assert end_process_group() is False
    assert not dist.is_initialized()


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_an_initialised_group_is_destroyed():
    """A one-rank gloo group (the barrier returns at once) is destroyed, and a second call
    finds none."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        assert end_process_group() is True
        assert not dist.is_initialized()
        assert end_process_group() is False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
