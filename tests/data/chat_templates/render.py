#!/usr/bin/env python3
"""Renders every *.jinja here with every context in contexts.json as transformers'
apply_chat_template does (its Jinja environment and globals), into expected.json: the golden
text Baton's chat template engine must match (tests/gpu/chat_template_engine.test.cpp).

Then the same for real/: models' own published templates (real/README.md says whose, from where)
with every context in real/contexts.json, each given its model's bos_token and eos_token
(real/models.json; null: left out, as transformers leaves out a token the model lacks), into
real/expected.json (tests/gpu/chat_template.test.cpp renders them through a model directory).

Needs Jinja2 (Debian: python3-jinja2). Run from anywhere: python3 render.py
"""
import datetime
import json
import pathlib

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = pathlib.Path(__file__).resolve().parent


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: json.dumps, keys in their order, no HTML escaping.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def null_content_as_empty(context):
    """A null content as "" (vLLM's form of a conversation). None when none is null."""
    out = json.loads(json.dumps(context))
    changed = False
    for turn in out.get("messages", []):
        if "content" in turn and turn["content"] is None:
            turn["content"] = ""
            changed = True
    return out if changed else None


def arguments_as_text(context):
    """Every call's arguments as JSON text, as json.dumps writes it (UTF-8 as is, as Baton's
    tojson). None when no call has structured arguments."""
    out = json.loads(json.dumps(context))
    changed = False
    for turn in out.get("messages", []):
        for call in turn.get("tool_calls") or []:
            f = call.get("function") if isinstance(call, dict) else None
            if isinstance(f, dict) and isinstance(f.get("arguments"), (dict, list)):
                f["arguments"] = json.dumps(f["arguments"], ensure_ascii=False)
                changed = True
    return out if changed else None


def render_one(template, context):
    try:
        return {"text": template.render(**context)}
    except TemplateError as e:
        return {"error": str(e)}
    except Exception as e:  # a template's own bug on this context (e.g. None + str)
        return {"python_error": f"{type(e).__name__}: {e}"}


def render_dir(env, directory, models=None, retry_forms=False):
    """Every *.jinja in `directory` with every context in its contexts.json, into its expected.json.
    `models`: per template (its stem), tokens to add to each context. `retry_forms`: a context
    the template fails on is rendered once more in vLLM's form (Baton's tokenizer does so)."""
    contexts = json.loads((directory / "contexts.json").read_text(), object_pairs_hook=dict)
    expected = {}
    for path in sorted(directory.glob("*.jinja")):
        # {% generation %} is transformers' extension; it renders its body as is.
        source = path.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", "")
        template = env.from_string(source)
        tokens = {}
        if models is not None:
            tokens = {k: v for k, v in models[path.stem].items() if k in ("bos_token", "eos_token") and v is not None}
        for name, context in contexts.items():
            key = f"{path.stem}/{name}"
            got = render_one(template, {**context, **tokens})
            if "text" not in got and retry_forms:
                # Baton's tokenizer's two more tries: null content as "", then also the
                # arguments as text; each only when the one before failed.
                empty = null_content_as_empty(context)
                tries = [("null_content_as_empty", empty)]
                tries.append(("arguments_as_text", arguments_as_text(empty if empty is not None else context)))
                for name, alt in tries:
                    if alt is None:
                        continue
                    again = render_one(template, {**alt, **tokens})
                    if "text" in again:
                        got = {"text": again["text"], "rendered_as": name}
                        break
            expected[key] = got
    (directory / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(expected)} renderings into {directory / 'expected.json'}")


def main():
    env = environment()
    render_dir(env, HERE)
    real = HERE / "real"
    render_dir(env, real, json.loads((real / "models.json").read_text(), object_pairs_hook=dict), retry_forms=True)


if __name__ == "__main__":
    main()
