"""The shared base of the configuration: declared keys, and a reader that reads through them.

Every key the gateway reads is declared once, as a `Key` in the `TableSchema`
of the TOML table it belongs to: its name, type, default, bounds and a
one-line description. `Section` reads a table only through those
declarations (``section.read(MAX_CONNECTIONS)``), checks each value against
them, and reports what is wrong by file and key path (`ConfigProblem`); keys
that no declaration names are reported as unknown. The same declarations are
what `gateway.config.reference` renders, so the reference cannot leave a key
out. Synapse's ``synapse/config/_base.py`` plays this part there.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import enum
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Generic, TypeVar, cast

import attrs

__all__ = [
    "NAME",
    "ConfigError",
    "ConfigProblem",
    "Key",
    "Kind",
    "Section",
    "TableSchema",
    "boolean",
    "choice",
    "describe",
    "integer",
    "number",
    "observe_reads",
    "optional_string",
    "positive",
    "read_toml",
    "required_choice",
    "required_string",
    "string",
    "string_map",
    "string_maps",
    "strings",
    "table",
    "tables",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
V = TypeVar("V")

NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
"""What a name of the user's choosing (listener, upstream, route) may be."""


# --- errors ------------------------------------------------------------------


@attrs.frozen
class ConfigProblem:
    """One thing wrong with the configuration.

    Attributes:
        file: The file it is in.
        key: The dotted key path (``listeners.hub.endpoint``), or ``-`` for
            the file as a whole.
        reason: What is wrong, and if possible what would be right.
    """

    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        """``file: key: reason``, or ``file: reason`` for the file as a whole."""
        if self.key == "-":
            return f"{self.file}: {self.reason}"
        return f"{self.file}: {self.key}: {self.reason}"


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` says every reason."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


# --- declarations ------------------------------------------------------------


class Kind(enum.Enum):
    """What a key holds: how `Section` reads it and what the reference calls it."""

    STRING = "string"
    BOOLEAN = "boolean"
    INTEGER = "integer"
    NUMBER = "number"
    POSITIVE = "positive number"
    STRINGS = "list of strings"
    CHOICE = "choice"
    TABLE = "table"
    TABLES = "tables"
    STRING_MAP = "table of strings"
    STRING_MAPS = "tables of strings"


SCALARS: Final = frozenset(
    {
        Kind.STRING,
        Kind.BOOLEAN,
        Kind.INTEGER,
        Kind.NUMBER,
        Kind.POSITIVE,
        Kind.STRINGS,
        Kind.CHOICE,
    }
)
"""The kinds `Section.read` reads; the others hold tables."""


@attrs.frozen
class Key(Generic[T_co]):
    """One declared key: what it holds, its default and bounds, and what it means.

    ``T_co`` is what `Section.read` returns for it. Declare keys with the
    functions below (`integer`, `string`, ...), which pick the kind and ``T``.

    Attributes:
        name: The key as written in the file.
        kind: What it holds.
        doc: One line for the reference: what the key does.
        default: The value when the key is absent, or present but invalid
            (None for a required key).
        required: Whether leaving it out is a problem.
        minimum: The least value of an integer or a number.
        choices: The values a choice may take.
        schema: The table a ``table`` key holds, or each table a ``tables``
            key holds.
        shown: How the reference shows the default when the value alone
            would mislead (``0`` meaning "none", say); None: the value.
    """

    name: str
    kind: Kind
    doc: str
    default: Any = None
    required: bool = False
    minimum: float = 0
    choices: frozenset[str] = frozenset()
    schema: TableSchema | None = None
    shown: str | None = None


@attrs.frozen
class TableSchema:
    """The declared keys of one kind of TOML table.

    Attributes:
        title: Its heading in the reference (``SSMP listener``).
        path: How it is written, with NAME standing for a name of the
            user's choosing (``[listeners.NAME]``, ``routes/NAME.toml``).
        keys: Its keys, in the order the reference lists them.
        doc: A paragraph for the reference, before the keys.
    """

    title: str
    path: str
    keys: tuple[Key[Any], ...]
    doc: str = ""

    def names(self) -> frozenset[str]:
        """The names of its keys."""
        return frozenset(key.name for key in self.keys)

    def declares(self, key: Key[Any]) -> bool:
        """Whether this very key is one of its keys."""
        return any(own is key for own in self.keys)


def string(name: str, default: str, *, doc: str, shown: str | None = None) -> Key[str]:
    """Declare a string key with a default."""
    return Key(name, Kind.STRING, doc, default, shown=shown)


def optional_string(name: str, *, doc: str, shown: str | None = None) -> Key[str | None]:
    """Declare a string key that may be left out (then None)."""
    return Key(name, Kind.STRING, doc, None, shown=shown)


def required_string(name: str, *, doc: str) -> Key[str | None]:
    """Declare a string key that must be given, and not empty (None when it is not)."""
    return Key(name, Kind.STRING, doc, None, required=True)


def boolean(name: str, default: bool, *, doc: str) -> Key[bool]:
    """Declare a boolean key."""
    return Key(name, Kind.BOOLEAN, doc, default)


def integer(
    name: str, default: int, *, minimum: int = 0, doc: str, shown: str | None = None
) -> Key[int]:
    """Declare a whole-number key of at least ``minimum``."""
    return Key(name, Kind.INTEGER, doc, default, minimum=minimum, shown=shown)


def number(
    name: str, default: float, *, minimum: float = 0.0, doc: str, shown: str | None = None
) -> Key[float]:
    """Declare a number key (whole or not) of at least ``minimum``."""
    return Key(name, Kind.NUMBER, doc, default, minimum=minimum, shown=shown)


def positive(name: str, default: float, *, doc: str) -> Key[float]:
    """Declare a number key that must be greater than 0."""
    return Key(name, Kind.POSITIVE, doc, default)


def strings(
    name: str, default: tuple[str, ...] = (), *, doc: str, shown: str | None = None
) -> Key[tuple[str, ...]]:
    """Declare a list-of-strings key."""
    return Key(name, Kind.STRINGS, doc, default, shown=shown)


def choice(name: str, choices: frozenset[str], default: str, *, doc: str) -> Key[str]:
    """Declare a key that takes one of a few strings, with a default."""
    return Key(name, Kind.CHOICE, doc, default, choices=choices)


def required_choice(name: str, choices: frozenset[str], *, doc: str) -> Key[str | None]:
    """Declare a key that must take one of a few strings (None when it does not)."""
    return Key(name, Kind.CHOICE, doc, None, required=True, choices=choices)


def table(name: str, schema: TableSchema, *, doc: str) -> Key[object]:
    """Declare a table of declared keys (``[log]``), read with `Section.section`."""
    return Key(name, Kind.TABLE, doc, schema=schema)


def tables(name: str, schema: TableSchema, *, doc: str) -> Key[object]:
    """Declare a table of named tables (``[listeners.NAME]``), read with `Section.table_items`."""
    return Key(name, Kind.TABLES, doc, schema=schema)


def string_map(name: str, *, doc: str) -> Key[object]:
    """Declare a table whose keys are names of the user's choosing, each a string."""
    return Key(name, Kind.STRING_MAP, doc)


def string_maps(name: str, *, doc: str) -> Key[object]:
    """Declare a table of named tables of strings (``[frontends.NAME]``)."""
    return Key(name, Kind.STRING_MAPS, doc)


# --- reading -------------------------------------------------------------------


_ReadObserver = Callable[["Section", TableSchema | None, Key[Any]], None]
_OBSERVER: Final[contextvars.ContextVar[_ReadObserver | None]] = contextvars.ContextVar(
    "gateway.config read observer", default=None
)


@contextlib.contextmanager
def observe_reads(observer: _ReadObserver) -> Iterator[None]:
    """Call ``observer`` with the section, table schema and key of every key read, while inside.

    The schema is the one of the section's schemas that declares the key, or
    None if none does (a key read without being declared: a bug). The
    reference tests record what the loader reads with it.
    """
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


_ABSENT: Final = object()


class Section:
    """A TOML table being read through its declared keys, recording problems by key path.

    Attributes:
        file: The file the table is in.
        path: Its dotted key path (empty for a file's top level).
        table: Its contents.
        problems: Where problems go (shared by every section of a load).
        schemas: What declares its keys (a listener's: the keys every
            listener has, then its protocol's).
    """

    def __init__(
        self,
        file: str,
        path: str,
        table: Mapping[str, Any],
        problems: list[ConfigProblem],
        schemas: tuple[TableSchema, ...] = (),
    ) -> None:
        self.file = file
        self.path = path
        self.table = table
        self.problems = problems
        self.schemas = schemas

    def including(self, schema: TableSchema) -> Section:
        """The same table, with the keys of ``schema`` declared too."""
        return Section(self.file, self.path, self.table, self.problems, (*self.schemas, schema))

    def key(self, name: str) -> str:
        """The dotted path of one of its keys."""
        return f"{self.path}.{name}" if self.path else name

    def problem(self, key: Key[Any] | str | None, reason: str) -> None:
        """Record a problem with one of its keys (None: the table as a whole)."""
        if key is None:
            where = self.path or "-"
        else:
            where = self.key(key if isinstance(key, str) else key.name)
        self.problems.append(ConfigProblem(self.file, where, reason))

    def read(self, key: Key[T]) -> T:
        """Read a declared key: its value, or its default when absent or invalid (a problem)."""
        self._note(key)
        value: Any
        match key.kind:
            case Kind.STRING:
                value = self._string(key)
            case Kind.CHOICE:
                value = self._choice(key)
            case Kind.BOOLEAN:
                value = bool(self._get(key, key.default, bool, "true or false"))
            case Kind.INTEGER:
                value = self._integer(key)
            case Kind.NUMBER | Kind.POSITIVE:
                value = self._number(key)
            case Kind.STRINGS:
                value = self._strings(key)
            case _:
                raise TypeError(f"{key.name!r} holds {key.kind.value}: not a value to read")
        return cast(T, value)

    def section(self, key: Key[Any]) -> Section:
        """The table a ``table`` key holds (empty when absent)."""
        self._note(key)
        content = self._get(key, {}, dict, "a table")
        schemas = (key.schema,) if key.schema is not None else ()
        return Section(self.file, self.key(key.name), content, self.problems, schemas)

    def table_items(self, key: Key[Any]) -> Iterator[tuple[str, Section]]:
        """Each name and table a ``tables`` key holds; a name holding no table is a problem."""
        self._note(key)
        content = self._get(key, {}, dict, "a table")
        schemas = (key.schema,) if key.schema is not None else ()
        for child, value in content.items():
            path = self.key(f"{key.name}.{child}")
            if not isinstance(value, dict):
                reason = f"must be a table, not {describe(value)}"
                self.problems.append(ConfigProblem(self.file, path, reason))
                continue
            yield child, Section(self.file, path, value, self.problems, schemas)

    def string_map(self, key: Key[Any], convert: Callable[[str], V]) -> dict[str, V]:
        """Each entry of a table of strings, converted (a ValueError is a problem)."""
        return self.section(key).entries(convert)

    def string_maps(self, key: Key[Any], convert: Callable[[str], V]) -> dict[str, dict[str, V]]:
        """Each named table of strings under a key, its entries converted."""
        return {name: child.entries(convert) for name, child in self.table_items(key)}

    def entries(self, convert: Callable[[str], V]) -> dict[str, V]:
        """Every entry of this table, each a string that must not be empty, converted."""
        values: dict[str, V] = {}
        for name in self.table:
            text = self._string(Key(name, Kind.STRING, "", required=True))
            if not isinstance(text, str):
                continue
            try:
                values[name] = convert(text)
            except ValueError as exc:
                self.problem(name, str(exc))
        return values

    def done(self) -> None:
        """Report keys that nothing declares here: typos, mostly."""
        known = sorted({name for schema in self.schemas for name in schema.names()})
        for name in self.table:
            if name in known:
                continue
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            self.problem(name, f"unknown key{hint} (known here: {', '.join(known) or 'none'})")

    def _note(self, key: Key[Any]) -> None:
        observer = _OBSERVER.get()
        if observer is not None:
            observer(self, next((s for s in self.schemas if s.declares(key)), None), key)

    def _get(self, key: Key[Any], default: object, kind: type | tuple[type, ...], what: str) -> Any:
        if key.name not in self.table:
            if key.required:
                self.problem(key, f"is required ({what})")
            return default
        value = self.table[key.name]
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            self.problem(key, f"must be {what}, not a boolean")
            return default
        if not isinstance(value, kind):
            self.problem(key, f"must be {what}, not {describe(value)}")
            return default
        return value

    def _string(self, key: Key[Any]) -> Any:
        value = self._get(key, key.default, str, "a string")
        if isinstance(value, str) and not value and key.required:
            self.problem(key, "must not be empty")
        return value

    def _choice(self, key: Key[Any]) -> Any:
        value = self._string(key)
        if isinstance(value, str) and value not in key.choices:
            self.problem(key, f"must be one of {', '.join(sorted(key.choices))}, not {value!r}")
            return key.default
        return value

    def _integer(self, key: Key[Any]) -> int:
        value = self._get(key, _ABSENT, int, "a whole number")
        if value is _ABSENT:
            return int(key.default)
        if value < key.minimum:
            self.problem(key, f"must be at least {int(key.minimum)}, not {value}")
            return int(key.default)
        return int(value)

    def _number(self, key: Key[Any]) -> float:
        value = self._get(key, _ABSENT, (int, float), "a number")
        if value is _ABSENT:
            return float(key.default)
        if key.kind is Kind.POSITIVE and value <= 0:
            self.problem(key, f"must be greater than 0, not {value}")
            return float(key.default)
        if value < key.minimum:
            self.problem(key, f"must be at least {key.minimum:g}, not {value}")
            return float(key.default)
        return float(value)

    def _strings(self, key: Key[Any]) -> tuple[str, ...]:
        value = self._get(key, list(key.default), list, "a list of strings")
        bad = [item for item in value if not isinstance(item, str)]
        if bad:
            self.problem(key, f"must hold only strings, not {describe(bad[0])}")
            return tuple(key.default)
        return tuple(value)


def describe(value: object) -> str:
    """What a TOML value is, for a problem's reason: ``a string ('10')``."""
    kind = {
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "a table",
    }
    return f"{kind.get(type(value), type(value).__name__)} ({value!r})"


def read_toml(path: Path, problems: list[ConfigProblem]) -> dict[str, Any] | None:
    """A TOML file's contents, or None with the reason among ``problems``."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        problems.append(ConfigProblem(str(path), "-", "file not found"))
    except OSError as exc:
        problems.append(ConfigProblem(str(path), "-", f"cannot read: {exc.strerror}"))
    except tomllib.TOMLDecodeError as exc:
        problems.append(ConfigProblem(str(path), "-", f"not valid TOML: {exc}"))
    return None
