"""`conf/flat.yaml`: every field of a run with its default and its description, generated from the
schemas' `Args:` docstrings (`python -m qerl_exp.flat_config > conf/flat.yaml`); a test compares the
committed file with the schemas, so a renamed field or a changed default shows in a diff."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap

from qerl_exp.config import Config


def field_docs(schema: type) -> dict[str, str]:
    """Each field's description from the `Args:` block of a schema's docstring, on one line."""
    docs, name = {}, None
    lines = (schema.__doc__ or "").split("Args:", 1)[-1].splitlines()
    for line in lines:
        entry = re.match(r"^ {8}(\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            docs[name] = entry.group(2).strip()
        elif name and line.startswith(" " * 12):
            docs[name] += " " + line.strip()
    return docs


def _yaml_scalar(value) -> str:
    """JSON is YAML, but YAML 1.1 readers (PyYAML) read `1e-05` as a string: write `1.0e-05`."""
    text = json.dumps(value)
    if isinstance(value, float) and "e" in text and "." not in text.split("e")[0]:
        text = text.replace("e", ".0e")
    return text


def flat_yaml(schema: type = Config, indent: str = "") -> str:
    """Every field of the run config with its default and its description (`conf/flat.yaml`, which
    a test compares with the schemas, so that a renamed field or a changed default shows in a diff)."""
    out = [] if indent else ["# Generated from the schemas in qerl_exp/config/ by `python -m qerl_exp.flat_config > conf/flat.yaml`;",
                             "# do not edit. Every field of a run, its default, and its description.", ""]
    docs, defaults = field_docs(schema), schema()
    for f in dataclasses.fields(schema):
        out += [f"{indent}# {line}" for line in textwrap.wrap(docs.get(f.name, "(undocumented)"), 100 - len(indent) - 2)]
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            out += [f"{indent}{f.name}:", flat_yaml(type(value), indent + "  ").rstrip("\n")]
        else:
            out.append(f"{indent}{f.name}: {_yaml_scalar(value)}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(flat_yaml(), end="")
