"""Tests for `gateway.config.reference`: the reference is the schema ``check-config`` uses.

A recorder (`gateway.config.base.observe_reads`) notes every key the loader
reads while it loads the shipped configurations and one that sets every
declared key; each key read must be declared by the table it was read from
and appear in that table's part of the rendered reference, and each declared
key must be read for some configuration.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docutils.core
import docutils.nodes
import pytest
import zmq

from gateway.config import load_config, load_default_config, reload_routes, reload_secrets
from gateway.config.base import Key, Kind, Section, TableSchema, observe_reads
from gateway.config.reference import PARTS, declared_schemas, render_reference
from tests.certs import make_pki

REPOSITORY = Path(__file__).parents[1]


def _write(path: Path, text: str) -> Path:
    """Write dedented text to a file, creating its directory; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _everything(directory: Path) -> Path:
    """Write a valid configuration that sets every declared key; return its main file.

    A key added to a declaration must be added here too
    (`test_the_everything_config_sets_every_declared_key` says which).
    """
    pki = make_pki(_mkdir(directory / "pki"))
    mtls = (
        f"mtls:0:interface=127.0.0.1:certKey={pki.server_cert}:privateKey={pki.server_key}"
        f":caCerts={pki.ca_cert}"
    )
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    alice_public, _ = zmq.curve_keypair()
    (directory / "mtl.key").write_bytes(server_secret)
    (directory / "client.key").write_bytes(client_secret)
    _write(
        directory / "secrets.toml",
        """
        admin_token = "admin-token"

        [logins]
        alice = "a-secret"
        app = "app-secret"
        "*" = "shared"

        [leases]
        orders-writer = "orders-lease"

        [upstreams]
        central = "central-secret"
        mta = "mta-secret"
        rabbit = "rabbit-secret"
        far-dmp = "app-secret"
        far-mtl = "mtl-secret"

        [frontends.front]
        alice = "alice-at-the-backend"
        "*" = "everybody-else"

        [fleet]
        username = "gateways"
        password = "fleet-secret"
        relay_secret = "a-relay-secret-for-every-node"
        lease_secret = "a-lease-secret-of-32-characters!!"
        """,
    )
    _write(
        directory / "routes" / "mail-to-mta.toml",
        """
        description = "mail for example.org from example.org, to the MTA"
        from = "mail"
        match = "#@example.org"
        match_sender = "#@example.org"
        to = "mta"
        recipients = ["ops@example.org"]
        envelope_sender = "gw@example.org"
        body = "unchanged"
        """,
    )
    return _write(
        directory / "gateway.toml",
        f"""
        [gateway]
        data_dir = "state"
        routes = "routes"
        secrets = "secrets.toml"
        shutdown_grace_seconds = 20

        [log]
        fsync = "interval"
        fsync_interval_seconds = 0.5
        inline_commit_max_bytes = 8192
        segment_bytes = 1048576
        max_bytes = 1073741824
        max_age_seconds = 86400
        record_outcomes = false

        [admin]
        endpoint = "tcp:0:interface=127.0.0.1"
        enabled = true
        allowed_hosts = ["gateway.example.org"]

        [fleet]
        node = "edge-1"
        processes = 1
        amqp = ["tcp:host=rabbit-1.example.org:port=5672", "tcp:host=rabbit-2:port=5672"]
        vhost = "gateways"
        heartbeat_seconds = 15
        unhealthy_after_seconds = 20

        [fleet.streams]
        "orders" = "edge-2"

        [listeners.hub]
        protocol = "ssmp"
        endpoint = "{mtls}"
        max_connections = 100
        max_connections_per_identity = 4
        backlog = 50
        frame_timeout_seconds = 60
        schemes = ["secret", "open", "cert"]
        anonymous = true
        login_timeout_seconds = 5
        ping_interval_seconds = 20
        pong_timeout_seconds = 20
        max_backlog_bytes = 65536
        slow_consumer_policy = "disconnect"
        slow_consumer_seconds = 5
        max_pending_replies = 10
        cert_identity = ["cn", "dns"]

        [listeners.hub.authorize.alice]
        publish = ["weather.#"]
        consume = ["news.*"]

        [listeners.mail]
        protocol = "qmqp"
        endpoint = "tcp:0:interface=127.0.0.1"
        require_auth = true
        max_message_bytes = 1048576
        max_in_flight = 10
        max_in_flight_bytes = 1048576
        idle_timeout_seconds = 60
        login_failure_delay_seconds = 0.5
        login_failure_max_delay_seconds = 10
        login_failures_per_connection = 2
        login_failure_reset_seconds = 300

        [listeners.streams]
        protocol = "stream"
        endpoint = "tcp:0:interface=127.0.0.1"
        advertised_host = "gateway.example.org"
        advertised_port = 5552
        worker_ports = 5562
        guest = true
        anonymous = true
        virtual_hosts = ["/", "test"]
        frame_max = 65536
        heartbeat_seconds = 30
        max_unconfirmed = 100
        handshake_timeout_seconds = 5

        [listeners.dmp]
        protocol = "dmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        sinks = ["orders"]
        feeds = ["alerts"]
        heartbeat_seconds = 5
        idle_timeout_seconds = 300
        handshake_timeout_seconds = 5
        max_envelope_bytes = 65536
        max_in_flight = 10
        principals = ["app"]
        principal_lease_seconds = 30

        [listeners.dmp.leases.orders-writer]
        sink = "orders"
        identity = "alice"

        [listeners.dmp.leases.alerts-reader]
        feed = "alerts"
        expires = "2099-01-01T00:00:00Z"
        text = "alerts-reader-lease"

        [listeners.mtl]
        protocol = "mtl"
        endpoint = "tcp:0:interface=127.0.0.1"
        profiles = ["test", "gateway"]
        require_auth = true
        mechanisms = ["PLAIN", "SCRAM-SHA-256", "EXTERNAL"]
        curve_secret_key_file = "mtl.key"
        curve_client_keys = ["{client_public.decode()}"]
        allow_addresses = ["127.0.0.1", "::1/128"]
        data_port = 0
        max_backlog_messages = 100
        max_in_flight = 500
        ping_interval_seconds = 5
        dead_after_seconds = 15

        [listeners.mtl.curve_identities]
        alice = "{alice_public.decode()}"

        [listeners.front]
        protocol = "frontend"
        endpoint = "{mtls}"
        speaks = "ssmp"
        backend = "tcp:host=127.0.0.1:port=4000"
        connect_timeout_seconds = 5
        handshake_timeout_seconds = 5

        [upstreams.central]
        protocol = "ssmp"
        endpoint = "tcp:host=127.0.0.1:port=9787"
        identity = "gateway-1"
        scheme = "secret"
        subscribe = ["news"]
        presence = true
        ping_interval_seconds = 15
        pong_timeout_seconds = 15
        max_line_bytes = 2048
        max_in_flight = 5

        [upstreams.legacy-mta]
        protocol = "qmqp"
        endpoint = "ssl:host=127.0.0.1:port=9629"
        allow_unverified_tls = true

        [upstreams.mta]
        protocol = "qmqp"
        endpoint = "tcp:host=127.0.0.1:port=9628"
        username = "gateway"
        auth_success_reply = "0"
        window = 10
        max_queue = 100
        max_attempts = 3
        retry_initial_seconds = 0.5
        retry_max_seconds = 10
        max_message_bytes = 65536

        [upstreams.rabbit]
        protocol = "stream"
        endpoint = "tcp:host=127.0.0.1:port=5552"
        username = "gw"
        virtual_host = "test"
        stream = "ticks"
        publisher_reference = "gw1"
        batch_size = 100
        max_unconfirmed = 1000
        max_queue = 10000
        create_streams = true
        subscribe = ["orders"]
        offset = "first"
        consumer_name = "gw1"
        store_offset_interval_seconds = 1
        credit = 5
        consume_from = "replica"
        heartbeat_seconds = 30
        frame_max = 65536

        [upstreams.far-dmp]
        protocol = "dmp"
        endpoint = "tcp:host=127.0.0.1:port=5554"
        mode = "get"
        exchange = "amq.direct"
        heartbeat_seconds = 5
        dead_after_seconds = 30
        max_envelope_bytes = 65536
        max_backlog_bytes = 65536
        principal = "app"
        target = "alerts"

        [upstreams.far-mtl]
        protocol = "mtl"
        endpoint = "tcp:host=127.0.0.1:port=5555"
        mode = "reader"
        profile = "gateway"
        resources = ["orders"]
        confirm = "full"
        username = "alice"
        mechanism = "SCRAM-SHA-256"
        curve_server_key = "{server_public.decode()}"
        curve_secret_key_file = "client.key"
        request_timeout_seconds = 5
        ping_interval_seconds = 5
        dead_after_seconds = 15

        [routes.weather]
        description = "local weather to the central hub, kept on disk"
        from = "hub"
        match = "weather.#"
        to = "central"
        address = "weather.{{1}}"
        body = "escape-lf"
        timeout_seconds = 5
        durable = true
        max_attempts = 3
        dead_letter = "weather.dead-letter"
        """,
    )


def _mkdir(path: Path) -> Path:
    """Make a directory; return it."""
    path.mkdir(parents=True)
    return path


Reads = list[tuple[Section, TableSchema | None, Key[Any]]]


def _recorded(load: Callable[[], object]) -> Reads:
    """Every key read while ``load`` runs: the section, the schema declaring it, the key.

    A key read without a declaration fails here, before the loader's own
    complaint that a configuration setting it has an unknown key.
    """
    reads: Reads = []
    try:
        with observe_reads(lambda section, schema, key: reads.append((section, schema, key))):
            load()
    finally:
        undeclared = [f"{section.key(key.name)}" for section, schema, key in reads if not schema]
        assert undeclared == [], "read without a declaration"
    return reads


def _everything_loads(directory: Path) -> Callable[[], object]:
    """Load the everything config, then reload its routes and secrets as SIGHUP does."""

    def load() -> object:
        config = load_config(_everything(directory))
        return reload_routes(config), reload_secrets(config)

    return load


LOADS: dict[str, Callable[[Path], Callable[[], object]]] = {
    "embedded default": lambda _: load_default_config,
    "etc example": lambda _: lambda: load_config(REPOSITORY / "etc" / "gateway.toml"),
    "everything": _everything_loads,
}
"""The configurations loaded under the recorder, by name."""


def _reference_keys() -> dict[str, set[str]]:
    """The rendered reference, parsed: each section title with the keys its table lists."""
    doctree = docutils.core.publish_doctree(render_reference())
    found: dict[str, set[str]] = {}
    for section in doctree.findall(docutils.nodes.section):
        title = section.next_node(docutils.nodes.title).astext()
        keys = found.setdefault(title, set())
        for table in section.findall(docutils.nodes.table):
            if table.parent is not section:
                continue
            for row in table.findall(docutils.nodes.row):
                keys.add(row.next_node(docutils.nodes.entry).astext())
    return found


@pytest.mark.parametrize("name", sorted(LOADS))
def test_every_key_read_is_declared_and_in_the_reference(tmp_path: Path, name: str) -> None:
    """Each key the loader reads is declared by its table and listed in that table's part."""
    reads = _recorded(LOADS[name](tmp_path))
    assert reads
    reference = _reference_keys()
    for _, schema, key in reads:
        assert schema is not None
        assert key.name in reference.get(schema.title, set()), (schema.title, key.name)


def test_every_declared_key_is_read(tmp_path: Path) -> None:
    """No stale declarations: each declared key is read when some configuration is loaded."""
    read: set[int] = set()
    for name, load in LOADS.items():
        read.update(id(key) for _, _, key in _recorded(load(tmp_path / name)))
    unread = [
        f"{schema.title}: {key.name}"
        for schema in declared_schemas()
        for key in schema.keys
        if id(key) not in read
    ]
    assert unread == []


def test_the_everything_config_sets_every_declared_key(tmp_path: Path) -> None:
    """The synthetic configuration gives each declared key a value, and that value loads."""
    present = {
        id(key)
        for section, _, key in _recorded(_everything_loads(tmp_path))
        if key.name in section.table
    }
    unset = [
        f"{schema.title}: {key.name}"
        for schema in declared_schemas()
        for key in schema.keys
        if id(key) not in present
    ]
    assert unset == []


def test_the_reference_is_valid_restructuredtext() -> None:
    """The reference parses without a docutils warning (reported and halted at level 2)."""
    docutils.core.publish_doctree(
        render_reference(),
        settings_overrides={"report_level": 2, "halt_level": 2, "warning_stream": False},
    )


def test_the_reference_lists_every_declared_table_and_key() -> None:
    """Each declared table is a section of the reference, with a row for each of its keys."""
    reference = _reference_keys()
    for schema in declared_schemas():
        assert reference.get(schema.title) == {"Key"} | {key.name for key in schema.keys}


def test_declarations_are_unique() -> None:
    """A key object belongs to one table, names are unique in a table, titles in the reference."""
    owners: dict[int, str] = {}
    titles: list[str] = []
    for schema in declared_schemas():
        titles.append(schema.title)
        names = [key.name for key in schema.keys]
        assert len(names) == len(set(names)), schema.title
        for key in schema.keys:
            assert owners.setdefault(id(key), schema.title) == schema.title, key.name
    part_titles = [part.title for part in PARTS]
    assert len(set(titles + part_titles)) == len(titles) + len(part_titles)


def test_declared_defaults_fit_their_bounds() -> None:
    """Every default is a value its own key would accept."""
    for schema in declared_schemas():
        for key in schema.keys:
            if key.required or key.default is None:
                continue
            if key.kind in (Kind.INTEGER, Kind.NUMBER):
                assert key.default >= key.minimum, key.name
            elif key.kind is Kind.POSITIVE:
                assert key.default > 0, key.name
            elif key.kind is Kind.CHOICE:
                assert key.default in key.choices, key.name


def test_reference_rows_show_type_default_and_description() -> None:
    """A row reads as the table in the README did: key, type with bound, default, meaning."""
    text = render_reference()
    assert (
        "   * - ``max_backlog_bytes``\n"
        "     - integer ≥ 65536\n"
        "     - ``67108864`` (64 MiB)\n"
        "     - Bytes written to a congested consumer past which it is disconnected"
    ) in text
    assert "   * - ``protocol``\n     - one of ``dmp``, ``frontend``, ``mtl``" in text
    assert "     - *required*\n" in text


def test_the_reference_is_deterministic_and_a_module_run_prints_it() -> None:
    """``python -m gateway.config.reference`` prints exactly what `render_reference` returns."""
    run = subprocess.run(
        [sys.executable, "-m", "gateway.config.reference"],
        capture_output=True,
        check=True,
        cwd=REPOSITORY,
        encoding="utf-8",
        timeout=60,
    )
    assert run.stderr == ""
    assert run.stdout == render_reference() == render_reference()
