/**
 * The memory chart keeps up with 8 ranks x 10 Hz over 10 minutes of history
 * (issue 5): synthetic samples, the real chart in the real JupyterLab page.
 */
import { expect, test } from '@jupyterlab/galata';

import { runCommand, screenshot } from './helpers';

test('memory chart keeps up with 8 ranks x 10 Hz x 10 min', async ({ page }) => {
  const result = await runCommand(page, 'mpnb:chart-benchmark', { ranks: 8, hz: 10, seconds: 600, liveSeconds: 6, keep: true });
  console.log(`chart benchmark: ${JSON.stringify(result)}`);
  expect(result.backlog_samples).toBe(8 * 10 * 600);
  expect(result.rows_kept_per_rank).toBe(6000);
  // Decimated: about two points per pixel column per rank, not 6000.
  expect(result.points_per_draw).toBeLessThan(8 * 2 * 1500);
  expect(result.points_per_draw).toBeGreaterThan(8 * 100);
  // Keeping up: every live batch (4 a second) was drawn before the next one arrived, and a
  // draw never takes longer than the gap between batches (250 ms), even on 2 busy CPU cores.
  expect(result.live_batches).toBe(24);
  expect(result.missed_batches).toBe(0);
  expect(result.draw_ms_p95).toBeLessThan(250);
  expect(result.lag_ms_p95).toBeLessThan(250);
  await screenshot(page, 'chart-benchmark');
});
