"""A griffe extension for the API reference (mkdocs.yml loads it).

jmp_lite's docstrings follow Google's style as its doctests read them, and
two habits of that style need translating for griffe:

* ``Example:`` opens a section of doctests (griffe only knows ``Examples:``,
  and would render the doctests as prose);
* a module constant is documented by a Sphinx ``#:`` comment above its
  assignment (a constant carries no docstring of its own; griffe reads a
  string literal after it instead).

Nothing here changes the library; it only changes how griffe reads it.
"""

import re

import griffe

_EXAMPLE_HEADER = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class JmpLiteDocstrings(griffe.Extension):
  """``Example:`` sections as examples; ``#:`` comments as constants' docs."""

  def on_instance(self, *, obj, **kwargs):  # pylint: disable=unused-argument
    if obj.docstring is not None:
      obj.docstring.value = _EXAMPLE_HEADER.sub(r"\1Examples:", obj.docstring.value)
    elif obj.is_attribute and obj.lineno:
      comment = _doc_comment(obj.lines_collection[obj.filepath], obj.lineno)
      if comment:
        obj.docstring = griffe.Docstring(comment, lineno=obj.lineno, parent=obj)


def _doc_comment(lines, lineno):
  """The ``#:`` comment lines right above line ``lineno`` (1-based), joined."""
  found = []
  i = lineno - 2
  while i >= 0 and lines[i].lstrip().startswith("#:"):
    found.append(lines[i].lstrip()[2:].strip())
    i -= 1
  return "\n".join(reversed(found))
