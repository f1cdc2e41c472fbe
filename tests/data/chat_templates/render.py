#!/usr/bin/env python3
"""Renders every *.jinja here with every context in contexts.json as transformers'
apply_chat_template does (its Jinja environment and globals), into expected.json: the golden
text Baton's chat template engine must match (tests/gpu/chat_template_engine.test.cpp).

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


def main():
    env = environment()
    contexts = json.loads((HERE / "contexts.json").read_text(), object_pairs_hook=dict)
    expected = {}
    for path in sorted(HERE.glob("*.jinja")):
        # {% generation %} is transformers' extension; it renders its body as is.
        source = path.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", "")
        template = env.from_string(source)
        for name, context in contexts.items():
            key = f"{path.stem}/{name}"
            try:
                expected[key] = {"text": template.render(**context)}
            except TemplateError as e:
                expected[key] = {"error": str(e)}
            except Exception as e:  # a template's own bug on this context (e.g. None + str)
                expected[key] = {"python_error": f"{type(e).__name__}: {e}"}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(expected)} renderings into {HERE / 'expected.json'}")


if __name__ == "__main__":
    main()
