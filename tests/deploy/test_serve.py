"""``transformers serve`` on a directory written by ``focus export`` (docs/deploy.md): a real
server on 127.0.0.1 answers chat and completion requests, streaming or not, with what offline
greedy ``generate`` of the same directory gives (Focus active: the dense model answers
otherwise), and answers malformed JSON, an unknown model, a prompt over the model's length
and a client leaving mid-stream with a clear error or a clean cancel, serving on after each."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import focus, word_tokenizer
from tiny_assets import WORDS
from transformers import AutoModelForCausalLM
from transformers.utils.import_utils import is_serve_available

from focus_attention import export_model
from focus_attention.deploy.serve import ServedModel

httpx = pytest.importorskip("httpx")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_serve_available(), reason="transformers serve's dependencies: pip install '.[serve]'"
    ),
]

#: the tiny model's context: a prompt over it is refused
CONTEXT = 128
NEW_TOKENS = 8
#: longer than the Focus window (8): Focus and dense attention differ
PROMPT = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(48))
CHAT = [{"role": "user", "content": PROMPT}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The export of a tiny Focus LLaMA whose vocabulary is its word tokenizer's (every
    generated token decodes to a word), with a chat template."""
    tok = word_tokenizer(WORDS)
    tok.chat_template = TEMPLATE
    overrides = {"vocab_size": len(tok), "max_position_embeddings": CONTEXT}
    _, fm = focus("llama", window=8, top_k=1, model_overrides=overrides)
    return export_model(fm, tmp_path_factory.mktemp("serve") / "tiny-focus", tok)


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with ServedModel(exported, log, ready_timeout=180, env={"OMP_NUM_THREADS": "1"}) as served:
        yield served


@pytest.fixture(scope="module")
def offline(exported):
    """``{(endpoint, focus): text}``: greedy ``generate`` of the exported directory, with
    Focus and with the dense base model, decoded as the server decodes."""
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported)
    prompts = {
        "completions": tok(PROMPT, return_tensors="pt")["input_ids"],
        "chat": tok.apply_chat_template(
            CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"],  # fmt: skip
    }
    texts = {}
    for endpoint, ids in prompts.items():
        for active in (True, False):
            with torch.no_grad():
                if active:
                    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                else:
                    with model.focus_model.disable_focus():
                        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            texts[endpoint, active] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return texts


def body(endpoint: str, server: ServedModel, **extra) -> dict:
    main = {"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT}
    return {"model": server.model, **main, "max_tokens": NEW_TOKENS, "temperature": 0, **extra}


def answer_text(endpoint: str, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if endpoint == "completions" else choice["message"]["content"]


def streamed_text(endpoint: str, response) -> str:
    parts = []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        assert "error" not in event, event
        for choice in event["choices"]:
            parts.append(choice.get("text") if endpoint == "completions"
                         else choice["delta"].get("content"))  # fmt: skip
    return "".join(p for p in parts if p)


def assert_serving(server: ServedModel, offline: dict) -> None:
    """The server is up and still answers as offline ``generate``."""
    assert server.alive(), server.log_tail()
    answer = httpx.post(
        f"{server.url}/v1/completions", json=body("completions", server), timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert answer_text("completions", answer.json()) == offline["completions", True]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_answers_equal_offline_generate_with_focus(server, offline, endpoint):
    assert offline[endpoint, True] != offline[endpoint, False]  # Focus changes the answer
    assert len(offline[endpoint, True].split()) >= NEW_TOKENS // 2
    url = f"{server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}"
    answer = httpx.post(url, json=body(endpoint, server), timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer_text(endpoint, answer.json()) == offline[endpoint, True]
    assert answer.json()["usage"]["completion_tokens"] == NEW_TOKENS
    with httpx.stream("POST", url, json=body(endpoint, server, stream=True), timeout=120) as r:
        assert r.status_code == 200
        assert streamed_text(endpoint, r).strip() == offline[endpoint, True].strip()


def test_malformed_json_is_a_client_error(server, offline):
    answer = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "x", prompt',
                        headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert answer.status_code == 422 and "json" in answer.text.lower()
    assert_serving(server, offline)


def test_an_unknown_model_is_refused_naming_it(server, offline):
    request = {**body("completions", server), "model": "no-such-model"}
    answer = httpx.post(f"{server.url}/v1/completions", json=request, timeout=30)
    assert answer.status_code == 400 and "no-such-model" in answer.json()["detail"]
    assert_serving(server, offline)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_over_the_models_length_is_refused(server, offline, endpoint):
    long = " ".join(WORDS[i % len(WORDS)] for i in range(CONTEXT + 20))
    request = body(endpoint, server)
    if endpoint == "completions":
        request["prompt"] = long
    else:
        request["messages"] = [{"role": "user", "content": long}]
    url = f"{server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}"
    answer = httpx.post(url, json=request, timeout=60)
    assert answer.status_code == 400, answer.text
    assert f"at most {CONTEXT}" in answer.json()["detail"]
    assert_serving(server, offline)


def test_a_client_leaving_mid_stream_cancels_cleanly(server, offline):
    request = body("completions", server, stream=True, max_tokens=CONTEXT // 2)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["choices"]
    # the connection is closed here, mid-stream
    assert_serving(server, offline)
    assert "Traceback" not in server.log_tail(20000)


@pytest.fixture(scope="module")
def batching_server(exported, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server-cb.log"
    with ServedModel(exported, log, extra=("--continuous-batching",), ready_timeout=180,
                     env={"OMP_NUM_THREADS": "1"}) as served:  # fmt: skip
        yield served


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_batching_answers_equal_offline_generate(batching_server, offline, endpoint):
    """``--continuous-batching`` (paged attention, requests batched): Focus still runs, and
    concurrent requests each get offline ``generate``'s answer."""
    import concurrent.futures

    server = batching_server
    url = f"{server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: httpx.post(url, json=body(endpoint, server), timeout=120), range(3)))  # fmt: skip
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer_text(endpoint, answer.json()) == offline[endpoint, True]
    with httpx.stream("POST", url, json=body(endpoint, server, stream=True), timeout=120) as r:
        assert r.status_code == 200
        assert streamed_text(endpoint, r).strip() == offline[endpoint, True].strip()
    assert_serving(server, offline)
