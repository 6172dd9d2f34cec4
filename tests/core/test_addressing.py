"""Tests for `gateway.core.addressing`: route patterns and destination templates."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.addressing import AddressPattern, AddressTemplate, PatternError

_words = st.text(alphabet=string.ascii_lowercase + string.digits + "-_", min_size=1, max_size=8)
"""Address words: anything but dots and wildcards (kept short and readable)."""


# --- exact names ---------------------------------------------------------------------


def test_exact_name_matches_only_itself() -> None:
    """A pattern without wildcards matches exactly its own name, with no captures."""
    pattern = AddressPattern("weather.paris")
    assert pattern.is_exact
    assert pattern.wildcards == 0
    assert pattern.match("weather.paris") == ()
    for other in ("weather", "weather.paris.east", "weather.pari", "xweather.paris"):
        assert pattern.match(other) is None


def test_regex_characters_are_literal() -> None:
    """Characters that mean something to regular expressions match only themselves."""
    pattern = AddressPattern("a+b.*")
    assert pattern.match("a+b.c") == ("c",)
    assert pattern.match("aab.c") is None
    assert AddressPattern("a(b)").match("a(b)") == ()


# --- * --------------------------------------------------------------------------------


def test_star_matches_exactly_one_word() -> None:
    """``*`` stands for one word: not zero, not two."""
    pattern = AddressPattern("weather.*")
    assert not pattern.is_exact
    assert pattern.wildcards == 1
    assert pattern.match("weather.paris") == ("paris",)
    assert pattern.match("weather") is None
    assert pattern.match("weather.fr.paris") is None
    assert pattern.match("news.paris") is None


@pytest.mark.parametrize(
    ("pattern", "address", "captures"),
    [
        ("*", "news", ("news",)),
        ("*", "news.today", None),
        ("*.paris", "weather.paris", ("weather",)),
        ("*.paris", "paris", None),
        ("weather.*.today", "weather.paris.today", ("paris",)),
        ("weather.*.today", "weather.today", None),
        ("*.*", "a.b", ("a", "b")),
    ],
)
def test_star_anywhere(pattern: str, address: str, captures: tuple[str, ...] | None) -> None:
    """``*`` works alone, at the start, in the middle and repeated."""
    assert AddressPattern(pattern).match(address) == captures


# --- # --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "captures"),
    [
        ("weather", ("",)),
        ("weather.paris", ("paris",)),
        ("weather.fr.paris", ("fr.paris",)),
    ],
)
def test_hash_at_the_end(address: str, captures: tuple[str, ...]) -> None:
    """``weather.#`` matches weather itself and anything below it (the routes guide's example)."""
    assert AddressPattern("weather.#").match(address) == captures


@pytest.mark.parametrize("address", ["weatherman", "other.weather", "weather-paris"])
def test_hash_does_not_match_inside_a_word(address: str) -> None:
    """``#`` matches whole words only, never part of one."""
    assert AddressPattern("weather.#").match(address) is None


@pytest.mark.parametrize(
    ("pattern", "address", "captures"),
    [
        ("#.paris", "paris", ("",)),
        ("#.paris", "weather.paris", ("weather",)),
        ("#.paris", "weather.fr.paris", ("weather.fr",)),
        ("#.paris", "paris.today", None),
        ("weather.#.today", "weather.today", ("",)),
        ("weather.#.today", "weather.paris.today", ("paris",)),
        ("weather.#.today", "weather.fr.paris.today", ("fr.paris",)),
        ("weather.#.today", "weather.paris", None),
        ("#", "news", ("news",)),
        ("#", "news.fr.today", ("news.fr.today",)),
        ("a.*.#.z", "a.b.z", ("b", "")),
        ("a.*.#.z", "a.b.c.d.z", ("b", "c.d")),
    ],
)
def test_hash_at_start_middle_and_alone(
    pattern: str, address: str, captures: tuple[str, ...] | None
) -> None:
    """``#`` matches zero or more words anywhere; zero words capture ``""``."""
    assert AddressPattern(pattern).match(address) == captures


# --- invalid patterns -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a.*b", "'*' and '#' must stand alone between separators"),
        ("a.#b", "'*' and '#' must stand alone between separators"),
        ("a..b", "empty word (two separators in a row?)"),
        ("a.", "empty word"),
        (".a", "empty word"),
        ("", "must not be empty"),
    ],
)
def test_invalid_patterns_say_why(text: str, reason: str) -> None:
    """A pattern that cannot work raises `PatternError` with a readable reason."""
    with pytest.raises(PatternError) as caught:
        AddressPattern(text)
    assert reason in str(caught.value)
    if text:
        assert repr(text) in str(caught.value)


# --- templates ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{address}", "weather.fr.paris"),
        ("archive.{address}", "archive.weather.fr.paris"),
        ("archive.{1}", "archive.fr"),
        ("{2}.{1}", "paris.fr"),
        ("{1}-{1}", "fr-fr"),
        ("central.weather", "central.weather"),
    ],
)
def test_template_expansion(template: str, expected: str) -> None:
    """``{address}`` is the whole source address, ``{N}`` the N-th capture."""
    pattern = AddressPattern("weather.*.*")
    captures = pattern.match("weather.fr.paris")
    assert captures is not None
    target = AddressTemplate(template)
    target.check_against(pattern)
    assert target.expand("weather.fr.paris", captures) == expected


def test_template_with_hash_capturing_nothing() -> None:
    """A ``#`` that matched no words puts the empty string in its place."""
    pattern = AddressPattern("weather.#")
    captures = pattern.match("weather")
    assert captures == ("",)
    assert AddressTemplate("archive[{1}]").expand("weather", captures) == "archive[]"


@pytest.mark.parametrize("template", ["{foo}", "{}", "a.{address1}", "{-1}", "{1.5}", "{²}"])
def test_unknown_template_fields(template: str) -> None:
    """Only ``{address}`` and ``{1}``, ``{2}``, ... are fields; others are named."""
    with pytest.raises(PatternError, match="unknown field"):
        AddressTemplate(template)


@pytest.mark.parametrize("template", ["{1", "1}", "a.{address", "x{{1}}", "}{"])
def test_unmatched_braces(template: str) -> None:
    """A lone ``{`` or ``}`` is refused rather than copied into addresses."""
    with pytest.raises(PatternError, match="unmatched brace"):
        AddressTemplate(template)


def test_empty_template() -> None:
    """An empty destination address is refused."""
    with pytest.raises(PatternError, match="must not be empty"):
        AddressTemplate("")


@pytest.mark.parametrize(
    ("template", "pattern", "has"),
    [
        ("{2}", "weather.*", 1),
        ("{1}", "weather.paris", 0),
        ("{0}", "weather.*", 1),
        ("{1}.{3}", "*.#", 2),
    ],
)
def test_check_against_a_pattern_with_too_few_wildcards(
    template: str, pattern: str, has: int
) -> None:
    """A template may use only captures its route's pattern has; the error counts them."""
    with pytest.raises(PatternError) as caught:
        AddressTemplate(template).check_against(AddressPattern(pattern))
    message = str(caught.value)
    assert "refers to a wildcard" in message
    assert repr(pattern) in message
    assert f"it has {has}" in message


def test_check_against_accepts_what_the_pattern_has() -> None:
    """``{address}`` fits every pattern; ``{N}`` fits a pattern with N wildcards."""
    AddressTemplate("{address}").check_against(AddressPattern("exact"))
    AddressTemplate("{2}.{1}").check_against(AddressPattern("*.#"))


# --- properties -----------------------------------------------------------------------


@given(st.data(), st.lists(_words, min_size=1, max_size=6))
def test_stars_capture_the_words_they_replace(data: st.DataObject, words: list[str]) -> None:
    """Replacing any words of a name by ``*`` gives a pattern capturing those words.

    A template naming every capture in order then rebuilds exactly those words.
    """
    replaced = data.draw(st.sets(st.sampled_from(range(len(words)))), label="replaced")
    pattern = AddressPattern(
        ".".join("*" if i in replaced else word for i, word in enumerate(words))
    )
    address = ".".join(words)
    expected = tuple(words[i] for i in sorted(replaced))
    assert pattern.match(address) == expected
    assert pattern.wildcards == len(expected)
    assert pattern.is_exact == (not expected)
    if expected:
        template = AddressTemplate(".".join(f"{{{n}}}" for n in range(1, len(expected) + 1)))
        template.check_against(pattern)
        assert template.expand(address, expected) == ".".join(expected)


@given(st.data(), st.lists(_words, min_size=1, max_size=6))
def test_hash_captures_the_run_it_replaces(data: st.DataObject, words: list[str]) -> None:
    """Replacing a run of words (maybe empty) by ``#`` captures the run joined by dots."""
    start = data.draw(st.integers(0, len(words)), label="start")
    end = data.draw(st.integers(start, len(words)), label="end")
    pattern = AddressPattern(".".join([*words[:start], "#", *words[end:]]))
    address = ".".join(words)
    assert pattern.match(address) == (".".join(words[start:end]),)


@pytest.mark.parametrize(
    ("pattern", "address", "captures"),
    [
        ("*@example.com", "bob@example.com", ("bob",)),
        ("*@example.com", "bob.smith@example.com", None),
        ("#@example.com", "bob.smith@example.com", ("bob.smith",)),
        ("*@*.example.com", "ops@mail.example.com", ("ops", "mail")),
        ("*@example.com", "bob@mail.example.com", None),
        ("#", "bob@example.com", ("bob@example.com",)),
        ("ops@example.com", "ops@example.com", ()),
        ("alerts.#", "alerts.disk@host1", ("disk@host1",)),
    ],
)
def test_at_sign_separates_words(
    pattern: str, address: str, captures: tuple[str, ...] | None
) -> None:
    """'@' separates words like '.', so recipient addresses match by local part and domain."""
    assert AddressPattern(pattern).match(address) == captures


def test_at_sign_template() -> None:
    """A recipient's local part can become part of a topic."""
    pattern = AddressPattern("#@alerts.example.com")
    template = AddressTemplate("alerts.{1}")
    template.check_against(pattern)
    captures = pattern.match("disk.full@alerts.example.com")
    assert captures is not None
    assert template.expand("disk.full@alerts.example.com", captures) == "alerts.disk.full"
