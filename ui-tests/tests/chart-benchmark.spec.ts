/**
 * The memory chart keeps up with 8 ranks x 10 Hz over 10 minutes of history
 * (issue 5): synthetic samples, the real chart in the real JupyterLab page.
 */
import { expect } from '@jupyterlab/galata';

import { runCommand, screenshot, test } from './helpers';

test('memory chart keeps up with 8 ranks x 10 Hz x 10 min', async ({ page }) => {
  const result = await runCommand(page, 'mpnb:chart-benchmark', { ranks: 8, hz: 10, seconds: 600, liveSeconds: 6, keep: true });
  console.log(`chart benchmark: ${JSON.stringify(result)}`);
  expect(result.backlog_samples).toBe(8 * 10 * 600);
  expect(result.rows_kept_per_rank).toBe(6000);
  // Decimated: about two points per pixel column per rank, not 6000.
  expect(result.points_per_draw).toBeLessThan(8 * 2 * 1500);
  expect(result.points_per_draw).toBeGreaterThan(8 * 100);
  // Keeping up: live batches (4 a second) are drawn before the next one arrives, and a draw
  // takes well under the gap between batches (250 ms). Medians, with at most 2 of 24 batches
  // late: the 2 CPU cores here are shared with kernels and engines, and a stall of the whole
  // browser is not the chart falling behind.
  expect(result.live_batches).toBe(24);
  expect(result.missed_batches).toBeLessThanOrEqual(2);
  expect(result.draw_ms_median).toBeLessThan(125);
  expect(result.lag_ms_median).toBeLessThan(250);
  // How much cheaper decimation makes a draw (naive_over_decimated, logged above: 2.5-2.9 on a
  // quiet machine, 1.1 once under CI load) is a speed ratio: reported, not asserted here.
  await screenshot(page, 'chart-benchmark');
});
