"""``FocusModel.load_routers``: the routers of a saved adapter under this model's settings,
and the documented refusal of adapters whose routers do not fit this model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tiny import build_model, focus, ids

from focus_attention.hf import TRAINER_WEIGHTS_NAME, FocusConfig, get_focus_model

X = ids(2, 24, seed=9)


def saved_adapter(directory, **cfg):
    """Save an adapter whose routers are not the initial ones; returns its router state."""
    _, fm = focus("llama", **cfg)
    with torch.no_grad():
        for p in fm.routers.parameters():
            p.add_(0.3 * torch.randn_like(p))
        for router in fm.routers.values():
            router.routing_bias.uniform_(-1, 1)
            router.bias_updates.fill_(7)
    fm.save_pretrained(directory)
    return {k: v.clone() for k, v in fm.routers.state_dict().items()}


def test_load_routers_keeps_this_models_settings(tmp_path):
    state = saved_adapter(tmp_path, window=8, top_k=1)
    _, fm = focus("llama", window=16, top_k=2)
    fm.load_routers(tmp_path)
    assert (fm.focus_config.window, fm.focus_config.top_k) == (16, 2)
    got = fm.routers.state_dict()
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)
    # the same as putting the saved tensors into a model with these settings directly
    _, direct = focus("llama", window=16, top_k=2)
    direct.routers.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fm(input_ids=X).logits, direct(input_ids=X).logits)


#: (layers the adapter was saved with, layers of the loading model, their resolved lists);
#: the tiny LLaMA has 2 layers, so None means [0, 1]
LAYER_CASES = [
    ([1], [0, 1], [1], [0, 1]),
    ([0, 1], [1], [0, 1], [1]),
    (None, [1], [0, 1], [1]),
    ([1], None, [1], [0, 1]),
    ([0], [1], [0], [1]),
]


@pytest.mark.parametrize("saved, here, saved_list, here_list", LAYER_CASES)
def test_routers_of_other_layers_are_refused_by_the_documented_message(
    tmp_path, saved, here, saved_list, here_list
):
    saved_adapter(tmp_path, layers=saved)
    _, fm = focus("llama", layers=here)
    before = {k: v.clone() for k, v in fm.routers.state_dict().items()}
    message = (
        f"FocusModel.load_routers: the adapter in {tmp_path} has layers={saved_list!r}, "
        f"this model {here_list!r}; build the model with the adapter's layers"
    )
    with pytest.raises(ValueError) as err:
        fm.load_routers(tmp_path)
    assert str(err.value) == message
    assert all(torch.equal(v, before[k]) for k, v in fm.routers.state_dict().items())


@pytest.mark.parametrize("saved, here", [([0, 1], None), (None, [0, 1])])
def test_the_same_layers_written_either_way_load(tmp_path, saved, here):
    state = saved_adapter(tmp_path, layers=saved)
    _, fm = focus("llama", layers=here)
    fm.load_routers(tmp_path)
    assert all(torch.equal(v, state[k]) for k, v in fm.routers.state_dict().items())


@pytest.mark.parametrize(
    "saved, here, name",
    [(dict(num_groups=4), dict(num_groups=8), "num_groups"),
     (dict(group_dim=8), dict(group_dim=16), "group_dim")],
)  # fmt: skip
def test_routers_of_another_shape_are_refused_by_the_documented_message(
    tmp_path, saved, here, name
):
    saved_adapter(tmp_path, **saved)
    _, fm = focus("llama", **here)
    with pytest.raises(ValueError) as err:
        fm.load_routers(tmp_path)
    assert str(err.value) == (
        f"FocusModel.load_routers: the adapter in {tmp_path} has {name}={saved[name]!r}, "
        f"this model {here[name]!r}; build the model with the adapter's {name}"
    )


def test_a_trainer_folder_is_sent_to_from_pretrained(tmp_path):
    fm = get_focus_model(build_model("llama"), FocusConfig(num_groups=4))
    save_file(fm.state_dict(), str(tmp_path / TRAINER_WEIGHTS_NAME))
    with pytest.raises(FileNotFoundError, match="FocusModel.from_pretrained"):
        fm.load_routers(tmp_path)
