"""``msggateway init``: a configuration to start from, written into a directory.

The examples ship in the package, ``gateway/examples`` (the checkout's
``etc/``): the starter (``etc/gateway.toml`` with its ``routes/`` and
``secrets.toml``), one directory per use case, each with a ``gateway.toml``
whose first line says what it does, and the embedded default
(``gateway/default.toml``). ``init DIR`` writes one of them into DIR, with
the systemd unit, made for this install:

- ``/etc/msggateway``, where the examples say their files are, becomes DIR,
  and their ``data_dir`` becomes ``--data-dir`` (``/var/lib/msggateway``,
  the unit's state directory, by default);
- the unit runs this install's ``twistd`` on DIR's ``gateway.toml``;
- every secret that is a placeholder (``"change-me-..."``) becomes a random
  one, and the secrets file is readable by its owner only (mode 0600).

Files already in DIR are left alone unless ``--force``. ``--list`` names the
examples; ``--print [NAME]`` prints one's main file as shipped (by default
the embedded default, what ``twistd msggateway`` runs without ``--config``).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import IO, Final, TextIO

import attrs

from gateway.cli.arguments import Commands
from gateway.cli.errors import CommandError, UsageError

__all__ = ["DEFAULT", "STARTER", "Example", "add_commands", "examples", "write_example"]

STARTER: Final = "starter"
"""The example ``init`` writes unless told otherwise: the checkout's etc/gateway.toml."""
DEFAULT: Final = "default"
"""The embedded default, as an example."""
DEFAULT_DATA_DIR: Final = "/var/lib/msggateway"
"""Where the examples and the unit keep the gateway's state."""
INSTALL_DIR: Final = "/etc/msggateway"
"""Where the examples say their own files are."""
UNIT: Final = "msggateway.service"
SECRETS: Final = "secrets.toml"
_DESCRIPTION_PREFIX: Final = "# msggateway example: "
_PLACEHOLDER: Final = re.compile(r'"change-me-[^"\n]*"')
_DATA_DIR_LINE: Final = re.compile(r'(?m)^data_dir = "[^"\n]*"')
_SHIPPED_PATHS: Final = re.compile(f"{re.escape(INSTALL_DIR)}|{re.escape(DEFAULT_DATA_DIR)}")
_TWISTD_IN_UNIT: Final = "/opt/msggateway/bin/twistd"
_SECRETS_MODE: Final = 0o600


@attrs.frozen
class Example:
    """One configuration ``init`` can write.

    Attributes:
        name: What ``--example`` calls it.
        description: One line saying what it does.
        files: Each file's path under DIR and where its text is.
    """

    name: str
    description: str
    files: tuple[tuple[str, Traversable], ...]

    @property
    def main(self) -> Traversable:
        """Its ``gateway.toml``."""
        return dict(self.files)["gateway.toml"]


def _shipped() -> Traversable:
    return resources.files("gateway").joinpath("examples")


def _description(main: Traversable) -> str:
    first = main.read_text("utf-8").partition("\n")[0]
    return first.removeprefix(_DESCRIPTION_PREFIX).rstrip(".")


def _directory_files(directory: Traversable) -> Iterator[tuple[str, Traversable]]:
    """A configuration directory's main file, secrets file and route files."""
    for name in ("gateway.toml", SECRETS):
        item = directory.joinpath(name)
        if item.is_file():
            yield name, item
    routes = directory.joinpath("routes")
    if routes.is_dir():
        for item in sorted(routes.iterdir(), key=lambda item: item.name):
            if item.name.endswith(".toml"):
                yield f"routes/{item.name}", item


def examples() -> dict[str, Example]:
    """Every example, the starter first, then the use cases, then the embedded default."""
    shipped = _shipped()
    unit = (UNIT, shipped.joinpath(UNIT))
    found = {STARTER: Example(STARTER, "", (*_directory_files(shipped), unit))}
    for directory in sorted(shipped.iterdir(), key=lambda item: item.name):
        if directory.is_dir() and directory.joinpath("gateway.toml").is_file():
            files = (*_directory_files(directory), unit)
            found[directory.name] = Example(directory.name, "", files)
    default = resources.files("gateway").joinpath("default.toml")
    found[DEFAULT] = Example(
        DEFAULT,
        "the embedded default: every protocol on loopback, nothing external (what twistd"
        " msggateway runs without --config)",
        (("gateway.toml", default), unit),
    )
    return {
        name: example
        if example.description
        else attrs.evolve(example, description=_description(example.main))
        for name, example in found.items()
    }


def add_commands(commands: Commands) -> None:
    """Add ``init``."""
    init = commands.add_parser(
        "init",
        help="write a configuration to start from (config, routes, secrets, unit) into DIR",
        description="Write an example configuration into DIR: gateway.toml, its routes/ and"
        " secrets.toml, and msggateway.service, a systemd unit that runs this install on it."
        " Paths under /etc/msggateway become DIR's, data_dir becomes --data-dir, and"
        " placeholder secrets (change-me-...) become random ones in a file only its owner may"
        " read. Files already in DIR are kept unless --force. Then check-config and run take"
        " DIR/gateway.toml.",
    )
    init.add_argument("directory", nargs="?", metavar="DIR", help="where the files go")
    init.add_argument(
        "--example",
        default=STARTER,
        metavar="NAME",
        help=f"which example (default: {STARTER}; --list names them all)",
    )
    init.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        metavar="PATH",
        help="where the gateway is to keep its state: the embedded log, its node id, its admin"
        f" token (default: {DEFAULT_DATA_DIR}, the unit's state directory)",
    )
    init.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    only = init.add_mutually_exclusive_group()
    only.add_argument("--list", action="store_true", help="list the examples, and stop")
    only.add_argument(
        "--print",
        nargs="?",
        const=DEFAULT,
        dest="print_example",
        metavar="NAME",
        help=f"print an example's main file as shipped (default: {DEFAULT}, the embedded"
        " default), and stop",
    )
    init.set_defaults(run=_run)


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    known = examples()
    if args.list:
        width = max(map(len, known))
        for name, example in known.items():
            out.write(f"{name:<{width}}  {example.description}\n")
        return 0
    if args.print_example is not None:
        out.write(_example(known, args.print_example).main.read_text("utf-8"))
        return 0
    if args.directory is None:
        raise UsageError("init needs DIR (or --list, or --print)")
    example = _example(known, args.example)
    directory = Path(args.directory).absolute()
    written = write_example(
        example, directory, Path(args.data_dir).absolute(), _twistd(), force=args.force
    )
    for path, note in written:
        out.write(f"wrote {path}{note}\n")
    _report(directory / "gateway.toml", out, err)
    return 0


def _example(known: dict[str, Example], name: str) -> Example:
    if name not in known:
        raise UsageError(f"no example {name!r} (known: {', '.join(known)})")
    return known[name]


def _twistd() -> str:
    """This install's twistd (next to its Python), for the unit's ExecStart."""
    beside = Path(sys.executable).with_name("twistd")
    if beside.exists():
        return str(beside)
    return shutil.which("twistd") or _TWISTD_IN_UNIT


def write_example(
    example: Example, directory: Path, data_dir: Path, twistd: str, *, force: bool = False
) -> list[tuple[Path, str]]:
    """Write ``example`` into ``directory``; return each file written, with a note.

    Args:
        example: What to write.
        directory: Where (made if needed); absolute.
        data_dir: The gateway's state directory for the configuration and
            the unit; absolute.
        twistd: The unit's twistd.
        force: Overwrite files that are there.

    Raises:
        CommandError: Files are there (without ``force``), or cannot be written.
    """
    targets = [(directory / relative, source) for relative, source in example.files]
    there = [str(path) for path, _ in targets if path.exists()]
    if there and not force:
        raise CommandError(f"not overwriting {', '.join(there)} (--force would)")
    written: list[tuple[Path, str]] = []
    try:
        for path, source in targets:
            text = _made_for(source.read_text("utf-8"), directory, data_dir)
            note = ""
            if path.name == UNIT:
                text = text.replace(_TWISTD_IN_UNIT, twistd)
            if path.name == SECRETS:
                text, count = _PLACEHOLDER.subn(lambda _: f'"{secrets.token_urlsafe(24)}"', text)
                note = f" (mode 0600; {count} new random secret(s))" if count else " (mode 0600)"
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, text, private=path.name == SECRETS)
            written.append((path, note))
    except OSError as exc:
        raise CommandError(f"cannot write {exc.filename}: {exc.strerror}") from None
    return written


def _made_for(text: str, directory: Path, data_dir: Path) -> str:
    """An example's text with its paths made this directory's and data dir's (in one pass)."""
    paths = {INSTALL_DIR: str(directory), DEFAULT_DATA_DIR: str(data_dir)}
    text = _SHIPPED_PATHS.sub(lambda found: paths[found.group(0)], text)
    return _DATA_DIR_LINE.sub(lambda _: f"data_dir = {_toml_string(str(data_dir))}", text)


def _toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _write(path: Path, text: str, *, private: bool) -> None:
    """Write ``text``; a private file is made readable by its owner only, whatever the umask."""
    mode = _SECRETS_MODE if private else 0o644
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        if private:
            os.fchmod(descriptor, mode)
        file.write(text)


def _report(main: Path, out: TextIO, err: TextIO) -> None:
    """Check what was written; say what is left to do, and how to run it."""
    from gateway.config import ConfigError, load_config

    try:
        summary = load_config(main).summary()
    except ConfigError as exc:
        err.write("before it starts, these need your attention:\n")
        for problem in exc.problems:
            err.write(f"  {problem}\n")
    else:
        out.write(f"{summary}\n")
    out.write(
        f"next: msggateway run --config {main}  (in the foreground); under systemd, see the"
        f" first lines of {main.with_name(UNIT)}\n"
    )
