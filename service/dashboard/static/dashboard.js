// zero1 dashboard: keeps the server-rendered pages live by polling the /v1 API once a second.
// No framework and no CDN. The server draws the first paint (service/dashboard/templates); this
// script fills the same slots with the same formatting and the planner's chart geometry (service/
// dashboard/format.py and charts.py), so a page reads the same before and after it takes over. A job's
// training curves are charts.js's (uPlot, vendored): the server's SVG stands in for them without JavaScript.
"use strict";

(() => {
  document.documentElement.classList.add("js");

  const POLL_MS = 1000;
  const ACTIVE = ["starting", "running", "restarting"];
  const TERMINAL = new Set(["succeeded", "failed", "cancelled", "stopped_early"]);
  const PARTS = ["params", "grads", "buckets", "optimizer", "padding", "activations", "temporaries", "overhead"];
  const CHART = { WIDTH: 640, HEIGHT: 200, LEFT: 64, RIGHT: 12, TOP: 12, BOTTOM: 26 };
  CHART.PLOT_W = CHART.WIDTH - CHART.LEFT - CHART.RIGHT;
  CHART.PLOT_H = CHART.HEIGHT - CHART.TOP - CHART.BOTTOM;

  const $ = (selector, root = document) => root.querySelector(selector);
  const $$ = (selector, root = document) => Array.from(root.querySelectorAll(selector));

  // ------------------------------------------------------------------ formatting (format.py)

  const UNITS = [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"]];

  function humanBytes(n) {
    if (n == null) return "—";
    for (const [scale, unit] of UNITS) if (Math.abs(n) >= scale) return `${(n / scale).toFixed(2)} ${unit}`;
    return `${n} B`;
  }

  function byteUnit(n) {  // format.byte_unit
    for (const [scale, unit] of UNITS) if (Math.abs(n) >= scale) return [scale, unit];
    return [1, "B"];
  }

  function barLabel(n, scale) {  // format.bar_label: at most 5 characters
    const v = n / scale;
    if (v >= 1) return significant(v, 3);
    return v >= 0.01 ? v.toFixed(2) : "<0.01";
  }

  function shortBytes(n) {
    for (const [scale, unit] of UNITS) if (Math.abs(n) >= scale) return `${significant(n / scale, 3)} ${unit}`;
    return `${n} B`;
  }

  const grouped = (n) => (n == null ? "—" : Math.round(n).toLocaleString("en-US"));
  const rate = (v) => (v == null ? "—" : Math.round(v).toLocaleString("en-US"));
  const stripZeros = (s) => (s.includes(".") ? s.replace(/\.?0+$/, "") : s);

  function significant(v, digits = 4) {  // Python's f"{v:.4g}"
    if (v == null) return "—";
    if (v === 0) return "0";
    const rounded = Number(v.toPrecision(digits));
    const exp = Math.floor(Math.log10(Math.abs(rounded)));
    if (exp < -4 || exp >= digits) {
      const [mantissa, e] = rounded.toExponential(digits - 1).split("e");
      const power = Number(e);
      return `${stripZeros(mantissa)}e${power < 0 ? "-" : "+"}${String(Math.abs(power)).padStart(2, "0")}`;
    }
    return stripZeros(rounded.toFixed(Math.max(0, digits - 1 - exp)));
  }

  function duration(seconds) {
    if (seconds == null) return "—";
    const s = Math.max(0, Math.trunc(seconds));
    const hours = Math.trunc(s / 3600), minutes = Math.trunc((s % 3600) / 60), secs = s % 60;
    const pad = (n) => String(n).padStart(2, "0");
    if (hours) return `${hours}h ${pad(minutes)}m ${pad(secs)}s`;
    return minutes ? `${minutes}m ${pad(secs)}s` : `${secs}s`;
  }

  function elapsedS(job) {
    if (!job.started_at) return null;
    const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
    return (end - Date.parse(job.started_at)) / 1000;
  }

  // format.clock and format.time_of_day, of the API's ISO 8601 instants
  const clock = (iso) => new Date(iso).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  const timeOfDay = (iso) => new Date(iso).toISOString().slice(11, 19);

  function startsIn(iso) {  // format.starts_in
    if (iso == null) return "—";
    const seconds = (Date.parse(iso) - Date.now()) / 1000;
    if (seconds < 60) return "<1 min";
    if (seconds < 3600) return `in ${Math.floor(seconds / 60)} min`;
    if (seconds < 2 * 86400) return `in ${(seconds / 3600).toFixed(1)} h`;
    return `in ${(seconds / 86400).toFixed(1)} d`;
  }

  const doneSteps = (job) => (job.step == null ? 0 : job.step + 1);
  const queueText = (job) => (job.queue_position ? `#${job.queue_position}` : "—");

  // printable.escape keeping line breaks and tabs, as the server's pages write user text: a control
  // or format character (a bidi override, U+FEFF) of a name, a log line or a reason (a user's, or
  // their code's) is shown as its escape, written as Python writes it
  const hex = (n, width) => n.toString(16).padStart(width, "0");
  const visible = (text) => String(text).replace(/[\x00-\x08\x0b-\x1f\x7f-\x9f\p{Cf}]/gu, (c) => {
    const n = c.codePointAt(0);
    if (c === "\r") return "\\r";
    return n <= 0xff ? `\\x${hex(n, 2)}` : n <= 0xffff ? `\\u${hex(n, 4)}` : `\\U${hex(n, 8)}`;
  });

  function setText(el, text) {
    const shown = visible(text);
    if (el && el.textContent !== shown) el.textContent = shown;
  }

  function textSpan(className, text) {  // text set as textContent: never parsed as HTML
    return Object.assign(document.createElement("span"), { className, textContent: visible(text) });
  }

  function setBadge(el, status) {
    if (!el) return;
    el.className = `badge s-${status}`;
    setText(el, status);
  }

  function setProgress(progress, label, job) {
    const done = doneSteps(job);
    if (progress.max !== job.steps) progress.max = job.steps;
    if (progress.value !== done) progress.value = done;
    setText(label, `${grouped(done)} / ${grouped(job.steps)}`);
  }

  // ------------------------------------------------------------------ talking to the API

  class ApiError extends Error {}

  async function api(path, options = {}) {
    let response;
    try {
      // X-Zero1-CSRF: a header no cross-site form can send, so the service lets the login cookie cancel a job
      const headers = { Accept: "application/json", "X-Zero1-CSRF": "1", ...(options.headers || {}) };
      response = await fetch(path, { ...options, headers });
    } catch (error) {
      connection(false);
      throw new ApiError("the service cannot be reached");
    }
    connection(true);
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(visible((body && body.message) || `${response.status} ${response.statusText}`));
    return body;
  }

  function connection(ok) {
    const note = $("#connection");
    if (note && note.hidden !== ok) note.hidden = ok;
  }

  // Run `task` POLL_MS after the first paint and again POLL_MS after each run settles, while the
  // page is visible; a task that returns false stops. The returned function runs it at once.
  // Failures to reach the API keep polling: the connection note says what is wrong.
  function poll(task) {
    let timer = null, running = false, again = false;
    async function tick() {
      clearTimeout(timer);
      if (running) { again = true; return; }
      running = true;
      let stop = false;
      try {
        if (!document.hidden) stop = (await task()) === false;
      } catch (error) {
        if (!(error instanceof ApiError)) throw error;
      } finally {
        running = false;
      }
      if (again) { again = false; tick(); }
      else if (!stop) timer = setTimeout(tick, POLL_MS);
    }
    timer = setTimeout(tick, POLL_MS);
    return tick;
  }

  // ------------------------------------------------------------------ the planner's charts (charts.py)

  function floorBytes(perGpu, stage) {  // what sharding cannot remove: stage 2's buckets, the step's bytes, overhead
    const replicated = [["params", "grads", "optimizer", "padding"], ["params", "grads"], ["params"], []][stage];
    const unsharded = ["buckets", "activations", "temporaries", "overhead"];
    return [...replicated, ...unsharded].reduce((sum, part) => sum + perGpu[`${part}_bytes`], 0);
  }

  // a bar's value label sits 3 above the bar, or 3 above the memory line when that would cross it
  // (charts.value_label_y); the line labels are a legend under the chart, off the bars
  const VALUE_LABEL_H = 16;
  function valueLabelY(barY, memoryY) {
    const clash = memoryY != null && barY - 3 - VALUE_LABEL_H - 2 < memoryY && memoryY <= barY;
    return (clash ? memoryY : barY) - 3;
  }

  function drawSweep(svg, plan, floor) {
    const sweep = plan.sweep, memory = plan.gpu_memory_bytes;
    const top = Math.max(...sweep.map((p) => p.total_bytes));
    const yMax = Math.max(1, Math.round((memory <= 2 * top ? Math.max(top, memory) : top) * 1.08));
    const y = (bytes) => CHART.TOP + (1 - bytes / yMax) * CHART.PLOT_H;
    const round1 = (v) => Math.round(v * 10) / 10;  // charts.py rounds to 0.1 before it compares
    const memoryY = memory <= yMax ? round1(y(memory)) : null;
    const [scale, unit] = byteUnit(yMax);
    const slot = CHART.PLOT_W / sweep.length;
    svg.dataset.yMax = yMax;
    setText($(".y-max", svg), shortBytes(yMax));
    setText($(".axis-label .unit", svg), unit);
    sweep.forEach((point, i) => {
      const g = $(`g.bar[data-num-gpus="${point.num_gpus}"]`, svg);
      if (!g) return;
      const x = CHART.LEFT + i * slot + slot * 0.15, width = slot * 0.7, top = round1(y(point.total_bytes));
      const rect = $("rect", g);
      g.setAttribute("class", `bar ${point.fits ? "fits" : "over"}`);
      rect.setAttribute("y", top.toFixed(1));
      rect.setAttribute("height", (CHART.TOP + CHART.PLOT_H - top).toFixed(1));
      const verdict = point.fits ? "fits" : "does not fit";
      setText($("title", rect), `N = ${point.num_gpus}: ${humanBytes(point.total_bytes)}, ${verdict}`);
      const value = $("text.value", g);
      value.setAttribute("y", valueLabelY(top, memoryY).toFixed(1));
      setText(value, barLabel(point.total_bytes, scale));
      rect.setAttribute("x", x.toFixed(1));
      rect.setAttribute("width", width.toFixed(1));
    });
    const memoryLine = $(".memory-line", svg);
    memoryLine.setAttribute("visibility", memoryY == null ? "hidden" : "visible");
    memoryLine.setAttribute("y1", (memoryY ?? CHART.TOP).toFixed(1));
    memoryLine.setAttribute("y2", (memoryY ?? CHART.TOP).toFixed(1));
    setText($(".memory-label", svg), `GPU memory ${humanBytes(memory)}${memoryY == null ? ", above the chart" : ""}`);
    const floorY = y(floor);
    $(".floor-line", svg).setAttribute("y1", floorY.toFixed(1));
    $(".floor-line", svg).setAttribute("y2", floorY.toFixed(1));
    setText($(".floor-label", svg), `floor ${humanBytes(floor)}`);
    const end = sweep[sweep.length - 1];
    setText($("desc", svg), `From ${humanBytes(sweep[0].total_bytes)} on 1 GPU to ${humanBytes(end.total_bytes)} ` +
      `on ${end.num_gpus}; floor ${humanBytes(floor)}; GPU memory ${humanBytes(memory)}.`);
  }

  function fillStack(stack, perGpu, scaleBytes) {
    const scale = Math.max(1, scaleBytes);
    for (const seg of $$(".seg", stack)) {
      const bytes = perGpu[`${seg.dataset.part}_bytes`];
      seg.style.width = `${((100 * bytes) / scale).toFixed(3)}%`;
      seg.title = `${seg.dataset.part}: ${humanBytes(bytes)}`;
    }
  }

  function fillBytesRow(row, bytes, share) {
    const cell = $("td[data-bytes]", row);
    cell.dataset.bytes = bytes;
    setText(cell, grouped(bytes));
    setText($(".human", row), humanBytes(bytes));
    if (share !== undefined) setText($(".share", row), share);
  }

  function fillBreakdown(table, perGpu, memoryBytes) {
    const total = Math.max(perGpu.total_bytes, 1);
    const pct = (bytes) => `${((100 * bytes) / total).toFixed(1)}%`;
    for (const part of PARTS) {
      const bytes = perGpu[`${part}_bytes`];
      fillBytesRow($(`tr[data-part="${part}"]`, table), bytes, pct(bytes));
    }
    fillBytesRow($('tr[data-part="total"]', table), perGpu.total_bytes, "100.0%");
    fillBytesRow($('tr[data-part="gpu_memory"]', table), memoryBytes, "");
  }

  // ------------------------------------------------------------------ the jobs page

  // running first, then starting, then the queue in the order it starts, then newest first (routes.table_order)
  function tableOrder(a, b) {
    const group = (job) => ({ running: 0, restarting: 0, starting: 1, queued: 2 })[job.status] ?? 3;
    return group(a) - group(b) || (a.queue_position || 0) - (b.queue_position || 0) || b.id - a.id;
  }

  function fillRow(tr, job) {
    tr.id = `job-${job.id}`;
    tr.dataset.id = job.id;
    tr.dataset.status = job.status;
    const link = $(".job-link", tr);
    if (link.getAttribute("href") !== `/jobs/${job.id}`) link.setAttribute("href", `/jobs/${job.id}`);
    setText($(".job-id", tr), `#${job.id}`);
    setText($(".job-name", tr), job.name);
    const tags = $(".tags", tr), shownTags = (job.tags || []).join(" ");
    if (tags.dataset.tags !== shownTags) {
      tags.dataset.tags = shownTags;
      tags.replaceChildren(...(job.tags || []).map((t) => Object.assign(document.createElement("a"), {
        className: "job-tag", href: `/?tag=${encodeURIComponent(t)}`, textContent: t,
      })));
    }
    setBadge($('[data-field="status"]', tr), job.status);
    const progress = $("progress", tr);
    progress.setAttribute("aria-label", `Progress of job ${job.id}`);
    setProgress(progress, $(".steps", tr), job);
    const latest = job.latest || {};
    setText($(".c-loss", tr), significant(latest.loss));
    setText($(".c-tps", tr), rate(latest.tokens_per_s));
    setText($(".c-gpus", tr), job.num_gpus);
    setText($(".c-elapsed", tr), duration(elapsedS(job)));
    setText($(".c-queue", tr), queueText(job));
  }

  function cell(tag, label, text, className = "") {  // a table cell of text, labelled for the phone's cards
    const el = Object.assign(document.createElement(tag), { className, textContent: visible(text) });
    el.dataset.label = label;
    if (tag === "th") el.scope = "row";
    return el;
  }

  function queueRow(entry) {  // macros.queue_row
    const tr = document.createElement("tr");
    tr.dataset.id = entry.id;
    const job = cell("th", "Job", "");
    const link = Object.assign(document.createElement("a"), { href: `/jobs/${entry.id}` });
    link.append(textSpan("job-id", `#${entry.id}`), " ", textSpan("job-name", entry.name));
    job.append(link);
    const gpus = entry.min_gpus === entry.num_gpus ? entry.num_gpus : `${entry.min_gpus}–${entry.num_gpus}`;
    tr.append(cell("td", "Position", `#${entry.position}`, "num"), job, cell("td", "Owner", entry.owner || "—"),
      cell("td", "Priority", entry.priority, "num"), cell("td", "GPUs", gpus, "num"),
      cell("td", "Starts", startsIn(entry.estimated_start), "num c-start"), cell("td", "Waiting for", entry.reason, "why"));
    setStart(tr, entry);
    return tr;
  }

  function setStart(tr, entry) {  // an estimate moves every second: its cell is set in place, never redrawn
    const td = $(".c-start", tr);
    setText(td, startsIn(entry.estimated_start));
    const title = entry.estimated_start ? `estimated ${clock(entry.estimated_start)}` : "";
    if (td.title !== title) td.title = title;
  }

  function ownerRow(usage) {  // macros.owner_row
    const tr = document.createElement("tr");
    tr.append(cell("th", "Owner", usage.owner || "—"), cell("td", "GPUs in use", usage.gpus_in_use, "num"),
      cell("td", "Quota", usage.quota == null ? "none" : usage.quota, "num"),
      cell("td", "Borrowed", usage.borrowed_gpus, "num"));
    return tr;
  }

  const TAG = /^[A-Za-z0-9][A-Za-z0-9._:=/+-]{0,63}$/;  // service/schemas/fields.py TAG_PATTERN

  function jobsPage() {
    const table = $("#jobs"), tbody = table.tBodies[0], template = $("#row-template");
    const filter = $("#filter"), select = $("#status-filter"), tagInput = $("#tag-filter"), announcer = $("#announcer");
    const limit = Number(table.dataset.limit) || 100;
    const seen = new Map($$("tr[data-id]", tbody).map((tr) => [Number(tr.dataset.id), tr.dataset.status]));
    let status = table.dataset.status || "", tag = table.dataset.tag || "";

    function announce(job) {
      const before = seen.get(job.id);
      if (before !== job.status) {
        announcer.textContent = visible(before === undefined
          ? `Job ${job.id} ${job.name} is ${job.status}`
          : `Job ${job.id} ${job.name}: ${before} to ${job.status}`);
        seen.set(job.id, job.status);
      }
    }

    function render(jobs) {
      jobs.sort(tableOrder);
      const kept = new Set();
      let previous = null;
      for (const job of jobs) {
        let tr = document.getElementById(`job-${job.id}`);
        if (!tr) tr = template.content.querySelector("tr").cloneNode(true);
        fillRow(tr, job);
        const expected = previous ? previous.nextElementSibling : tbody.firstElementChild;
        if (expected !== tr) tbody.insertBefore(tr, expected);
        kept.add(tr);
        previous = tr;
        announce(job);
      }
      for (const tr of Array.from(tbody.rows)) if (!kept.has(tr)) tr.remove();
      $("#no-jobs").hidden = jobs.length > 0;
    }

    // Each second: the cluster, the active jobs and the newest queued one, all small. The table's
    // newest TABLE_LIMIT jobs (large: each carries its spec and plan) are fetched again only when
    // one of those changed (a job was submitted, started, ended or left the queue), when the
    // filter changed, and every tenth second anyway.
    let recent = null, recentFor = null, live = "", ticks = 0;
    const queueLimit = Number($("#queue").dataset.limit) || 50;
    let queueShown = null;

    function renderQueue(queue) {  // redrawn only when it changed: a link in it keeps its focus
      const rows = $("#queue").tBodies[0].rows;
      queue.data.forEach((entry, i) => rows[i] && rows[i].dataset.id === String(entry.id) && setStart(rows[i], entry));
      const shown = JSON.stringify([queue.data.map(({ estimated_start, ...rest }) => rest), queue.owners]);
      if (shown === queueShown) return;
      queueShown = shown;
      $("#queue").tBodies[0].replaceChildren(...queue.data.map(queueRow));
      $("#owners").tBodies[0].replaceChildren(...queue.owners.map(ownerRow));
      setText($('[data-field="queue-count"]'), queue.count);
      $("#queue-empty").hidden = queue.data.length > 0;
      $("#owners").hidden = !queue.owners.length;
      $("#owners-empty").hidden = queue.owners.length > 0;
    }

    async function refresh() {
      const [cluster, active, queue] = await Promise.all([
        api("/v1/cluster"),
        api(`/v1/jobs?limit=500&${ACTIVE.map((s) => `status=${s}`).join("&")}`),
        api(`/v1/queue?limit=${queueLimit}`),
      ]);
      const waiting = queue.data.map((entry) => `${entry.id}:queued:${entry.position}`);
      const now = [...active.data.map((job) => `${job.id}:${job.status}`), ...waiting, queue.count].join();
      const wanted = filterQuery();
      if (recentFor !== wanted || now !== live || ticks % 10 === 0) {
        recent = (await api(`/v1/jobs?limit=${limit}${wanted ? `&${wanted}` : ""}`)).data;
        recentFor = wanted;
      }
      live = now;
      ticks += 1;
      const strip = $("#cluster");
      setText($('[data-field="gpus-in-use"]', strip), active.data.reduce((sum, job) => sum + job.num_gpus, 0));
      setText($('[data-field="gpus-total"]', strip), cluster.num_gpus);
      setText($('[data-field="gpu-memory"]', strip), humanBytes(cluster.gpu_memory_bytes));
      setText($('[data-field="gpu-kind"]', strip), cluster.simulated ? "simulated" : "real");
      setText($('[data-field="queued"]', strip), queue.count);
      renderQueue(queue);
      setText($('[data-field="nodes"]', strip), cluster.nodes);
      const byId = new Map(recent.map((job) => [job.id, job]));
      for (const job of active.data) {
        if ((!status || job.status === status) && (!tag || job.tags.includes(tag))) byId.set(job.id, job);
      }
      render(Array.from(byId.values()));
    }

    function filterQuery() {  // the table's filter as a query string: status=…&tag=…, "" for none
      return new URLSearchParams([...(status ? [["status", status]] : []), ...(tag ? [["tag", tag]] : [])]).toString();
    }

    const refreshNow = poll(refresh);
    function applyFilter() {
      status = select.value;
      const typed = tagInput.value.trim();
      tag = TAG.test(typed) ? typed : "";  // not a tag: no filter, as the server reads ?tag=
      tagInput.setCustomValidity(typed && !tag ? "a tag: letters, digits and . _ : = / + -, up to 64" : "");
      table.dataset.status = status;
      table.dataset.tag = tag;
      const query = filterQuery();
      history.replaceState(null, "", query ? `/?${query}` : "/");
      refreshNow();
    }
    select.addEventListener("change", applyFilter);
    filter.addEventListener("submit", (event) => { event.preventDefault(); applyFilter(); });
  }

  // ------------------------------------------------------------------ one job's page

  function jobPage() {
    const head = $("#job"), id = Number(head.dataset.id), maxPoints = Number(head.dataset.maxPoints) || 200;
    const cancel = $("#cancel"), note = $("#cancel-note");
    let status = head.dataset.status;
    let eventsFor = null;  // status/attempt the events were read at: a retry can pass through restarting between polls
    cancel.hidden = TERMINAL.has(status);

    cancel.addEventListener("click", async () => {
      const question = `Cancel job #${id} “${head.dataset.name}”? Its ranks are stopped; it cannot be resumed.`;
      if (!window.confirm(question)) return;
      cancel.disabled = true;
      try {
        await api(`/v1/jobs/${id}/cancel`, { method: "POST" });
        note.textContent = "Cancel requested: the job stops within a scheduler tick.";
        refreshNow();
      } catch (error) {
        note.textContent = `Could not cancel: ${error.message}`;
        cancel.disabled = false;
      }
    });

    function fillStats(job) {
      setBadge($('[data-field="status"]', head), job.status);
      head.dataset.status = job.status;
      const stats = $("#job-stats"), latest = job.latest || {};
      setProgress($("progress", stats), $('[data-field="steps"]', stats), job);
      setText($('[data-field="loss"]', stats), significant(latest.loss));
      setText($('[data-field="tps"]', stats), rate(latest.tokens_per_s));
      const stepTime = latest.step_time_s == null ? "—" : `${significant(latest.step_time_s, 3)} s`;
      setText($('[data-field="step-time"]', stats), stepTime);
      setText($('[data-field="elapsed"]', stats), duration(elapsedS(job)));
      setText($('[data-field="attempt"]', stats), job.attempt);
      setText($('[data-field="world-size"]', stats), job.world_size ?? job.num_gpus);
      setText($('[data-field="queue"]', stats), queueText(job));
      setText($('[data-field="priority"]', stats), job.priority);
      $('[data-field="borrowed"]', stats).hidden = !job.borrowed;
      const error = $("#job-error");
      error.hidden = !job.error;
      if (job.error) setText(error, `${job.error.exception}: ${job.error.message}`);
      if (TERMINAL.has(job.status)) cancel.hidden = true;
      fillPeaks(latest);
    }

    function fillPeaks(latest) {
      const table = $("#peaks"), peaks = latest.mem_peak_bytes || [];
      const planned = latest.mem_planned_bytes || Number(table.dataset.planned);
      const scale = Math.max(planned, ...peaks, 1);
      for (const row of $$("tr[data-rank]", table)) {
        const peak = peaks[Number(row.dataset.rank)];
        const cell = $("td[data-bytes]", row);
        cell.dataset.bytes = peak ?? "";
        setText(cell, grouped(peak));
        setText($(".ratio", row), peak == null ? "—" : `${((100 * peak) / Math.max(planned, 1)).toFixed(1)}%`);
        $(".fill", row).style.width = `${((100 * (peak || 0)) / scale).toFixed(2)}%`;
        $(".mark", row).style.left = `${((100 * planned) / scale).toFixed(2)}%`;
      }
    }

    function renderEvents(events) {
      const badge = (status) => textSpan(`badge s-${status}`, status);
      $("#events").replaceChildren(...events.map((event) => {
        const time = Object.assign(document.createElement("time"), { dateTime: event.at });
        time.textContent = clock(event.at);
        const transition = textSpan("transition", "");
        if (event.from_status) transition.append(badge(event.from_status), " → ");
        transition.append(badge(event.to_status));
        const li = document.createElement("li");
        if (event.reason.startsWith("preempted")) li.dataset.kind = "preemption";  // as job.html marks it
        li.append(time, " ", transition, " ", textSpan("reason", event.reason));
        return li;
      }));
    }

    // the training curves, drawn by charts.js (uPlot) from the rows the endpoints give
    const curves = window.zero1Charts.jobCharts($("#curves"));
    let drawnStep = null;

    async function refresh() {
      const job = await api(`/v1/jobs/${id}`);
      if (`${job.status}/${job.attempt}` !== eventsFor) {
        const events = (await api(`/v1/jobs/${id}/events`)).data;
        renderEvents(events);
        curves.setEvents(events);
        eventsFor = `${job.status}/${job.attempt}`;
      }
      if (String(job.step ?? "") !== drawnStep) {
        const metrics = await api(`/v1/jobs/${id}/metrics?max_points=${maxPoints}&limit=${10 * maxPoints}`);
        const evaluated = (await api(`/v1/jobs/${id}/metrics?evaluated=true&limit=10000`)).data;
        const checkpointed = (await api(`/v1/jobs/${id}/metrics?checkpointed=true&limit=10000`)).data;
        curves.update({ metrics: metrics.data, evaluated, checkpointed });
        if (evaluated.length) setText($('[data-field="eval-loss"]', $("#job-stats")), significant(evaluated.at(-1).eval_loss));
        // the stored checkpoints' files: none to link while the storage cannot be listed (a 503)
        const stored = await api(`/v1/jobs/${id}/checkpoints`).then((r) => r.data, () => []);
        renderCheckpoints(checkpointed, stored);
        drawnStep = String(job.step ?? "");
      }
      if (job.status === "succeeded" && status !== "succeeded") await renderArtifacts();
      fillStats(job);
      status = job.status;
      return !TERMINAL.has(status);  // a finished job's page is final
    }

    function renderCheckpoints(checkpointed, stored) {  // job.html's list: each step, with the files still stored
      const filesOf = new Map(stored.map((checkpoint) => [checkpoint.step, checkpoint.files]));
      $("#checkpoints").replaceChildren(...checkpointed.map((row) => {
        const li = document.createElement("li");
        li.dataset.step = row.step;
        li.append(`step ${grouped(row.step)} `, textSpan("note", `(training waited ${significant(row.checkpoint_blocked_s, 3)} s)`));
        const files = filesOf.get(row.step) || [];
        if (files.length) {
          const list = Object.assign(document.createElement("span"), { className: "checkpoint-files" });
          files.forEach((file, i) => {
            const link = Object.assign(document.createElement("a"), {
              href: `/v1/jobs/${id}/checkpoints/${row.step}/${encodeURIComponent(file.name)}`, textContent: visible(file.name),
            });
            link.download = `step-${row.step}-${file.name}`;
            list.append(i ? ", " : "", link, " ", textSpan("note", humanBytes(file.bytes)));
          });
          li.append(" ", list);
        }
        return li;
      }));
      $("#checkpoints-empty").hidden = checkpointed.length > 0;
    }

    async function renderArtifacts() {  // job.html's table, once the job has succeeded while the page was open
      const files = (await api(`/v1/jobs/${id}/artifacts`)).data;
      $("#artifacts tbody").replaceChildren(...files.map((file) => {
        const row = document.createElement("tr");
        row.dataset.name = file.name;
        const link = Object.assign(document.createElement("a"), { href: `/v1/jobs/${id}/artifacts/${encodeURIComponent(file.name)}`, textContent: visible(file.name) });
        link.download = file.name;
        const digest = Object.assign(document.createElement("code"), { title: file.sha256, textContent: file.sha256.slice(0, 12) });
        const cells = [link, humanBytes(file.bytes), digest].map((content, i) => {
          const cell = document.createElement("td");
          if (i === 1) cell.className = "num";
          cell.append(content);
          return cell;
        });
        row.append(...cells);
        return row;
      }));
      const empty = $("#artifacts-empty");
      empty.hidden = files.length > 0;
      empty.textContent = "The job wrote no final model files.";
    }

    const refreshNow = poll(refresh);
    refreshNow();  // the curves are drawn from the API at once, not a poll later
    jobLogs(head);
  }

  // ------------------------------------------------------------------ one job's logs

  function logLine(row, colours) {  // macros.log_line
    const li = document.createElement("li");
    Object.assign(li.dataset, { seq: row.seq, rank: row.rank ?? "", stream: row.stream });
    const who = row.rank == null ? "zero1" : `rank ${row.rank} · attempt ${row.attempt}`;
    li.title = `${who} · ${row.stream} · ${clock(row.time)}`;
    const rank = textSpan(row.rank == null ? "rank" : `rank r-${row.rank % colours}`, "");
    if (row.rank != null) rank.append(textSpan("visually-hidden", "rank "), String(row.rank));
    li.append(rank, Object.assign(document.createElement("time"), { textContent: timeOfDay(row.time) }));
    if (row.stream === "stderr") li.append(textSpan("visually-hidden", "stderr: "));
    li.append(textSpan("text", row.line));  // the job's own output: text, never HTML
    return li;
  }

  // The newest lines come with the page (routes.log_tail); then each second the lines stored after
  // them, a page at a time, until the job has ended and a fetch finds none. The panel keeps the
  // newest `keep`: it follows the newest while scrolled to its end and holds still while it is not,
  // even as the oldest go.
  function jobLogs(head) {
    const panel = $("#log-panel"), list = $("#log-lines"), select = $("#log-rank"), empty = $("#logs-empty");
    const limit = Number(panel.dataset.limit) || 1000, keep = Number(panel.dataset.keep) || 5000;
    const colours = Number(panel.dataset.rankColours) || 8;
    let after = Number(panel.dataset.next) || 0;

    const atEnd = () => panel.scrollHeight - panel.scrollTop - panel.clientHeight < 4;
    const shown = (li) => !select.value || li.dataset.rank === select.value || li.dataset.stream === "marker";

    function append(rows) {
      const follow = atEnd();
      const lines = rows.map((row) => logLine(row, colours));
      for (const li of lines) li.hidden = !shown(li);
      list.append(...lines);
      const excess = list.childElementCount - keep;
      if (excess > 0) {
        const height = panel.scrollHeight;
        for (let i = 0; i < excess; i += 1) list.firstElementChild.remove();
        if (!follow) panel.scrollTop -= height - panel.scrollHeight;  // the lines in view stay where they were
      }
      if (follow) panel.scrollTop = panel.scrollHeight;
      empty.hidden = true;
    }

    async function refresh() {
      // read first: a job's last lines are stored with its end, so a fetch after it finds them all
      const ended = TERMINAL.has(head.dataset.status);
      let page, fresh = 0;
      do {
        page = await api(`/v1/jobs/${head.dataset.id}/logs?after=${after}&limit=${limit}`);
        if (page.data.length) append(page.data);
        fresh += page.data.length;
        after = page.next;
      } while (page.data.length === limit);  // a full page: more are stored
      return !(ended && fresh === 0);
    }

    function filter() {
      for (const li of list.children) li.hidden = !shown(li);
      panel.scrollTop = panel.scrollHeight;
    }
    select.addEventListener("change", filter);
    filter();  // a browser may have kept the choice across a reload
    poll(refresh);
  }

  // ------------------------------------------------------------------ the planner

  function number(text) {  // routes._number: '7.5e9' -> 7500000000, '' -> null
    const cleaned = String(text ?? "").trim().replace(/[,_]/g, "");
    if (!cleaned) return null;
    const value = Number(cleaned);
    return Number.isFinite(value) ? value : text;
  }

  function planBody(form) {  // routes.plan_body
    const field = (name) => (form.elements[name] ? form.elements[name].value : "");
    const body = {
      num_gpus: number(field("num_gpus")), gpu_memory_gb: number(field("gpu_memory_gb")), stage: number(field("stage")),
      precision: field("precision"), optimizer: field("optimizer"),
    };
    if (form.elements.source.value === "gpt") {
      body.model = { kind: "gpt" };
      for (const key of ["vocab_size", "n_layer", "n_head", "n_embd", "block_size"]) {
        const value = number(field(key));
        if (value != null) body.model[key] = value;
      }
      body.micro_batch_size = number(field("micro_batch_size"));
      body.seq_len = number(field("seq_len"));
      body.activation_checkpointing = form.elements.activation_checkpointing.checked;
    } else {
      body.num_params = number(field("num_params"));
    }
    return Object.fromEntries(Object.entries(body).filter(([, value]) => value != null));
  }

  function recommendBody(form) {  // routes.recommend_body: a GPT spec with a global batch, on up to N GPUs
    const globalBatch = number(form.elements.global_batch_size.value);
    if (form.elements.source.value !== "gpt" || globalBatch == null) return null;
    const plan = planBody(form), body = { global_batch_size: globalBatch, max_gpus: plan.num_gpus };
    for (const key of ["model", "seq_len", "precision", "optimizer", "gpu_memory_gb"]) {
      if (plan[key] != null) body[key] = plan[key];
    }
    return body;
  }

  function renderRecommendations(section, body) {
    const cost = body.cost_model;
    const field = (name) => $(`[data-field="${name}"]`, section);
    setText(field("global_batch_size"), grouped(body.global_batch_size));
    setText(field("tokens_per_step"), grouped(cost.tokens_per_step));
    setText(field("max_gpus"), grouped(body.max_gpus));
    setText(field("gpu_memory"), humanBytes(body.gpu_memory_bytes));
    setText(field("unit"), cost.unit);
    setText(field("gpu_tflops"), significant(cost.gpu_tflops));
    setText(field("network_gb_per_s"), significant(cost.network_gb_per_s));
    setText(field("formula"), cost.formula);
    const rows = body.recommendations.map((item) => {
      const row = document.createElement("tr");
      Object.assign(row.dataset, {
        numGpus: item.num_gpus, microBatchSize: item.micro_batch_size,
        checkpointing: String(item.activation_checkpointing), zeroStage: item.zero_stage, totalBytes: item.total_bytes,
      });
      const cells = [
        [item.num_gpus, "num"], [item.micro_batch_size, "num"], [item.accumulation_steps, "num"],
        [item.activation_checkpointing ? "yes" : "no", ""], [item.zero_stage, "num"],
        [humanBytes(item.total_bytes), "num"],
        [humanBytes(item.headroom_bytes), "num"], [significant(item.cost), "num"], [item.why, "why"],
      ];
      for (const [text, className] of cells) {
        const cell = document.createElement("td");
        if (className) cell.className = className;
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    });
    $("#recommendations tbody", section).replaceChildren(...rows);
  }

  async function refreshRecommendations(form) {
    const section = $("#recommend-result"), error = $("#recommend-error"), list = $("#recommend-list");
    const body = recommendBody(form);
    section.hidden = body == null;
    if (body == null) return;
    try {
      const answer = await api("/v1/plan/recommend", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      renderRecommendations(section, answer);
      error.hidden = true;
      list.hidden = false;
    } catch (failure) {
      if (!(failure instanceof ApiError)) throw failure;
      error.textContent = failure.message;  // does_not_fit says why; a bad field is named
      error.hidden = false;
      list.hidden = true;
    }
  }

  function renderPlan(section, plan) {
    const perGpu = plan.per_gpu, floor = floorBytes(perGpu, plan.stage);
    const field = (name) => $$(`[data-field="${name}"]`, section);
    for (const el of field("num_gpus")) setText(el, plan.num_gpus);
    for (const el of field("stage")) setText(el, plan.stage);
    setText(field("total")[0], humanBytes(perGpu.total_bytes));
    setText(field("num_params")[0], grouped(plan.num_params));
    const fits = field("fits")[0];
    fits.className = `badge ${plan.fits ? "s-succeeded" : "s-failed"}`;
    setText(fits, plan.fits ? "fits" : "does not fit");
    setText(field("gpu_memory")[0], humanBytes(plan.gpu_memory_bytes));
    setText(field("headroom")[0], humanBytes(plan.headroom_bytes));
    setText(field("min_gpus")[0], plan.min_gpus ?? "none");
    fillStack($("#plan-stack", section), perGpu, perGpu.total_bytes);
    fillBreakdown($("#plan-breakdown", section), perGpu, plan.gpu_memory_bytes);
    const stages = $("#plan-stages", section);
    setText($("caption", stages), `Each ZeRO stage at N = ${plan.num_gpus}`);
    for (const [stage, total] of Object.entries(plan.stages)) {
      const row = $(`tr[data-stage="${stage}"]`, stages);
      row.classList.toggle("current", Number(stage) === plan.stage);
      fillBytesRow(row, total);
    }
    for (const point of plan.sweep) {
      const row = $(`tr[data-num-gpus="${point.num_gpus}"]`, $("#plan-sweep", section));
      fillBytesRow(row, point.total_bytes);
      setText($(".fits", row), point.fits ? "yes" : "no");
    }
    drawSweep($("#sweep-chart", section), plan, floor);
  }

  function planPage() {
    const form = $("#plan-form"), error = $("#plan-error");
    const syncSource = () => {
      const source = form.elements.source.value;
      for (const fieldset of $$("fieldset[data-source]", form)) fieldset.disabled = fieldset.dataset.source !== source;
    };
    form.addEventListener("change", (event) => { if (event.target.name === "source") syncSource(); });
    syncSource();
    form.addEventListener("submit", async (event) => {
      const section = $("#plan-result");
      if (!section) return;  // no result drawn yet: let the browser load the plan's page
      event.preventDefault();
      const query = new URLSearchParams(new FormData(form)).toString();
      try {
        const plan = await api("/v1/plan", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(planBody(form)),
        });
        renderPlan(section, plan);
        await refreshRecommendations(form);
        error.hidden = true;
        section.hidden = false;
        history.replaceState(null, "", `/plan?${query}`);
      } catch (failure) {
        if (!(failure instanceof ApiError)) throw failure;
        error.textContent = failure.message;
        error.hidden = false;
      }
    });
  }

  // ------------------------------------------------------------------ compare and sweep (experiments.py)

  function experimentsPage() {  // their tables are the server's; charts.js draws the JSON it wrote
    window.zero1Charts.experimentCharts(document, JSON.parse($("#chart-data").textContent));
  }

  const pages = { jobs: jobsPage, job: jobPage, plan: planPage, compare: experimentsPage, sweep: experimentsPage };
  const start = pages[document.body.dataset.page];
  if (start) start();
})();
