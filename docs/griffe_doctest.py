"""Griffe extension for `make docs`: the docstrings' doctest examples
(`>>>` lines, their `...` continuations and expected output, written at the
docstring's own indentation under an `Example:` line, as Keras writes them)
become fenced `pycon` code blocks. Left as they are, Markdown reads them as
nested block quotes and their output (`[[1, 2]]`) as reference links.
"""

import griffe


def fence_doctests(text):
    """`text` with every run of doctest lines at column 0 fenced."""
    out, block = [], []

    def flush():
        if block:
            while block and not block[-1].strip():
                block.pop()
            out.extend(["```pycon", *block, "```", ""])
            block.clear()

    for line in text.splitlines():
        if line.startswith(">>>"):
            block.append(line)
        elif block and line.strip():
            block.append(line)  # a continuation or the expected output
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


class FenceDoctests(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
