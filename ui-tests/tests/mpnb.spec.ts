/**
 * mpnb in JupyterLab as a user meets it: load the extension, start a 2-rank
 * cluster, run a %%distributed training cell, watch the sidebar, the memory
 * chart and the status bar, stop the ranks, reload the page, and open a second
 * notebook whose kernel has no cluster. Real kernel, real ipyparallel engines.
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';

import { runCommand, screenshot, setCells, stopCluster } from './helpers';

const SIDEBAR = '#mpnb-distributed-sidebar';
const STATUS = '.mpnb-status-text';

// Trains until stopped (or 3 minutes), the way DESIGN.md's loop does.
const TRAIN = [
  '%%distributed',
  'import time',
  'from mpnb.models import tiny_gpt, synthetic_batches',
  'trainer = mpnb.prepare(tiny_gpt())',
  'start = time.time()',
  'for step, batch in enumerate(synthetic_batches(steps=100_000)):',
  '    loss = trainer.step(batch)',
  '    if mpnb.should_stop() or time.time() - start > 180:',
  '        break',
  'print(f"rank {rank} stopped at step {step}")'
].join('\n');

async function cellPrompt(page: IJupyterLabPageFixture, index: number) {
  return page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').nth(index).locator('.jp-InputPrompt');
}

async function chartData(page: IJupyterLabPageFixture, rank: number, key: string): Promise<number> {
  const value = await page
    .locator(`${SIDEBAR} .mpnb-rank-chart[data-rank="${rank}"]`)
    .getAttribute(`data-${key}`, { timeout: 1000 })
    .catch(() => null);
  return Number(value ?? 0);
}

const chartPoints = (page: IJupyterLabPageFixture, rank: number) => chartData(page, rank, 'points');

test.describe.configure({ mode: 'serial' });
// galata's kernel-tracking route parses every POST /api/kernels/* reply as JSON and breaks the test on
// the empty (204) reply of an interrupt, which is what "Stop All Ranks" sends: don't track kernels.
test.use({ kernels: null });

test('sidebar, status bar, memory chart and stop on a 2-rank cluster', async ({ page, tmpPath }) => {
  test.setTimeout(300_000);
  await page.notebook.createNew('train.ipynb');
  await setCells(page, ['%load_ext mpnb', '%mpnb start -n 2', TRAIN]);
  await runCommand(page, 'mpnb:open-dashboard');
  const sidebar = page.locator(SIDEBAR);
  await expect(sidebar).toBeVisible();
  // Before %load_ext: the kernel closes the comm; the sidebar says how to start.
  await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('not loaded');
  await expect(sidebar.locator('.mpnb-start-button')).toBeVisible();

  try {
    await page.notebook.runCell(0);
    // The kernel announces itself over a comm it opens: no reload needed.
    await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('No cluster is running');
    await expect(page.locator(STATUS)).toHaveText('mpnb · no cluster');

    await page.notebook.runCell(1);
    const rows = sidebar.locator('.mpnb-rank-row');
    await expect(rows).toHaveCount(2, { timeout: 120_000 });
    await expect(rows.nth(0)).toContainText('cpu');
    await expect(sidebar.locator('.mpnb-strategy-line')).toContainText('DDP');
    await expect(page.locator(STATUS)).toHaveText('mpnb · 2 ranks · DDP · idle');

    // The training cell: marked as distributed, runs on both ranks, memory streams in.
    await page.notebook.runCell(2, { wait: false });
    const trainCell = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').nth(2);
    await expect(trainCell).toHaveClass(/mpnb-distributed-cell/);
    await expect(trainCell.locator('.mpnb-magic-line')).toHaveText('%%distributed');
    await expect(page.locator(STATUS)).toHaveText('mpnb · 2 ranks · DDP · running', { timeout: 60_000 });
    await expect(trainCell.locator('.mpnb-cell-ranks')).toContainText('2 ranks busy');
    await expect(sidebar.locator('.mpnb-last-cell')).toHaveClass(/mpnb-status-running/);
    for (const rank of [0, 1]) {
      await expect.poll(() => chartPoints(page, rank), { timeout: 60_000 }).toBeGreaterThan(2);
    }
    // Training has started once the Trainer reports the parameters it holds.
    for (const rank of [0, 1]) {
      await expect.poll(() => chartData(page, rank, 'parameters'), { timeout: 90_000 }).toBeGreaterThan(0);
    }
    await page.waitForTimeout(2000); // a little training history on the chart for the picture
    await screenshot(page, 'e2e-1-running');

    // "Stop all ranks" from the notebook toolbar's mpnb menu ends the running cell.
    await page.locator('.mpnb-toolbar-button').click();
    await page.locator('.lm-Menu-item', { hasText: 'Stop All Ranks' }).click();
    await expect(await cellPrompt(page, 2)).toHaveText(/\[\d+\]/, { timeout: 60_000 });
    await expect(sidebar.locator('.mpnb-last-cell')).toHaveClass(/mpnb-status-stopped/, { timeout: 30_000 });
    await expect(trainCell.locator('.mpnb-cell-ranks')).toHaveClass(/mpnb-status-stopped/);
    await expect(page.locator(STATUS)).toHaveText('mpnb · 2 ranks · DDP · idle', { timeout: 30_000 });
    await screenshot(page, 'e2e-2-stopped');

    // After a page reload the sidebar reconnects, with the cluster and the chart's history.
    await page.reload();
    await page.notebook.activate('train.ipynb');
    await runCommand(page, 'mpnb:open-dashboard');
    await expect(page.locator(`${SIDEBAR} .mpnb-rank-row`)).toHaveCount(2, { timeout: 60_000 });
    await expect(page.locator(STATUS)).toHaveText('mpnb · 2 ranks · DDP · idle');
    await expect.poll(() => chartPoints(page, 0), { timeout: 30_000 }).toBeGreaterThan(2);

    // A second notebook on its own kernel: its sidebar shows its own (absent) cluster.
    await page.notebook.createNew('other.ipynb');
    await expect(page.locator(`${SIDEBAR} .mpnb-sidebar-empty`)).toContainText('not loaded', {
      timeout: 60_000
    });
    await expect(page.locator(STATUS)).toBeHidden();
    await screenshot(page, 'e2e-3-other-notebook');
    await page.notebook.activate('train.ipynb');
    await expect(page.locator(`${SIDEBAR} .mpnb-rank-row`)).toHaveCount(2);
    await expect(page.locator(STATUS)).toHaveText('mpnb · 2 ranks · DDP · idle');

    // The status bar item opens the sidebar; the stop command stops the cluster.
    await page.locator('.mpnb-status-item').click();
    await expect(page.locator(SIDEBAR)).toBeVisible();
    await runCommand(page, 'mpnb:stop-cluster');
    await expect(page.locator(`${SIDEBAR} .mpnb-sidebar-empty`)).toContainText('No cluster is running', {
      timeout: 60_000
    });
    await expect(page.locator(STATUS)).toHaveText('mpnb · no cluster');
  } finally {
    await page.notebook.activate('train.ipynb').catch(() => undefined);
    await stopCluster(page).catch(() => undefined);
  }
  void tmpPath;
});
