"""mkdocs hooks: the guides (guides/*.py, runnable keras.io-style scripts)
become pages at build time, so the site shows exactly the code CI runs.

A guide is a Python file whose top-level string literals are its prose
(Markdown) and everything between them is code; its first string holds
`Title:`, `Author:` and `Description:` lines. Files named `_*.py` are helpers
of the guides, not guides.
"""

import ast
import os
import textwrap

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = os.path.join(ROOT, "guides")


def _guide_files():
    return sorted(f for f in os.listdir(GUIDES) if f.endswith(".py") and not f.startswith("_"))


def _header(text):
    fields, key = {}, None
    for line in textwrap.dedent(text).strip().splitlines():
        name, sep, value = line.partition(":")
        if sep and name in ("Title", "Author", "Description", "Date created", "Last modified"):
            key = name
            fields[key] = value.strip()
        elif key:
            fields[key] += " " + line.strip()
    return fields


def guide_markdown(path):
    """The Markdown page of the guide at `path`."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    prose = [node for node in ast.parse(source).body
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)]
    if not prose or prose[0].lineno != 1:
        raise ValueError(f"{path}: a guide starts with its Title/Description string")
    header = _header(prose[0].value.value)
    if "Title" not in header:
        raise ValueError(f"{path}: the first string has no `Title:` line")
    out = [f"# {header['Title']}", ""]
    if header.get("Description"):
        out += [f"*{header['Description']}*", ""]
    name = os.path.basename(path)
    out += [f"The source of this page is `guides/{name}`, a script that runs as it is "
            f"(`python guides/{name}`; CI runs every guide).", ""]
    previous_end = prose[0].end_lineno
    for node in prose[1:] + [None]:
        start = node.lineno if node is not None else len(lines) + 1
        code = "\n".join(lines[previous_end:start - 1]).strip("\n")
        if code.strip():
            out += ["```python", code, "```", ""]
        if node is not None:
            out += [textwrap.dedent(node.value.value).strip("\n"), ""]
            previous_end = node.end_lineno
    return "\n".join(out)


def on_config(config):
    """Fills the nav's empty `Guides` section with every guide, in file order."""
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Guides" in entry and not entry["Guides"]:
            entry["Guides"] = [f"guides/{f[:-3]}.md" for f in _guide_files()]
    return config


def on_files(files, config):
    for name in _guide_files():
        files.append(File.generated(config, f"guides/{name[:-3]}.md",
                                    content=guide_markdown(os.path.join(GUIDES, name))))
    return files
