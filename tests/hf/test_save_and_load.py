"""FocusModel's persistence in its own module: each method of the model's persistence calls
the function of the same name, and the functions, given the model, save and load it as the
methods do (the adapter files, the state dict, the routers)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from tiny import build_model, focus, ids

from focus_attention.hf import FocusModel
from focus_attention.hf import save_and_load as persistence

#: FocusModel's methods that are its persistence, each a call of the function of its name
PERSISTENCE = {
    "state_dict": "state_dict",
    "_load_from_state_dict": "load_from_state_dict",
    "load_state_dict": "load_state_dict",
    "focus_state_dict": "focus_state_dict",
    "load_focus_state_dict": "load_focus_state_dict",
    "load_routers": "load_routers",
    "save_pretrained": "save_pretrained",
    "from_pretrained": "from_pretrained",
    "push_to_hub": "push_to_hub",
}


def test_each_persistence_method_of_the_model_is_one_call_of_its_function():
    for method, function in PERSISTENCE.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(FocusModel, method))))
        body = tree.body[0].body
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        assert len(body) == 2, f"FocusModel.{method}: one statement after its docstring"
        call = body[1].value
        assert isinstance(call, ast.Call) and ast.unparse(call.func) == f"save_and_load.{function}"
        assert callable(getattr(persistence, function)), function


def test_the_functions_save_and_load_a_model(tmp_path):
    _, fm = focus("llama")
    with torch.no_grad():
        for router in fm.routers.values():
            router.centroids.add_(0.25)
    persistence.save_pretrained(fm, tmp_path)
    again = persistence.from_pretrained(FocusModel, build_model("llama"), tmp_path)
    x = ids(1, 40, seed=3)
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, fm(input_ids=x).logits)
    state = persistence.state_dict(fm)
    _, fresh = focus("llama")
    persistence.load_state_dict(fresh, state)
    tensors = persistence.focus_state_dict(fresh)
    assert tensors.keys() == persistence.focus_state_dict(fm).keys()
    assert all(torch.equal(tensors[k], v) for k, v in persistence.focus_state_dict(fm).items())
    _, routed = focus("llama")
    assert persistence.load_routers(routed, tmp_path) is routed
    assert torch.equal(routed.routers["0"].centroids, fm.routers["0"].centroids)
