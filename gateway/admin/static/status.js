// msggateway status page: reads the admin API's JSON every few seconds and shows it as
// tables; rates are computed here from two successive answers. The live tap reads /tap
// (newline-delimited JSON, streamed) with the admin token the user gives, which is kept
// in sessionStorage only (this tab, until it closes). No library, no build step.
"use strict";

(() => {
  const TOKEN_KEY = "msggateway.admin-token";
  const TAP_ROWS = 100; // envelopes shown; older ones scroll away
  const TAP_MAX_RECORDS = 200; // what the gateway keeps for us while we are behind
  const STATUS_PATHS = ["healthz", "routes", "listeners", "upstreams", "streams", "nodes"];

  const $ = (id) => document.getElementById(id);
  const previous = new Map(); // "table/name" -> {time, values}
  let timer = null;
  let tapController = null;

  // --- formatting -----------------------------------------------------------------------

  const count = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const rate = (n) => {
    if (n === null || n === undefined) return "–";
    if (n === 0) return "0";
    return n < 10 ? n.toFixed(1) : Math.round(n).toLocaleString("en-US");
  };
  const bytes = (n) => {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = Number(n);
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return (unit === 0 ? String(value) : value.toFixed(1)) + " " + units[unit];
  };
  const seconds = (n) => {
    if (n === null || n === undefined) return "–";
    if (n % 86400 === 0) return n / 86400 + " d";
    if (n % 3600 === 0) return n / 3600 + " h";
    return n + " s";
  };
  const clock = (unix) => new Date(unix * 1000).toISOString().slice(11, 23);

  // --- rates from successive samples --------------------------------------------------

  function rates(table, name, values, now) {
    const key = table + "/" + name;
    const before = previous.get(key);
    previous.set(key, { time: now, values });
    const found = {};
    if (!before || now <= before.time) return found;
    const elapsed = (now - before.time) / 1000;
    for (const [field, value] of Object.entries(values)) {
      const old = before.values[field];
      if (typeof value === "number" && typeof old === "number") {
        found[field] = Math.max(0, (value - old) / elapsed); // a reload may reset a count
      }
    }
    return found;
  }

  // --- tables -----------------------------------------------------------------------------

  // A column: [key, heading, how to show a row's value, "num" for numbers].
  function renderTable(table, columns, rows, empty) {
    const head = document.createElement("thead");
    const headRow = head.insertRow();
    for (const [key, heading, , kind] of columns) {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = heading;
      th.dataset.key = key;
      if (kind === "num") th.className = "num";
      headRow.appendChild(th);
    }
    const body = document.createElement("tbody");
    if (!rows.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = columns.length;
      cell.className = "empty";
      cell.textContent = empty;
    }
    for (const row of rows) {
      const tr = body.insertRow();
      tr.dataset.name = row.name;
      for (const [key, , show, kind] of columns) {
        const td = tr.insertCell();
        td.dataset.key = key;
        const shown = show(row);
        if (shown instanceof Node) {
          td.appendChild(shown);
        } else {
          td.textContent = shown;
        }
        const raw = row[key];
        if (typeof raw === "number") td.dataset.value = String(raw);
        if (kind === "num") td.classList.add("num");
        if (kind === "wrap") td.classList.add("wrap");
      }
    }
    table.replaceChildren(head, body);
  }

  function state(text, kind) {
    const span = document.createElement("span");
    span.className = "state state-" + kind;
    span.textContent = text;
    return span;
  }

  const LISTENERS = [
    ["name", "Listener", (r) => r.name],
    ["protocol", "Protocol", (r) => r.protocol + (r.tls ? " (TLS)" : "")],
    ["address", "Address", (r) => r.address || "–"],
    ["listening", "State", (r) => (r.listening ? state("listening", "ok") : state("not listening", "bad"))],
    ["connections", "Connections", (r) => count(r.connections), "num"],
    ["messages_in_rate", "In /s", (r) => rate(r.messages_in_rate), "num"],
    ["messages_out_rate", "Out /s", (r) => rate(r.messages_out_rate), "num"],
    ["bytes_in_rate", "Bytes in /s", (r) => (r.bytes_in_rate === undefined ? "–" : bytes(Math.round(r.bytes_in_rate))), "num"],
    ["messages_in", "Messages in", (r) => count(r.messages_in), "num"],
    ["messages_out", "Messages out", (r) => count(r.messages_out), "num"],
    ["connections_opened", "Opened", (r) => count(r.connections_opened), "num"],
    ["protocol_errors", "Errors", (r) => count(r.protocol_errors), "num"],
    ["login_failures", "Refused logins", (r) => count(r.login_failures), "num"],
    ["slow_consumer_disconnects", "Slow cut", (r) => count(r.slow_consumer_disconnects), "num"],
  ];

  const ROUTES = [
    ["name", "Route", (r) => r.name],
    ["path", "From → to", (r) => r.source + " → " + r.destination + (r.durable ? " (durable)" : "")],
    ["pattern", "Match", (r) => r.pattern + (r.target ? " → " + r.target : ""), "wrap"],
    ["messages_rate", "Messages /s", (r) => rate(r.messages_rate), "num"],
    ["messages", "Messages", (r) => count(r.messages), "num"],
    ["accepted", "Accepted", (r) => count(r.accepted), "num"],
    ["retry", "Retry", (r) => count(r.retry), "num"],
    ["rejected", "Rejected", (r) => count(r.rejected), "num"],
    ["refused_rate", "Refused /s", (r) => rate(r.refused_rate), "num"],
    ["in_flight", "In flight", (r) => count(r.in_flight), "num"],
    ["lag", "Forwarder lag", (r) => (r.forwarder ? count(r.lag) : "–"), "num"],
  ];

  const UPSTREAM_STATES = { connected: "ok", connecting: "warn", standby: "idle", stopped: "bad" };
  const UPSTREAMS = [
    ["name", "Upstream", (r) => r.name],
    ["protocol", "Protocol", (r) => r.protocol],
    ["address", "Address", (r) => r.address, "wrap"],
    ["state", "State", (r) => state(r.state, UPSTREAM_STATES[r.state] || "idle")],
    ["reconnects", "Reconnects", (r) => count(r.reconnects), "num"],
    ["messages_in_rate", "In /s", (r) => rate(r.messages_in_rate), "num"],
    ["messages_out_rate", "Out /s", (r) => rate(r.messages_out_rate), "num"],
    ["messages_in", "Messages in", (r) => count(r.messages_in), "num"],
    ["messages_out", "Messages out", (r) => count(r.messages_out), "num"],
    ["protocol_errors", "Errors", (r) => count(r.protocol_errors), "num"],
  ];

  const retention = (r) => {
    const kept = [];
    if (r.retention.max_bytes) kept.push(bytes(r.retention.max_bytes));
    if (r.retention.max_age_seconds) kept.push(seconds(r.retention.max_age_seconds));
    return (kept.length ? kept.join(", ") : "forever") + " (segments of " +
      bytes(r.retention.max_segment_bytes) + ")";
  };
  const STREAMS = [
    ["name", "Stream", (r) => r.name, "wrap"],
    ["first_offset", "First offset", (r) => count(r.first_offset), "num"],
    ["last_offset", "Last offset", (r) => count(r.last_offset), "num"],
    ["messages_rate", "Appended /s", (r) => rate(r.messages_rate), "num"],
    ["disk_bytes", "Size", (r) => bytes(r.disk_bytes), "num"],
    ["segments", "Segments", (r) => count(r.segments), "num"],
    ["retention", "Retention", retention],
    ["owner", "Owner", (r) => r.owner || "none"],
  ];

  const NODES = [
    ["name", "Node", (r) => r.name + (r.this ? " (this one)" : "")],
    ["version", "Version", (r) => r.version || "–"],
    ["started", "Started", (r) => (r.started ? new Date(r.started * 1000).toISOString().slice(0, 19) + "Z" : "–")],
    ["config", "Configuration", (r) => (r.config_matches ? state("same", "ok") : state("differs", "warn"))],
    ["listeners", "Listeners", (r) => Object.entries(r.listeners).map(([n, a]) => n + " " + a).join(", "), "wrap"],
  ];

  // --- the status, every few seconds ----------------------------------------------------

  async function fetchJSON(path) {
    const response = await fetch(path, { cache: "no-store", headers: { Accept: "application/json" } });
    if (!response.ok && response.status !== 503) {
      throw new Error(path + " answered " + response.status);
    }
    return response.json();
  }

  function withRates(table, rows, fields, now) {
    return rows.map((row) => {
      const values = {};
      for (const field of fields) values[field] = row[field];
      const found = rates(table, row.name, values, now);
      const shown = { ...row };
      for (const field of fields) shown[field + "_rate"] = found[field];
      return shown;
    });
  }

  function setText(id, text) {
    const element = $(id);
    if (element.textContent !== text) element.textContent = text;
  }

  async function refresh() {
    let answers;
    try {
      answers = await Promise.all(STATUS_PATHS.map(fetchJSON));
    } catch (error) {
      const problem = $("problem");
      problem.textContent = "Cannot read the gateway's status: " + error.message +
        ". The numbers below are from the last answer.";
      problem.hidden = false;
      return;
    }
    $("problem").hidden = true;
    const now = Date.now();
    const [health, routes, listeners, upstreams, streams, nodes] = answers;

    const HEALTH = { ok: "ok", degraded: "warn", unavailable: "bad" };
    const healthLine = $("health");
    healthLine.className = "state state-" + (HEALTH[health.status] || "idle");
    healthLine.textContent = health.status + (health.reason ? ": " + health.reason : "");

    const self = nodes.find((node) => node.this);
    if (self) {
      setText("node", self.node);
      setText("version", self.version ? "· version " + self.version : "");
    }

    const listenerRows = withRates("listeners", listeners,
      ["messages_in", "messages_out", "bytes_in"], now);
    renderTable($("listeners"), LISTENERS, listenerRows, "No listeners.");

    const routeRows = withRates("routes", routes.map((route) => ({
      ...route,
      accepted: route.outcomes.accepted,
      retry: route.outcomes.retry,
      rejected: route.outcomes.rejected,
      refused: route.outcomes.retry + route.outcomes.rejected,
      lag: route.forwarder ? route.forwarder.lag : null,
    })), ["messages", "refused"], now);
    renderTable($("routes"), ROUTES, routeRows, "No routes.");

    const upstreamRows = withRates("upstreams", upstreams, ["messages_in", "messages_out"], now);
    renderTable($("upstreams"), UPSTREAMS, upstreamRows, "No upstreams.");

    const streamRows = withRates("streams", streams, ["messages"], now);
    renderTable($("streams"), STREAMS, streamRows,
      "No log streams (the embedded log opens with a durable route or a stream listener).");

    const inFleet = nodes.some((node) => node.fleet);
    $("nodes-section").hidden = !inFleet;
    if (inFleet) {
      renderTable($("nodes"), NODES, nodes.map((node) => ({ ...node, name: node.node })), "");
    }

    const sum = (rows, field) => rows.reduce((total, row) => total + (row[field] || 0), 0);
    const known = (rows, field) => rows.length && rows.every((row) => row[field] !== undefined);
    const endpoints = listenerRows.concat(upstreamRows);
    setText("total-connections", count(sum(listenerRows, "connections")));
    setText("total-in-rate", known(endpoints, "messages_in_rate") ? rate(sum(endpoints, "messages_in_rate")) : "–");
    setText("total-out-rate", known(endpoints, "messages_out_rate") ? rate(sum(endpoints, "messages_out_rate")) : "–");
    setText("total-routed-rate", known(routeRows, "messages_rate") ? rate(sum(routeRows, "messages_rate")) : "–");
    setText("total-routed", count(sum(routeRows, "messages")));
    $("total-routed").dataset.value = String(sum(routeRows, "messages"));
    setText("total-lag", count(sum(routeRows, "lag")));
    setText("updated", "updated " + new Date(now).toLocaleTimeString("en-GB"));

    updateTargets(routes, listeners, upstreams);
  }

  function schedule() {
    clearTimeout(timer);
    const every = Number($("refresh").value);
    if (every > 0) {
      timer = setTimeout(() => {
        refresh().finally(schedule);
      }, every * 1000);
    }
  }

  // --- the live tap ---------------------------------------------------------------------

  function updateTargets(routes, listeners, upstreams) {
    const select = $("tap-target");
    const wanted = [
      ["Routes", routes.map((r) => ["route", r.name])],
      ["Listeners", listeners.map((r) => ["listener", r.name])],
      ["Upstreams", upstreams.map((r) => ["listener", r.name])],
    ];
    const signature = JSON.stringify(wanted);
    if (select.dataset.signature === signature) return;
    const chosen = select.value;
    select.replaceChildren();
    for (const [label, options] of wanted) {
      if (!options.length) continue;
      const group = document.createElement("optgroup");
      group.label = label;
      for (const [kind, name] of options) {
        const option = document.createElement("option");
        option.value = kind + ":" + name;
        option.textContent = name;
        group.appendChild(option);
      }
      select.appendChild(group);
    }
    if (chosen) select.value = chosen;
    select.dataset.signature = signature;
  }

  function showToken() {
    const has = sessionStorage.getItem(TOKEN_KEY) !== null;
    $("token-form").hidden = has;
    $("token-set").hidden = !has;
  }

  // The counts change every second: they are shown, and only the rest is announced.
  function tapStatus(text, quiet = false) {
    $("tap-status").textContent = text;
    if (!quiet) $("tap-announce").textContent = text;
  }

  const TAP_COLUMNS = [
    ["time", "Time", (r) => clock(r.time)],
    ["from", "From", (r) => r.listener + ":" + (r.recipients && r.recipients.length ? r.recipients[0] : r.address), "wrap"],
    ["to", "Routes", (r) => (r.routes.length ? r.routes.map((x) => x.route + " → " + (x.destination || "?") + (x.address ? ":" + x.address : "")).join(", ") : "(no route)"), "wrap"],
    ["id", "Id", (r) => r.id || "–"],
    ["sender", "Sender", (r) => r.sender || "–"],
    ["size", "Size", (r) => bytes(r.size), "num"],
    ["outcome", "Outcome", (r) => r.outcome],
  ];

  function tapHeader() {
    renderTable($("tap"), TAP_COLUMNS, [], "Waiting for messages…");
  }

  function tapRow(record) {
    const body = $("tap").tBodies[0];
    const placeholder = body.querySelector("td.empty");
    if (placeholder) placeholder.parentElement.remove();
    const tr = document.createElement("tr");
    tr.dataset.name = record.id || "";
    for (const [key, , show, kind] of TAP_COLUMNS) {
      const td = tr.insertCell();
      td.dataset.key = key;
      td.textContent = show(record);
      if (kind === "num") td.className = "num";
      if (kind === "wrap") td.className = "wrap";
      if (key === "outcome") td.className = "outcome-" + record.outcome;
    }
    body.insertBefore(tr, body.firstChild);
    while (body.rows.length > TAP_ROWS) body.deleteRow(-1);
  }

  function counts(record) {
    return count(record.seen) + " seen, " + count(record.shown) + " shown, " +
      count(record.sampled_out) + " left out by the cap, " + count(record.dropped) + " dropped";
  }

  function tapLine(line, what) {
    if (!line.trim()) return;
    const record = JSON.parse(line);
    if ("id" in record) {
      tapRow(record);
    } else if ("end" in record) {
      tapStatus("The gateway ended the tap of " + what + ": " + record.end + " (" + counts(record) + ").");
    } else if ("tap" in record) {
      tapStatus("Tapping " + what + "; at most " + record.tap.per_second + " a second.");
    } else if ("seen" in record) {
      tapStatus("Tapping " + what + ": " + counts(record) + ".", true);
    }
  }

  async function startTap(event) {
    event.preventDefault();
    stopTap();
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token === null) {
      tapStatus("Give the admin token first.");
      $("token").focus();
      return;
    }
    const [kind, name] = $("tap-target").value.split(/:(.*)/s);
    if (!name) return;
    const what = kind + " " + name;
    const query = new URLSearchParams({ [kind]: name, per_second: $("tap-rate").value, max: TAP_MAX_RECORDS });
    const match = $("tap-match").value.trim();
    if (match) query.set("match", match);
    const controller = new AbortController();
    tapController = controller;
    $("tap-start").disabled = true;
    $("tap-stop").disabled = false;
    tapHeader();
    tapStatus("Starting the tap of " + what + "…");
    try {
      const response = await fetch("tap?" + query, {
        headers: { Authorization: "Bearer " + token, Accept: "application/x-ndjson" },
        cache: "no-store",
        signal: controller.signal,
      });
      if (!response.ok) {
        const answer = await response.json().catch(() => ({}));
        if (response.status === 401) {
          sessionStorage.removeItem(TOKEN_KEY);
          showToken();
        }
        tapStatus("The gateway refused the tap (" + response.status + "): " + (answer.error || response.statusText) + ".");
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        pending += decoder.decode(value, { stream: true });
        const lines = pending.split("\n");
        pending = lines.pop();
        for (const line of lines) tapLine(line, what);
      }
    } catch (error) {
      if (error.name !== "AbortError") tapStatus("The tap broke off: " + error.message + ".");
    } finally {
      if (tapController === controller) {
        tapController = null;
        $("tap-start").disabled = false;
        $("tap-stop").disabled = true;
      }
    }
  }

  function stopTap() {
    if (tapController !== null) {
      tapController.abort();
      tapController = null;
      tapStatus("Tap stopped.");
    }
    $("tap-start").disabled = false;
    $("tap-stop").disabled = true;
  }

  // --- start ----------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    const asked = new URLSearchParams(location.search).get("refresh");
    if (asked !== null && [...$("refresh").options].some((o) => o.value === asked)) {
      $("refresh").value = asked;
    }
    $("refresh").addEventListener("change", () => {
      schedule();
    });
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("token").value = "";
      showToken();
      tapStatus(value ? "Token set: choose what to watch and start." : "Not tapping.");
    });
    $("token-forget").addEventListener("click", () => {
      stopTap();
      sessionStorage.removeItem(TOKEN_KEY);
      showToken();
    });
    $("tap-form").addEventListener("submit", startTap);
    $("tap-stop").addEventListener("click", stopTap);
    showToken();
    tapHeader();
    $("tap").tBodies[0].rows[0].cells[0].textContent = "Choose a route or listener and start.";
    refresh().finally(schedule);
  });
})();
