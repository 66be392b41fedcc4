"""`relay render-chat` against live Python jinja2 (transformers' environment) on fresh conversations.

The conversations are generated here from a fixed seed, so they differ from the committed GoogleTest
fixtures; the Python side is the same environment replica as tests/fixtures/chat/make_chat_fixtures.py
(checked once against transformers itself). Error cases must exit non-zero with a clear message.
"""
import importlib.util
import json
import random
import subprocess

import pytest

from conftest import DEMO_MODEL, FIXTURES, ROOT

_spec = importlib.util.spec_from_file_location("make_chat_fixtures", FIXTURES / "chat" / "make_chat_fixtures.py")
mcf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mcf)

ENV = mcf.make_env()
TEMPLATE_FILES = {"qwen3": None, "qwen3-coder": ROOT / "models/templates/Qwen3-Coder.jinja",
                  "qwen3.5": ROOT / "models/templates/Qwen3.5-4B.jinja"}
PY_TEMPLATES = {name: ENV.from_string(mcf.load_template(kind, rel)) for name, (kind, rel) in mcf.TEMPLATES.items()}

WORDS = ["hello", "naïve", "日本語", "🙂", "tab\there", "new\nline", "  spaced  ", "{{ x }}", "\"q\"", "it's",
         "<think>", "</think>", "<tool_response>", "back\\slash", "Ω", "0.5", ""]


def text(rng, n=None):
    return " ".join(rng.choice(WORDS) for _ in range(n if n is not None else rng.randint(0, 6)))


def tool_call(rng):
    args = {"q": text(rng, 2), "n": rng.randint(-5, 500), "ok": rng.random() < 0.5, "x": rng.choice([0.25, 3.0, 1e-9]),
            "list": [text(rng, 1), None]}
    return {"type": "function", "function": {"name": rng.choice(["get_weather", "search_docs"]), "arguments": args}}


def conversation(rng):
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text(rng)})
        kind = rng.random()
        if kind < 0.3:
            calls = [tool_call(rng) for _ in range(rng.randint(1, 3))]
            messages.append({"role": "assistant", "content": text(rng), "tool_calls": calls})
            for _ in calls:
                messages.append({"role": "tool", "content": text(rng)})
        elif kind < 0.6:
            messages.append({"role": "assistant", "content": text(rng), "reasoning_content": text(rng)})
        else:
            messages.append({"role": "assistant", "content": f"<think>{text(rng)}</think>{text(rng)}"})
    if rng.random() < 0.6:
        messages.append({"role": "user", "content": text(rng)})
    body = {"messages": messages, "add_generation_prompt": rng.random() < 0.7}
    if rng.random() < 0.5:
        body["tools"] = rng.sample(mcf.TOOLS + [mcf.CALC], rng.randint(1, 3))
    if rng.random() < 0.6:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return body


def python_render(template, body):
    case = {"messages": body["messages"], "tools": body.get("tools"),
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "kwargs": body.get("chat_template_kwargs", {})}
    return mcf.render(template, case)


def relay_render(relay_bin, body, template_file=None, raw_input=None):
    cmd = [str(relay_bin), "render-chat", "--model", str(DEMO_MODEL)]
    if template_file is not None:
        cmd += ["--template", str(template_file)]
    data = raw_input if raw_input is not None else json.dumps(body, ensure_ascii=False).encode()
    return subprocess.run(cmd, input=data, capture_output=True, timeout=60)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", sorted(TEMPLATE_FILES))
def test_render_matches_python_jinja(relay_bin, name, seed):
    body = conversation(random.Random(seed * 7919 + len(name)))
    try:
        expected = python_render(PY_TEMPLATES[name], body)
    except Exception as e:  # noqa: BLE001 - the template rejecting this input is a valid outcome
        result = relay_render(relay_bin, body, TEMPLATE_FILES[name])
        assert result.returncode != 0, f"Python raised {e!r} but relay rendered:\n{result.stdout.decode()}"
        assert b"chat template" in result.stderr
        return
    result = relay_render(relay_bin, body, TEMPLATE_FILES[name])
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == expected


def test_default_add_generation_prompt_is_true(relay_bin):
    result = relay_render(relay_bin, {"messages": [{"role": "user", "content": "Hi"}]})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_malformed_json_fails_clearly(relay_bin):
    result = relay_render(relay_bin, None, raw_input=b'{"messages": [')
    assert result.returncode != 0
    assert b"not valid JSON" in result.stderr


def test_missing_messages_fails_clearly(relay_bin):
    result = relay_render(relay_bin, {"tools": []})
    assert result.returncode != 0
    assert b"no \"messages\"" in result.stderr


def test_template_raise_exception_fails_clearly(relay_bin):
    result = relay_render(relay_bin, {"messages": [{"role": "system", "content": "only system"}]},
                          TEMPLATE_FILES["qwen3.5"])
    assert result.returncode != 0
    assert b"chat template raised an exception" in result.stderr
    assert b"No user query found in messages." in result.stderr


def test_template_syntax_error_names_the_line(relay_bin, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("ok\n{% for m in messages %}\n{{ m.content | no_such_filter }}\n{% endfor %}")
    result = relay_render(relay_bin, {"messages": []}, bad)
    assert result.returncode != 0
    assert b"syntax error at line 3: no filter named 'no_such_filter'" in result.stderr


def test_help(relay_bin):
    result = subprocess.run([str(relay_bin), "render-chat", "--help"], capture_output=True, timeout=60)
    assert result.returncode == 0
    assert b"--template" in result.stdout and b"chat_template_kwargs" in result.stdout
