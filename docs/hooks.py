"""mkdocs hooks: the guides (guides/*.py, runnable keras.io-style scripts)
become pages at build time, so the site shows exactly the code CI runs; and
the API reference, rendered under the TensorFlow backend, says which names
each Keras backend offers (asked of the package under each, see
docs/api_backends.py): a page `api/backends.md` and a note on each module's
page.

A guide is a Python file whose top-level string literals are its prose
(Markdown) and everything between them is code; its first string holds
`Title:`, `Author:` and `Description:` lines. Files named `_*.py` are helpers
of the guides, not guides.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = os.path.join(ROOT, "guides")
BACKENDS_PAGE = "api/backends.md"


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
    _AVAILABILITY.clear()
    _AVAILABILITY.update(backend_availability())
    files.append(File.generated(config, BACKENDS_PAGE,
                                content=backends_markdown(_AVAILABILITY)))
    return files


def _child(backend, stdin=None):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "api_backends.py")],
                            input=stdin, capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"docs/api_backends.py under {backend} failed:\n{result.stderr}")
    return result.stdout


def backend_availability():
    """{module: {name: None (under JAX too) or the error asking for it raises
    under JAX}}, every public name of the TensorFlow backend."""
    names = _child("tensorflow")
    availability = json.loads(_child("jax", stdin=names))
    for module, members in availability.items():
        for name, reason in members.items():
            # Only names the package declares TensorFlow-only; anything else
            # (a name missing by mistake) fails the build.
            if reason is not None and "TensorFlow backend only" not in reason:
                raise RuntimeError(f"{module}.{name} under JAX: {reason}")
    return availability


def backends_markdown(availability):
    out = ["# Backend availability", "",
           "Every public name, and whether Keras's JAX backend offers it. The reference pages "
           "are rendered under the TensorFlow backend, where every name exists; a class is "
           "offered under JAX by the same name and saved under the same name, so a `.keras` "
           "file loads under either. A name marked *TensorFlow only* raises, under JAX, an "
           "`AttributeError` that says so (a whole module's message is quoted under its "
           "table). "
           "This table is generated at build time by asking the package under each backend "
           "(`docs/api_backends.py`).", ""]
    for module, members in availability.items():
        out += [f"## {module}", "", "| name | TensorFlow | JAX |", "|---|---|---|"]
        for name, reason in members.items():
            out.append(f"| `{module}.{name}` | yes | {'yes' if reason is None else '*TensorFlow only*'} |")
        reasons = sorted({r for r in members.values() if r is not None})
        if len(reasons) == 1 and all(r is not None for r in members.values()):
            out += ["", f"Under JAX: {reasons[0]}"]
        out.append("")
    return "\n".join(out)


def _module_note(module, members):
    missing = [name for name, reason in members.items() if reason is not None]
    if not missing:
        return ('!!! note "Backends"\n    Every name on this page works under Keras\'s '
                'TensorFlow and JAX backends.\n')
    if len(missing) == len(members):
        return (f'!!! note "Backends"\n    `{module}` runs on Keras\'s TensorFlow backend '
                f'only for now ([backend availability](backends.md)).\n')
    listed = ", ".join(f"`{name}`" for name in missing)
    return (f'!!! note "Backends"\n    Every name on this page works under Keras\'s '
            f'TensorFlow and JAX backends except {listed}: TensorFlow only for now '
            f'([backend availability](backends.md)).\n')


_AVAILABILITY = {}


def on_page_markdown(markdown, page, **kwargs):
    """A note on each API page, above its `::: module`, saying which of its
    names are TensorFlow-only."""
    if not page.file.src_uri.startswith("api/") or page.file.src_uri == BACKENDS_PAGE:
        return markdown
    out = []
    for line in markdown.splitlines():
        if line.startswith("::: "):
            module = line[4:].strip()
            if module in _AVAILABILITY:
                out += [_module_note(module, _AVAILABILITY[module]), ""]
        out.append(line)
    return "\n".join(out)
