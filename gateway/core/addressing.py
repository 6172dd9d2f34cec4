"""Address patterns and templates for routes.

Addresses are names such as ``weather.paris`` or ``orders``. A pattern is an
exact name or a topic pattern in the AMQP style, with ``.`` separating words:
``*`` stands for exactly one word and ``#`` for zero or more words. A template
builds the destination address from what the pattern matched: ``{address}`` is
the whole source address and ``{1}``, ``{2}``, ... are the words or word runs
that the wildcards matched, in order.
"""

from __future__ import annotations

import re
from typing import Final

import attrs

__all__ = ["AddressPattern", "AddressTemplate", "PatternError"]

_WORD_CHARS: Final = re.compile(r"[^.*#]+\Z")
_FIELD: Final = re.compile(r"\{([^{}]*)\}")


class PatternError(ValueError):
    """An address pattern or template that cannot be used, with the reason."""


def _compile(pattern: str) -> re.Pattern[str]:
    r"""Compile a pattern to a regex matched against ``"." + address``.

    Each word becomes ``\\.word``, ``*`` one captured ``\\.word`` and ``#`` a
    captured run of zero or more of them; the leading dot is stripped from
    captures afterwards. This keeps ``#`` correct at either end or in the
    middle without special cases.
    """
    if not pattern:
        raise PatternError("an address pattern must not be empty")
    parts: list[str] = []
    for word in pattern.split("."):
        if word == "*":
            parts.append(r"(\.[^.]+)")
        elif word == "#":
            parts.append(r"((?:\.[^.]+)*)")
        elif not word:
            raise PatternError(f"pattern {pattern!r} has an empty word (two dots in a row?)")
        elif not _WORD_CHARS.match(word):
            raise PatternError(
                f"word {word!r} of pattern {pattern!r} mixes wildcards with other characters;"
                " '*' and '#' must stand alone between dots"
            )
        else:
            parts.append(re.escape("." + word))
    return re.compile("".join(parts) + r"\Z")


@attrs.frozen
class AddressPattern:
    """A compiled source-address pattern: an exact name, or with ``*`` and ``#``.

    Attributes:
        text: The pattern as written in the route file.
    """

    text: str
    _regex: re.Pattern[str] | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        regex = _compile(self.text)  # validates every pattern, exact or not
        wild = "*" in self.text or "#" in self.text
        object.__setattr__(self, "_regex", regex if wild else None)

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
        return tuple(group[1:] for group in found.groups())


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
