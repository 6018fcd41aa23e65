"""POST /v1/chat/completions (issue 19, item 6) with the official `openai` client, streaming and not: the
artifact's chat template (tokenizer_config.json or chat_template.jinja, rendered with Jinja2 as Hugging
Face renders it), else the documented plain template; errors in OpenAI's shape naming the field."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dspark_trt.runtime import GenerationConfig, Runtime  # noqa: E402
from dspark_trt.serve.chat import ChatTemplate, render_plain  # noqa: E402
from dspark_trt.serve.server import ServerThread, create_app  # noqa: E402
from serve_helpers import MODEL, rt, server  # noqa: E402,F401 (fixtures)

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def offline(rt, text, n):
    return rt.generate([text], GenerationConfig(max_new_tokens=n, spec="off"))[0]


def test_plain_template_is_documented_lines():
    assert render_plain(MESSAGES) == "system: You write Python.\nuser: def fib(n):\nassistant:"
    assert ChatTemplate().plain and ChatTemplate().origin == "plain"


def test_chat_without_a_template_uses_the_plain_one(rt, server, client):
    assert server.app.state.chat_template.origin == "plain"  # the test artifact has no tokenizer_config.json
    want = offline(rt, render_plain(MESSAGES), 12)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(rt.tokenizer.encode(render_plain(MESSAGES)))
    assert r.usage.completion_tokens == len(want.token_ids)


def test_chat_streams_the_same_text(rt, client):
    want = offline(rt, render_plain(MESSAGES), 16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)
    body = chunks[:-1]
    assert len(body) >= 3  # really streamed
    assert "".join(c.choices[0].delta.content or "" for c in body) == want.text
    assert body[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_chat_content_parts_and_roles(rt, client):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "You write"}, {"type": "text", "text": "Python."}]},
             {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
    text = "system: You write\nPython.\nuser: x\nassistant: y\nuser: z\nassistant:"
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == offline(rt, text, 5).text


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(rt, server):
    def n_prompt(text):
        return len(rt.tokenizer.encode(render_plain([{"role": "user", "content": text}])))

    long = "x"
    while n_prompt(long + " x") < rt.max_context - 4:
        long += " x"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": long}], "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= rt.max_context - n_prompt(long)
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                     json={"messages": [{"role": "user", "content": long}], "max_completion_tokens": 50})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_completion_tokens"


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "spec": "fixed:²"}, "spec"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[str(i) for i in range(len(BAD_CHATS))])
def test_bad_chat_bodies_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_a_lone_surrogate_in_a_message_is_a_400(server):
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text


def test_the_artifacts_template_renders_the_prompt(rt, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHATML}))
    tpl = ChatTemplate.for_artifact(tmp_path)
    assert tpl.origin == "tokenizer_config.json" and not tpl.plain
    text = tpl.render(MESSAGES)
    assert text == ("<|system|>\nYou write Python.<|endoftext|>\n<|user|>\ndef fib(n):<|endoftext|>\n"
                    "<|assistant|>\n")
    with ServerThread(create_app(rt, model_name=MODEL, chat_template=tpl)) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == offline(rt, text, 8).text
        assert r.usage.prompt_tokens == len(rt.tokenizer.encode(text))
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    # chat_template.jinja wins over tokenizer_config.json; a list of named templates picks "default".
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert ChatTemplate.for_artifact(tmp_path).render(MESSAGES) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.for_artifact(tmp_path).render(MESSAGES) == "J2"


def test_an_artifact_with_a_template_serves_it_by_default(tiny_artifact, tmp_path):
    art = tmp_path / "tiny"
    shutil.copytree(tiny_artifact, art)
    (art / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    local = Runtime.load(art, backend="ort", profile="none")
    try:
        app = create_app(local, model_name=MODEL)
        assert app.state.chat_template.origin == "tokenizer_config.json"
        assert app.state.chat_template.render(MESSAGES[:1]) == "<|system|>\nYou write Python.</s>\n<|assistant|>\n"
    finally:
        local.close()


def test_a_template_that_refuses_messages_is_a_400(rt):
    tpl = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the "
                       "user') }}{% endif %}{{ messages[0]['content'] }}", "tokenizer_config.json")
    with ServerThread(create_app(rt, model_name=MODEL, chat_template=tpl)) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert e.value.body["param"] == "messages" and "first message must be from the user" in e.value.body["message"]
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES[1:], max_tokens=2, temperature=0)
        assert r.choices[0].message.content is not None


def test_without_jinja2_the_plain_template_is_used(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "jinja2", None)  # `import jinja2` now raises ImportError
    tpl = ChatTemplate(CHATML, "tokenizer_config.json")
    assert tpl.plain and "jinja2 missing" in tpl.origin
    assert tpl.render(MESSAGES) == render_plain(MESSAGES)
    assert any("jinja2" in r.getMessage() for r in caplog.records)


def test_a_template_that_does_not_compile_is_refused_at_start():
    from dspark_trt.errors import DsparkError

    with pytest.raises(DsparkError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", "tokenizer_config.json")


@pytest.mark.slow
def test_the_bundled_pair_carries_its_chat_template_into_the_artifact(tmp_path):
    """Export the bundled tiny pair: its tokenizer_config.json (with a chat template) is copied and hashed, and
    the server renders chats with it."""
    from pathlib import Path

    from dspark_trt.exporter.export import export_artifacts

    models = Path(__file__).resolve().parents[1] / "examples" / "models"
    art = export_artifacts(models / "stdlib-target", models / "stdlib-draft", tmp_path / "stdlib", max_draft=3,
                           max_batch=4, max_context=256, progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert "tokenizer_config.json" in manifest["files"]
    assert json.loads((art / "tokenizer_config.json").read_text())["chat_template"]
    local = Runtime.load(art, backend="ort", profile="none")
    try:
        with ServerThread(create_app(local)) as srv:
            assert srv.app.state.chat_template.origin == "tokenizer_config.json"
            c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
            msgs = [{"role": "user", "content": "a function that adds two numbers"}]
            r = c.chat.completions.create(model="stdlib", messages=msgs, max_tokens=12, temperature=0)
            want = local.generate(["# a function that adds two numbers\n"],
                                  GenerationConfig(max_new_tokens=12, spec="off"))[0]
            assert r.choices[0].message.content == want.text
    finally:
        local.close()
