"""Address patterns and templates for routes.

Addresses are names such as ``weather.paris``, ``orders`` or (QMQP
recipients) ``ops@example.com``. A pattern is an exact name or a topic
pattern in the AMQP style, with ``.`` and ``@`` separating words: ``*`` stands
for exactly one word and ``#`` for zero or more words (with the separators
between them). So ``*@example.com`` takes any single-word local part at
``example.com`` and ``#@example.com`` any local part. A template builds the
destination address from what the pattern matched: ``{address}`` is the whole
source address and ``{1}``, ``{2}``, ... are the words or word runs that the
wildcards matched, in order.
"""

from __future__ import annotations

import re
from typing import Final

import attrs

__all__ = ["AddressPattern", "AddressTemplate", "PatternError"]

_WORD_CHARS: Final = re.compile(r"[^.@*#]+\Z")
_SEPARATORS: Final = re.compile(r"([.@])")
_FIELD: Final = re.compile(r"\{([^{}]*)\}")


class PatternError(ValueError):
    """An address pattern or template that cannot be used, with the reason."""


def _compile(pattern: str) -> tuple[re.Pattern[str], tuple[bool, ...]]:
    r"""Compile a pattern to a regex matched against ``"." + address``.

    Each word is taken with the separator before it (the first word with an
    implied ``.``): a literal word becomes ``\.word`` or ``@word``, ``*`` the
    separator and one captured word, and ``#`` a captured run of zero or more
    separator-and-word pairs, whose leading separator is stripped from the
    capture afterwards. This keeps ``#`` correct at either end or in the
    middle without special cases.

    Returns:
        The regex, and for each capture whether it is a ``#`` run (whose
        leading separator is to be stripped).
    """
    if not pattern:
        raise PatternError("an address pattern must not be empty")
    tokens = _SEPARATORS.split(pattern)
    parts: list[str] = []
    runs: list[bool] = []
    for index in range(0, len(tokens), 2):
        separator = tokens[index - 1] if index else "."
        word = tokens[index]
        if word == "*":
            parts.append(re.escape(separator) + r"([^.@]+)")
            runs.append(False)
        elif word == "#":
            parts.append(r"((?:[.@][^.@]+)*)")
            runs.append(True)
        elif not word:
            raise PatternError(f"pattern {pattern!r} has an empty word (two separators in a row?)")
        elif not _WORD_CHARS.match(word):
            raise PatternError(
                f"word {word!r} of pattern {pattern!r} mixes wildcards with other characters;"
                " '*' and '#' must stand alone between separators (. or @)"
            )
        else:
            parts.append(re.escape(separator + word))
    return re.compile("".join(parts) + r"\Z"), tuple(runs)


@attrs.frozen
class AddressPattern:
    """A compiled source-address pattern: an exact name, or with ``*`` and ``#``.

    Attributes:
        text: The pattern as written in the route file.
    """

    text: str
    _regex: re.Pattern[str] | None = attrs.field(init=False, eq=False, repr=False)
    _runs: tuple[bool, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        regex, runs = _compile(self.text)  # validates every pattern, exact or not
        wild = "*" in self.text or "#" in self.text
        object.__setattr__(self, "_regex", regex if wild else None)
        object.__setattr__(self, "_runs", runs)

    @property
    def is_exact(self) -> bool:
        """Whether the pattern names exactly one address."""
        return self._regex is None

    @property
    def wildcards(self) -> int:
        """How many wildcards (captures) the pattern has."""
        return 0 if self._regex is None else self._regex.groups

    def match(self, address: str) -> tuple[str, ...] | None:
        """Match an address.

        Returns:
            None if it does not match, else what the wildcards matched
            (an empty string for a ``#`` that matched no words).
        """
        if self._regex is None:
            return () if address == self.text else None
        found = self._regex.match("." + address)
        if found is None:
            return None
        return tuple(
            group[1:] if run else group
            for group, run in zip(found.groups(), self._runs, strict=True)
        )


@attrs.frozen
class AddressTemplate:
    """A destination address built from the source address and wildcard matches.

    Attributes:
        text: The template as written in the route file, e.g. ``archive.{1}``.
    """

    text: str
    _fields: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.text:
            raise PatternError("a destination address must not be empty")
        fields = tuple(_FIELD.findall(self.text))
        for field in fields:
            # ASCII only: str.isdigit() also accepts "²", which int() then refuses.
            if field != "address" and not (field.isascii() and field.isdigit()):
                raise PatternError(
                    f"unknown field {{{field}}}: use {{address}} or {{1}}, {{2}}, ..."
                )
        if "{" in _FIELD.sub("", self.text) or "}" in _FIELD.sub("", self.text):
            raise PatternError(f"template {self.text!r} has an unmatched brace")
        object.__setattr__(self, "_fields", fields)

    def check_against(self, pattern: AddressPattern) -> None:
        """Raise `PatternError` if the template uses a capture the pattern lacks."""
        for field in self._fields:
            if field.isdigit() and not 1 <= int(field) <= pattern.wildcards:
                raise PatternError(
                    f"{{{field}}} refers to a wildcard that pattern {pattern.text!r}"
                    f" does not have (it has {pattern.wildcards})"
                )

    def expand(self, address: str, captures: tuple[str, ...]) -> str:
        """Build the destination address."""
        if not self._fields:
            return self.text

        def substitute(found: re.Match[str]) -> str:
            field = found.group(1)
            return address if field == "address" else captures[int(field) - 1]

        return _FIELD.sub(substitute, self.text)
