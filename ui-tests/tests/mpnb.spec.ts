/**
 * mpnb in JupyterLab as a user meets it: load the extension, start a 2-rank
 * cluster, run a %%distributed training cell, watch the sidebar, the memory
 * chart and the status bar, stop the ranks, reload the page, and open a second
 * notebook whose kernel has no cluster. Real kernel, real ipyparallel engines.
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';

import { activateNotebook, gotoLab, openNotebook, runCell, runCommand, screenshot, stopCluster, test } from './helpers';
import { cutLabels } from './layout';

const SIDEBAR = '#mpnb-distributed-sidebar';
const STATUS = '.mpnb-status-text';

// Trains until stopped (or 3 minutes), the way DESIGN.md's loop does, saving a checkpoint once
// (rank 0's path counts: each rank makes a folder, rank 0's receives the checkpoint).
const TRAIN = [
  '%%distributed',
  'import tempfile, time',
  'from mpnb.models import tiny_gpt, synthetic_batches',
  'trainer = mpnb.prepare(tiny_gpt())',
  'start = time.time()',
  'for step, batch in enumerate(synthetic_batches(steps=100_000)):',
  '    loss = trainer.step(batch)',
  '    if step == 3:',
  '        trainer.save(tempfile.mkdtemp(prefix="mpnb-e2e-") + "/step-4")',
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
  const sidebar = page.locator(SIDEBAR);
  const status = page.locator(STATUS);
  const trainCell = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').nth(2);
  await test.step('open a notebook: the sidebar says mpnb is not loaded', async () => {
    await openNotebook(page, `${tmpPath}/train.ipynb`, ['%load_ext mpnb', '%mpnb start -n 2', TRAIN]);
    await runCommand(page, 'mpnb:open-dashboard');
    await expect(sidebar).toBeVisible();
    // Before %load_ext the kernel closes the comm; the sidebar says how to start, with a button.
    await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('not loaded');
    await expect(sidebar.locator('.mpnb-start-button')).toBeVisible();
  });

  try {
    await test.step('%load_ext mpnb: the kernel announces itself, no reload needed', async () => {
      await runCell(page, 0);
      await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('No cluster is running');
      await expect(status).toHaveText('mpnb · no cluster');
    });

    await test.step('%mpnb start -n 2: two ranks in the sidebar and the status bar', async () => {
      await runCell(page, 1);
      const rows = sidebar.locator('.mpnb-rank-row');
      await expect(rows).toHaveCount(2, { timeout: 120_000 });
      await expect(rows.nth(0)).toContainText('cpu');
      await expect(sidebar.locator('.mpnb-strategy-line')).toContainText('DDP');
      await expect(status).toHaveText('mpnb · 2 ranks · DDP · idle');
      await expect(sidebar.locator('.mpnb-checkpoints .mpnb-note')).toHaveText(/^No checkpoint saved in this session/);
    });

    await test.step('%%distributed training: marked cell, busy ranks, live memory for both ranks', async () => {
      await runCell(page, 2, false);
      await expect(trainCell).toHaveClass(/mpnb-distributed-cell/);
      await expect(trainCell.locator('.mpnb-magic-line')).toHaveText('%%distributed');
      await expect(status).toHaveText('mpnb · 2 ranks · DDP · running', { timeout: 60_000 });
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
      // CPU ranks: the RSS is its own line and axis; the key's buttons hide categories
      await expect(sidebar.locator('.mpnb-rank-chart-summary').first()).toContainText('RSS');
      await expect(sidebar.locator('.mpnb-rank-chart-summary').first()).toContainText('est '); // prepare sent it
      const activations = sidebar.locator('.mpnb-memory-chart-key button[data-category="activations"]');
      await expect(activations).toHaveAttribute('aria-pressed', 'true');
      await activations.click();
      await expect(activations).toHaveAttribute('aria-pressed', 'false');
      await screenshot(page, 'e2e-1b-activations-hidden');
      await activations.click();
      // DDP's all-reduces show under each rank's memory as bytes sent per second; the key hides them
      const comm = sidebar.locator('.mpnb-rank-chart[data-rank="0"] .mpnb-rank-chart-comm');
      await expect(comm).toBeVisible();
      await expect(sidebar.locator('.mpnb-rank-chart-summary').first()).toContainText(/sent\s[\d.]+\s(KiB|MiB)\/s/);
      const sent = sidebar.locator('.mpnb-memory-chart-key button[data-comm="sent"]');
      await sent.click();
      await expect(comm).toBeHidden();
      await sent.click();
      await expect(comm).toBeVisible();
    });

    await test.step('the checkpoint the cell saved is listed under the chart', async () => {
      const row = sidebar.locator('.mpnb-checkpoint-row');
      await expect(row).toHaveCount(1, { timeout: 60_000 });
      await expect(row.locator('.mpnb-checkpoint-name')).toHaveText('step-4');
      await expect(row.locator('.mpnb-checkpoint-name')).toHaveAttribute('title', /^\/.*mpnb-e2e-.*\/step-4$/);
      await expect(row.locator('.mpnb-checkpoint-step')).toHaveText(/^step\s4$/); // no-break spaces: each item stays whole
      await expect(row.locator('.mpnb-checkpoint-layout')).toHaveText(/^DDP\s×\s2$/);
      await expect(row.locator('.mpnb-checkpoint-size')).toHaveText(/^[\d.]+\s(KiB|MiB)$/);
      await expect(row.locator('.mpnb-checkpoint-saved')).toHaveText(/^\d\d:\d\d:\d\d$/);
      const texts = '.mpnb-checkpoint-name, .mpnb-checkpoint-saved, .mpnb-checkpoint-details';
      expect(await cutLabels(sidebar, texts)).toEqual([]);
      await row.scrollIntoViewIfNeeded();
      await screenshot(page, 'e2e-1c-checkpoints');
    });

    await test.step('"Stop All Ranks" from the notebook toolbar ends the running cell', async () => {
      await page.locator('.mpnb-toolbar-button').click();
      await page.locator('.lm-Menu-item', { hasText: 'Stop All Ranks' }).click();
      await expect(await cellPrompt(page, 2)).toHaveText(/\[\d+\]/, { timeout: 60_000 });
      await expect(sidebar.locator('.mpnb-last-cell')).toHaveClass(/mpnb-status-stopped/, { timeout: 30_000 });
      await expect(trainCell.locator('.mpnb-cell-ranks')).toHaveClass(/mpnb-status-stopped/);
      await expect(status).toHaveText('mpnb · 2 ranks · DDP · idle', { timeout: 30_000 });
      await screenshot(page, 'e2e-2-stopped');
    });

    await test.step('a rank\'s "log" link opens the end of its engine log in a read-only tab', async () => {
      await sidebar.locator('.mpnb-rank-row[data-rank="1"] .mpnb-log-link').click();
      const tab = page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab', { hasText: 'mpnb log · rank 1' });
      await expect(tab).toBeVisible();
      const panel = page.locator('.mpnb-log-panel:not(.lm-mod-hidden)');
      await expect(panel.locator('.mpnb-log-path')).toContainText(/last 200 lines of \/.*engine-\d+\.log/);
      await expect(panel.locator('.mpnb-log-text')).not.toHaveText(/^(Loading…)?$/);
      await screenshot(page, 'e2e-2b-engine-log');
      await tab.locator('.lm-TabBar-tabCloseIcon').click();
      await expect(tab).toBeHidden();
    });

    await test.step('page reload: the sidebar reconnects with the cluster and the chart history', async () => {
      await gotoLab(page, '', true);
      await activateNotebook(page, `${tmpPath}/train.ipynb`);
      await runCommand(page, 'mpnb:open-dashboard');
      await expect(sidebar.locator('.mpnb-rank-row')).toHaveCount(2, { timeout: 60_000 });
      await expect(sidebar.locator('.mpnb-checkpoint-row')).toHaveCount(1); // the kernel's list, sent again
      await expect(status).toHaveText('mpnb · 2 ranks · DDP · idle');
      await expect.poll(() => chartPoints(page, 0), { timeout: 30_000 }).toBeGreaterThan(2);
    });

    await test.step('a second notebook on its own kernel shows its own (absent) cluster', async () => {
      await openNotebook(page, `${tmpPath}/other.ipynb`, ['1 + 1']);
      await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('not loaded', { timeout: 60_000 });
      await expect(status).toBeHidden();
      await screenshot(page, 'e2e-3-other-notebook');
      await activateNotebook(page, `${tmpPath}/train.ipynb`);
      await expect(sidebar.locator('.mpnb-rank-row')).toHaveCount(2);
      await expect(status).toHaveText('mpnb · 2 ranks · DDP · idle');
    });

    await test.step('the status bar item opens the sidebar; the stop command stops the cluster', async () => {
      await page.evaluate(() => (window as any).jupyterapp.shell.collapseRight());
      await expect(sidebar).toBeHidden();
      await page.locator('.mpnb-status-item').click();
      await expect(sidebar).toBeVisible();
      await runCommand(page, 'mpnb:stop-cluster');
      await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('No cluster is running', {
        timeout: 60_000
      });
      await expect(status).toHaveText('mpnb · no cluster');
    });
  } finally {
    await stopCluster(page, `${tmpPath}/train.ipynb`);
  }
});
