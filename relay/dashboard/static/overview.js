// The overview, live: polls /api/overview and updates the numbers and charts in place.
// Text goes in with textContent only: topics and figures are data, never markup.
"use strict";
(function () {
  const EVERY_MS = 3000;
  const COLUMNS = ["pending", "oldest_pending_age_s", "scheduled", "dead", "blocked_keys", "sent_1h"];

  function shown(name, value) {
    if (value === null || value === undefined) return "-";
    return name === "oldest_pending_age_s" ? value + " s" : String(value);
  }

  function cell(tag, text) {
    const element = document.createElement(tag);
    element.textContent = text;
    return element;
  }

  function updateTopics(data) {
    const body = document.querySelector("#topics tbody");
    const rows = data.topics.map(function (topic) {
      const row = document.createElement("tr");
      row.dataset.topic = topic.topic;
      row.appendChild(cell("td", topic.topic));
      COLUMNS.forEach(function (name) { row.appendChild(cell("td", shown(name, topic[name]))); });
      return row;
    });
    if (rows.length === 0) {
      const row = document.createElement("tr");
      const empty = cell("td", "no messages pending, dead, scheduled or sent in the last hour");
      empty.colSpan = 7;
      row.className = "empty";
      row.appendChild(empty);
      rows.push(row);
    }
    body.replaceChildren.apply(body, rows);
    COLUMNS.forEach(function (name) {
      document.querySelector('#total [data-field="' + name + '"]').textContent = shown(name, data.total[name]);
    });
    const updated = document.getElementById("updated");
    updated.dataset.now = data.now;
    updated.textContent = "as of " + data.now;
  }

  function updateMetrics(metrics) {
    const table = document.querySelector("#metrics tbody");
    if (!metrics || !table) return;
    const error = document.getElementById("metrics-error");
    error.hidden = !metrics.error;
    error.textContent = metrics.error || "";
    table.replaceChildren.apply(table, metrics.rows.map(function (row) {
      const line = document.createElement("tr");
      line.appendChild(cell("td", row.name));
      line.appendChild(cell("td", String(row.value)));
      return line;
    }));
  }

  function draw(id, figure) {
    if (window.Plotly) window.Plotly.react(id, figure.data, figure.layout, { displaylogo: false, responsive: true });
  }

  // An update that fails leaves the figures of the last one that worked: they are greyed
  // and a badge says since when (the first failure), until an update works again.
  let staleSince = null;

  function markStale(reason) {
    if (staleSince === null) staleSince = new Date();
    const badge = document.getElementById("stale");
    badge.textContent = "stale since " + staleSince.toTimeString().slice(0, 8);
    badge.title = "update failed (" + reason + "), retrying";
    badge.hidden = false;
    document.body.classList.add("stale");
  }

  function markFresh() {
    staleSince = null;
    document.getElementById("stale").hidden = true;
    document.body.classList.remove("stale");
  }

  function failure(reply) {
    // The dashboard's JSON error ({"error": ...}) when it sent one, else the status alone.
    return reply.json().then(
      function (body) { return new Error(reply.status + ": " + (body.error || reply.statusText)); },
      function () { return new Error(String(reply.status)); }
    ).then(function (error) { throw error; });
  }

  function refresh() {
    return fetch("/api/overview", { headers: { Accept: "application/json" } })
      .then(function (reply) { return reply.ok ? reply.json() : failure(reply); })
      .then(function (data) {
        updateTopics(data);
        updateMetrics(data.metrics);
        draw("chart-throughput", data.charts.throughput);
        draw("chart-latency", data.charts.latency);
        markFresh();
        document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
      })
      .catch(function (error) { markStale(error.message); });
  }

  // The next poll only after this one: a slow answer never piles requests up.
  function loop() { refresh().finally(function () { window.setTimeout(loop, EVERY_MS); }); }
  loop();
})();
