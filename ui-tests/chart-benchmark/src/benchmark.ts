/**
 * `mpnb:chart-benchmark` (test-only command, used by the browser test): can the
 * memory chart keep up with N ranks x H Hz with S seconds of history?
 * Fills the history with synthetic samples, then streams new ones in
 * comm-sized batches (4 per second) for a few seconds and reports draw
 * times and whether every batch was drawn before the next one arrived.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import { ReadonlyPartialJSONObject } from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';

import { MemoryChart } from '../../../lib/chart/chart';
import { IMemorySample, MemoryHistory } from '../../../lib/chart/history';

export const BENCHMARK_COMMAND = 'mpnb:chart-benchmark';

const MiB = 1024 * 1024;
// Bytes sent count from a day before the benchmark starts (unix seconds would overflow 2^53 bytes).
const SENT_FROM = Date.now() / 1000 - 86400;

function sample(rank: number, t: number): IMemorySample {
  const phase = t * 0.7 + rank;
  const parameters = 120 * MiB;
  const gradients = 120 * MiB * (0.5 + 0.5 * Math.sin(phase));
  const optimizer = 240 * MiB;
  const other = 80 * MiB + 40 * MiB * Math.abs(Math.sin(phase * 3.1));
  const used = parameters + gradients + optimizer + other;
  // 50 MiB/s give or take 20, always rising: the integral of 50 + 20 sin(phase) MiB/s
  const sent = 50 * MiB * (t - SENT_FROM) - ((20 * MiB) / 0.7) * Math.cos(phase) + 30 * MiB;
  return {
    rank,
    t,
    busy: true,
    device_kind: 'cpu',
    used,
    reserved: used,
    peak: 700 * MiB,
    capacity: 2048 * MiB,
    device_used: null,
    oom_count: 0,
    parameters,
    gradients,
    optimizer,
    other,
    comm_sent: Math.round(sent)
  };
}

const nextFrame = (): Promise<number> => new Promise(resolve => requestAnimationFrame(resolve));
const sleep = (ms: number): Promise<void> => new Promise(resolve => setTimeout(resolve, ms));

function quantile(values: number[], q: number): number {
  if (values.length === 0) {
    return NaN;
  }
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

const round = (x: number): number => Math.round(x * 100) / 100;

export async function runChartBenchmark(
  app: JupyterFrontEnd,
  args: ReadonlyPartialJSONObject
): Promise<Record<string, number>> {
  const ranks = Number(args.ranks ?? 8);
  const hz = Number(args.hz ?? 10);
  const seconds = Number(args.seconds ?? 600);
  const liveSeconds = Number(args.liveSeconds ?? 5);
  const batchesPerSecond = 4;
  // keep: leave the chart open afterwards (for a screenshot)
  const keep = Boolean(args.keep);

  const history = new MemoryHistory(seconds);
  const chart = new MemoryChart(history, { plotHeight: 120, ranks: [...Array(ranks).keys()] });
  const host = new Widget();
  host.id = 'mpnb-chart-benchmark';
  host.title.label = 'mpnb chart benchmark';
  host.title.closable = true;
  host.addClass('mpnb-benchmark');
  host.node.style.overflow = 'auto';
  host.node.appendChild(chart.node);
  app.shell.add(host, 'main');
  app.shell.activateById(host.id);
  await nextFrame();

  try {
    // 1. The backlog: `seconds` of history for every rank, as if the page was reloaded late.
    const now = Date.now() / 1000;
    const t0 = now - seconds;
    const backlog: IMemorySample[] = [];
    for (let i = 0; i < seconds * hz; i++) {
      for (let r = 0; r < ranks; r++) {
        backlog.push(sample(r, t0 + i / hz));
      }
    }
    let start = performance.now();
    history.add(backlog);
    const ingestMs = performance.now() - start;
    start = performance.now();
    chart.drawNow();
    const firstDrawMs = performance.now() - start;
    const kept = history.length(0);

    // 2. Live: batches every 250 ms; each must be drawn before the next arrives.
    const perBatch = hz / batchesPerSecond;
    const batches = liveSeconds * batchesPerSecond;
    const drawsBefore = chart.stats.draws;
    const recentBefore = chart.stats.recent.length;
    const lags: number[] = [];
    const frameGaps: number[] = [];
    let missed = 0;
    let t = now;
    let stop = false;
    const frames = (async () => {
      let last = await nextFrame();
      while (!stop) {
        const ts = await nextFrame();
        frameGaps.push(ts - last);
        last = ts;
      }
    })();
    for (let b = 0; b < batches; b++) {
      const batch: IMemorySample[] = [];
      for (let k = 0; k < perBatch; k++) {
        t += 1 / hz;
        for (let r = 0; r < ranks; r++) {
          batch.push(sample(r, t));
        }
      }
      const pushedAt = performance.now();
      const draws = chart.stats.draws;
      history.add(batch);
      // Wait until the chart drew this batch, up to the next batch's arrival.
      while (chart.stats.draws === draws && performance.now() - pushedAt < 1000 / batchesPerSecond) {
        await nextFrame();
      }
      if (chart.stats.draws === draws) {
        missed++;
      } else {
        lags.push(performance.now() - pushedAt);
      }
      const rest = 1000 / batchesPerSecond - (performance.now() - pushedAt);
      if (rest > 0) {
        await sleep(rest);
      }
    }
    stop = true;
    await frames;
    const drawTimes = chart.stats.recent.slice(recentBefore);

    // 3. Baseline in the same run: a full redraw of every visible rank with and without
    //    decimation, alternating so that load on the machine hits both alike.
    const full = { decimated: [] as number[], naive: [] as number[] };
    for (let k = 0; k < 3; k++) {
      for (const decimate of [false, true]) {
        chart.decimate = decimate;
        chart.invalidate();
        await nextFrame();
        const t0 = performance.now();
        chart.drawNow();
        full[decimate ? 'decimated' : 'naive'].push(performance.now() - t0);
      }
    }
    chart.decimate = true;
    return {
      ranks,
      hz,
      history_seconds: seconds,
      backlog_samples: backlog.length,
      rows_kept_per_rank: kept,
      ingest_ms: round(ingestMs),
      first_draw_ms: round(firstDrawMs),
      live_batches: batches,
      live_draws: chart.stats.draws - drawsBefore,
      missed_batches: missed,
      draw_ms_median: round(quantile(drawTimes, 0.5)),
      draw_ms_p95: round(quantile(drawTimes, 0.95)),
      draw_ms_max: round(Math.max(...drawTimes)),
      points_per_draw: chart.stats.lastPoints,
      lag_ms_median: round(quantile(lags, 0.5)),
      lag_ms_p95: round(quantile(lags, 0.95)),
      frame_gap_ms_p95: round(quantile(frameGaps, 0.95)),
      full_draw_ms_decimated: round(quantile(full.decimated, 0.5)),
      full_draw_ms_naive: round(quantile(full.naive, 0.5)),
      naive_over_decimated: round(quantile(full.naive, 0.5) / quantile(full.decimated, 0.5))
    };
  } finally {
    if (!keep) {
      chart.dispose();
      host.dispose();
    }
  }
}
