// zero1 dashboard: the job page's training curves, and the compare and sweep pages' overlays and scatters, drawn by uPlot (static/vendor/uplot, served by this
// server: nothing comes from a CDN). dashboard.js fetches the /v1 metrics and events and hands them to
// window.zero1Charts.jobCharts(...).update(...); this file only draws. Each chart's .uplot root keeps
// its uPlot as `.uplot` on its container (.u-chart) and the markers it drew in data-markers.
"use strict";

(() => {
  const FONT = "12px system-ui, -apple-system, 'Segoe UI', sans-serif";  // tick labels: >= 10 px
  const HEIGHT = 240;
  const COLOURS = { train: "#2563eb", raw: "rgba(37, 99, 235, 0.25)", eval: "#c2410c", second: "#0f766e" };
  const MARKER_COLOURS = { restart: "#374151", resize: "#7c3aed", preemption: "#dc2626", rollback: "#b45309" };

  const stripZeros = (s) => (s.includes(".") ? s.replace(/\.?0+$/, "") : s);
  function short(v) {  // 3 significant digits; an exponent only for the very small or large
    if (v == null) return "—";
    if (v === 0) return "0";
    const exp = Math.floor(Math.log10(Math.abs(v)));
    if (exp < -3 || exp > 6) return v.toExponential(2).replace(/\.?0+e/, "e");
    return stripZeros(v.toFixed(Math.max(0, 2 - exp)));
  }
  function bytes(v) {
    if (v == null) return "—";
    for (const [scale, unit] of [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"]]) {
      if (Math.abs(v) >= scale) return `${short(v / scale)} ${unit}`;
    }
    return `${short(v)} B`;
  }

  // Exponential moving average, as TensorBoard's smoothing slider: s = w*s + (1 - w)*y from the first value.
  function ema(values, weight) {
    let last = null;
    return values.map((v) => {
      if (v == null) return null;
      last = last == null ? v : weight * last + (1 - weight) * v;
      return last;
    });
  }

  // Nice linear splits: the largest step of 1, 2 or 5 x 10^k at most a fifth of the range, so an axis
  // always has 4 or more labelled ticks (uPlot's own may give 2 on a short chart).
  function linearSplits(u, axisIdx, min, max) {
    if (!(max > min)) return [min];
    const rough = (max - min) / 5, power = 10 ** Math.floor(Math.log10(rough));
    const step = [5, 2, 1].map((m) => m * power).find((s) => s <= rough);
    const out = [];
    for (let v = Math.ceil(min / step) * step; v <= max + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }

  function integerSplits(u, axisIdx, min, max) {
    const step = Math.max(1, Math.ceil((max - min) / 6));
    const out = [];
    for (let v = Math.ceil(min); v <= max; v += step) out.push(v);
    return out;
  }

  const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7].map((p) => m * p)).sort((a, b) => a - b);
  const xAxis = () => ({ font: FONT, labelFont: FONT, label: "step", labelSize: 18, size: 36, space: 60,
    incrs: STEP_INCRS, values: (u, splits) => splits.map(String) });  // steps are whole: so are their ticks
  const yAxis = (format, extra = {}) => ({ font: FONT, labelFont: FONT, size: 64, space: 24, splits: linearSplits,
    values: (u, splits) => splits.map(format), ...extra });

  // a log scale keeps uPlot's own splits (1, 2, 3 ... x 10^k), thinned where they would crowd
  const logAxis = (format) => ({ font: FONT, labelFont: FONT, size: 64, space: 24,
    values: (u, splits) => splits.map((v) => (v == null ? "" : format(v))) });

  // ------------------------------------------------------------------ markers

  // The steps where the job's attempt started again, each with its cause from the events: a resize, a
  // preemption (running -> queued), a rollback after a diverged run ("...: rolled back to step 799, ...",
  // marked where the resumed attempt's rows begin) or a restart. `metrics` are the chart's rows, oldest first.
  function markersOf(metrics, events) {
    const causes = events.filter((e) => e.to_status === "restarting" ||
      (e.from_status === "running" && ["queued", "suspended"].includes(e.to_status)));
    const used = new Set(), out = [];
    for (let i = 1; i < metrics.length; i += 1) {
      const before = metrics[i - 1], row = metrics[i];
      const resized = before.world_size != null && row.world_size != null && before.world_size !== row.world_size;
      if (row.attempt === before.attempt && !resized) continue;
      // the cause naming this attempt ("attempt 3 resumes from ..."), else the oldest one not matched yet
      let cause = causes.find((e) => !used.has(e) && e.reason.includes(`attempt ${row.attempt} `));
      cause = cause || causes.find((e) => !used.has(e));
      if (cause && row.attempt !== before.attempt) used.add(cause);
      const reason = cause ? cause.reason : "";
      const kind = resized || reason.startsWith("resized") || reason.includes(" resized ") ? "resize"
        : reason.startsWith("preempted") ? "preemption" : reason.includes(": rolled back to ") ? "rollback" : "restart";
      out.push({ step: row.step, kind, reason });
    }
    return out;
  }

  function drawMarkers(u, markers) {
    const { ctx } = u, { left, top, width, height } = u.bbox, ratio = window.devicePixelRatio || 1;
    const drawn = [];
    ctx.save();
    ctx.lineWidth = 2 * ratio;
    ctx.setLineDash([6 * ratio, 4 * ratio]);
    ctx.font = `${11 * ratio}px system-ui, sans-serif`;
    for (const marker of markers) {
      const x = Math.round(u.valToPos(marker.step, "x", true));
      if (!(x >= left && x <= left + width)) continue;
      ctx.strokeStyle = ctx.fillStyle = MARKER_COLOURS[marker.kind];
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      ctx.fillText(marker.kind, x + 4 * ratio, top + 12 * ratio);
      drawn.push(`${marker.kind}@${marker.step}`);
    }
    ctx.restore();
    u.root.dataset.markers = drawn.join(" ");
  }

  // ------------------------------------------------------------------ one chart

  // A uPlot in `container`, rebuilt by `build()` when its options change (the log-scale toggle: uPlot
  // fixes a scale's distribution when it is made). `state.markers` is read at every redraw.
  function chart(container, state, options) {
    let u = null, zoomed = false;  // a chart the user zoomed keeps its x range as new rows come
    container.addEventListener("dblclick", () => { zoomed = false; });  // uPlot zooms out on it
    function build(data) {
      if (u) u.destroy();
      zoomed = false;
      const opts = options();
      u = new uPlot({
        width: Math.max(280, container.clientWidth), height: HEIGHT, ...opts,
        cursor: { drag: { x: true, y: false }, ...(opts.cursor || {}) },  // drag to zoom, double-click to reset
        legend: { live: true },
        hooks: {
          draw: [(plot) => drawMarkers(plot, state.markers)],
          setSelect: [(plot) => { if (plot.select.width > 0) zoomed = true; }],
        },
      }, data, container);
      container.uplot = u;
    }
    new ResizeObserver(() => { if (u) u.setSize({ width: Math.max(280, container.clientWidth), height: HEIGHT }); })
      .observe(container);
    return {
      build,
      set(data) { if (!u) build(data); else u.setData(data, !zoomed); },
      redraw() { if (u) u.redraw(false, false); },
      data: () => (u ? u.data : null),
    };
  }

  // ------------------------------------------------------------------ the job page's charts

  function union(...lists) {
    return Array.from(new Set(lists.flat())).sort((a, b) => a - b);
  }

  function column(xs, rows, value) {  // rows' values at the steps xs; null where a row has none
    const at = new Map(rows.map((row) => [row.step, value(row)]));
    return xs.map((x) => (at.has(x) ? at.get(x) ?? null : null));
  }

  function jobCharts(root) {
    const state = { metrics: [], evaluated: [], checkpointed: [], events: [], markers: [] };
    const el = (id) => root.querySelector(`#${id} .u-chart`);
    const smoothing = root.querySelector("#loss-smoothing"), logScale = root.querySelector("#loss-log");
    const smoothingShown = root.querySelector("#loss-smoothing-value");
    const stepLegend = { label: "step", value: (u, v) => (v == null ? "—" : String(v)) };

    const loss = chart(el("loss-figure"), state, () => ({
      scales: { x: { time: false }, y: logScale.checked ? { distr: 3, log: 10 } : {} },
      axes: [xAxis(), logScale.checked ? logAxis(short) : yAxis(short)],
      series: [stepLegend,
        { label: "loss", stroke: COLOURS.raw, width: 1, value: (u, v) => short(v) },
        { label: "smoothed", stroke: COLOURS.train, width: 2, value: (u, v) => short(v) },
        { label: "eval loss", stroke: COLOURS.eval, width: 2, dash: [5, 3], spanGaps: true,
          points: { show: true, size: 5 }, value: (u, v) => short(v) }],
    }));
    const speed = chart(el("speed-figure"), state, () => ({
      scales: { x: { time: false }, s: {}, tps: {} },
      axes: [xAxis(), yAxis(short, { scale: "s", label: "s", labelFont: FONT, labelSize: 16 }),
        yAxis(short, { scale: "tps", side: 1, grid: { show: false }, label: "tokens/s", labelFont: FONT, labelSize: 16 })],
      series: [stepLegend,
        { label: "step time (s)", scale: "s", stroke: COLOURS.train, width: 2, spanGaps: true, value: (u, v) => short(v) },
        { label: "blocked by checkpoint (s)", scale: "s", stroke: COLOURS.eval, paths: () => null,
          points: { show: true, size: 7, fill: COLOURS.eval }, value: (u, v) => short(v) },
        { label: "tokens/s", scale: "tps", stroke: COLOURS.second, width: 2, spanGaps: true, value: (u, v) => short(v) }],
    }));
    const lr = chart(el("lr-figure"), state, () => ({
      scales: { x: { time: false } },
      axes: [xAxis(), yAxis(short)],
      series: [stepLegend, { label: "lr", stroke: COLOURS.train, width: 2, value: (u, v) => short(v) }],
    }));
    const gpus = chart(el("world-size-figure"), state, () => ({
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(4, Math.ceil((max || 0) * 1.25))] } },
      axes: [xAxis(), yAxis((v) => String(v), { splits: integerSplits })],
      series: [stepLegend, { label: "GPUs (N)", stroke: COLOURS.train, width: 2,
        paths: uPlot.paths.stepped({ align: 1 }), value: (u, v) => (v == null ? "—" : String(v)) }],
    }));
    const memory = chart(el("memory-figure"), state, () => ({
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(1, max) * 1.1] } },
      axes: [xAxis(), yAxis(bytes, { size: 72 })],
      series: [stepLegend,
        { label: "measured peak (max over ranks)", stroke: COLOURS.train, width: 2, value: (u, v) => bytes(v) },
        { label: "planned", stroke: COLOURS.eval, width: 2, dash: [6, 4], value: (u, v) => bytes(v) }],
    }));

    function lossData() {
      const { metrics, evaluated } = state;
      const xs = union(metrics.map((m) => m.step), evaluated.map((m) => m.step));
      const raw = column(xs, metrics, (m) => m.loss);
      const weight = Number(smoothing.value);
      return [xs, raw, ema(raw, weight), column(xs, evaluated, (m) => m.eval_loss)];
    }

    function draw() {
      const { metrics, checkpointed } = state;
      const steps = metrics.map((m) => m.step);
      loss.set(lossData());
      const xs = union(steps, checkpointed.map((m) => m.step));
      speed.set([xs, column(xs, metrics, (m) => m.step_time_s), column(xs, checkpointed, (m) => m.checkpoint_blocked_s),
        column(xs, metrics, (m) => m.tokens_per_s)]);
      lr.set([steps, metrics.map((m) => m.lr)]);
      gpus.set([steps, metrics.map((m) => m.world_size)]);
      memory.set([steps, metrics.map((m) => (m.mem_peak_bytes.length ? Math.max(...m.mem_peak_bytes) : null)),
        metrics.map((m) => m.mem_planned_bytes)]);
      root.dataset.points = metrics.length;
      // a chart with nothing to draw says so (before the first step; `lr` of rows stored before it was kept)
      const empty = { "loss-figure": lossData()[1], "speed-figure": steps, "lr-figure": metrics.map((m) => m.lr),
        "world-size-figure": metrics.map((m) => m.world_size), "memory-figure": steps };
      for (const [figure, values] of Object.entries(empty)) {
        root.querySelector(`#${figure}`).classList.toggle("no-data", !values.some((v) => v != null));
      }
    }

    function listMarkers() {
      const list = root.querySelector("#chart-markers");
      list.replaceChildren(...state.markers.map((m) => {
        const li = Object.assign(document.createElement("li"), { textContent: `${m.kind} at step ${m.step}` });
        if (m.reason) li.title = m.reason;
        Object.assign(li.dataset, { kind: m.kind, step: m.step });
        return li;
      }));
      list.hidden = !state.markers.length;
    }

    smoothing.addEventListener("input", () => {
      smoothingShown.textContent = Number(smoothing.value).toFixed(2);
      if (state.metrics.length) loss.set(lossData());
    });
    logScale.addEventListener("change", () => loss.build(lossData()));

    return {
      update({ metrics, evaluated, checkpointed }) {
        Object.assign(state, { metrics, evaluated, checkpointed });
        state.markers = markersOf(metrics, state.events);
        draw();
        listMarkers();
      },
      setEvents(events) {
        state.events = events;
        state.markers = markersOf(state.metrics, events);
        for (const c of [loss, speed, lr, gpus, memory]) c.redraw();
        listMarkers();
      },
    };
  }

  // ------------------------------------------------------------------ the compare and sweep pages

  // A series' colour: dashboard.css's --c0 ... --c11, the swatches' beside each job's name
  const PALETTE_SIZE = 12;
  const colour = (i) => getComputedStyle(document.documentElement).getPropertyValue(`--c${i % PALETTE_SIZE}`).trim();

  function valuesAt(xs, steps, values) {  // a series' values at the shared steps xs; null where it has no row
    const at = new Map(steps.map((step, i) => [step, values[i]]));
    return xs.map((x) => (at.has(x) ? at.get(x) ?? null : null));
  }

  // One line a job on shared steps: each series' [steps, values] are its fields `spec.steps` and `spec.values`.
  function overlay(container, list, spec) {
    const xs = union(...list.map((s) => s[spec.steps]));
    const columns = list.map((s) => valuesAt(xs, s[spec.steps], s[spec.values]));
    const c = chart(container, { markers: [] }, () => ({
      scales: { x: { time: false } },
      axes: [xAxis(), yAxis(short)],
      series: [{ label: "step", value: (u, v) => (v == null ? "—" : String(v)) },
        ...list.map((s, i) => ({ label: s.label, stroke: colour(i), width: 2, spanGaps: true,
          points: { show: (u, si) => columns[si - 1].filter((v) => v != null).length < 3 },
          value: (u, v) => short(v) }))],
    }));
    c.set([xs, ...columns]);
    container.closest("figure").classList.toggle("no-data", !columns.some((col) => col.some((v) => v != null)));
  }

  const padded = (u, min, max) => (max > min ? [min - (max - min) * 0.06, max + (max - min) * 0.06] : [min - 1, max + 1]);

  // A searched field's value (x) against each trial's metric (y): points only, the best a large amber one. A
  // field by category is drawn at its categories' places, labelled; `field.log`: a log x scale.
  function scatter(container, field) {
    const points = [...field.points].sort((a, b) => a.x - b.x);
    const cats = field.categories;
    const decade = (v) => Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-9;
    const xLabel = (v) => (v == null ? "" : cats ? (Number.isInteger(v) && cats[v] != null ? cats[v] : "") : short(v));
    const tick = (v) => (field.log && v != null && !decade(v) ? "" : xLabel(v));  // a log axis: its decades labelled
    const xScale = field.log ? { time: false, distr: 3, log: 10 }
      : { time: false, range: cats ? () => [-0.5, cats.length - 0.5] : padded };
    const c = chart(container, { markers: [] }, () => ({
      mode: 1,
      scales: { x: xScale, y: { range: padded } },
      axes: [{ font: FONT, labelFont: FONT, label: field.path, labelSize: 18, size: 36, space: 40,
        ...(cats ? { splits: () => cats.map((_, i) => i) } : {}), values: (u, splits) => splits.map(tick) },
      yAxis(short)],
      series: [{ label: field.path, value: (u, v) => (v == null ? "—" : xLabel(v)) },
        { label: field.metric, stroke: colour(0), fill: colour(0), paths: () => null,
          points: { show: true, size: 8, fill: colour(0) }, value: (u, v) => short(v) },
        { label: "best", stroke: "#b45309", paths: () => null,
          points: { show: true, size: 16, width: 2, fill: "#fbbf24" }, value: (u, v) => short(v) }],
    }));
    c.set([points.map((p) => p.x), points.map((p) => p.y), points.map((p) => (p.best ? p.y : null))]);
    container.closest("figure").classList.toggle("no-data", !points.length);
  }

  // compare.html and sweep.html: the overlays and scatters the server described in #chart-data
  function experimentCharts(root, data) {
    const el = (id) => root.querySelector(`#${id} .u-chart`);
    for (const spec of data.overlays) if (el(spec.figure)) overlay(el(spec.figure), data.series, spec);
    for (const field of data.scatters) scatter(el(field.figure), field);
    root.body.dataset.drawn = String(data.overlays.length + data.scatters.length);
  }

  window.zero1Charts = { jobCharts, ema, markersOf, experimentCharts };
})();
