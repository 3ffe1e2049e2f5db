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

  function refresh() {
    return fetch("/api/overview", { headers: { Accept: "application/json" } })
      .then(function (reply) { if (!reply.ok) throw new Error(reply.status); return reply.json(); })
      .then(function (data) {
        updateTopics(data);
        updateMetrics(data.metrics);
        draw("chart-throughput", data.charts.throughput);
        draw("chart-latency", data.charts.latency);
        document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
      })
      .catch(function (error) { document.getElementById("updated").textContent = "update failed (" + error.message + "), retrying"; });
  }

  // The next poll only after this one: a slow answer never piles requests up.
  function loop() { refresh().finally(function () { window.setTimeout(loop, EVERY_MS); }); }
  loop();
})();
