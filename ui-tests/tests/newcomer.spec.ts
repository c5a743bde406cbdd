/**
 * The newcomer's first walk through notebooks/01_quickstart.ipynb, as the notebook and
 * DESIGN.md's loop lead it: run the notebook (up to its closing `%mpnb stop`), open the config
 * panel from the sidebar, switch to ZeRO-3, Apply, run the training cell again, stop it, stop
 * the cluster. No cell may show a traceback, an error, a linker line or a warning (unless it is
 * tagged `raises-exception`), and the layout must hold: chips clear of the code, labels whole,
 * one cluster panel. Screenshots go to build/newcomer/ (kept as CI artifacts).
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import * as fs from 'fs';
import * as path from 'path';

import { activateNotebook, runCell, runCommand, screenshot, stopCluster, test } from './helpers';
import { badgeOverlap, cutLabels, splitItems } from './layout';

const ROOT = path.resolve(__dirname, '..', '..');
const SHOTS = path.join(ROOT, 'build', 'newcomer');
const SIDEBAR = '#mpnb-distributed-sidebar';
const CELLS = '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell';

/** What a newcomer must never see in a cell that is not meant to fail (`ld:` as linkers print it). */
const NOISE: [string, RegExp][] = [
  ['Traceback', /Traceback/],
  ['error', /error/i],
  ['ld:', /(^|[\s/])ld:/m],
  ['Warning', /warning/i]
];

interface ICellText {
  index: number;
  source: string;
  text: string;
  meantToFail: boolean;
}

/** Every code cell's outputs as text (streams, errors, text/plain, text/html, text/markdown). */
async function outputs(page: IJupyterLabPageFixture): Promise<ICellText[]> {
  return page.evaluate(() => {
    const notebook = (window as any).jupyterapp.shell.currentWidget.content;
    const join = (v: unknown): string => (Array.isArray(v) ? v.join('') : typeof v === 'string' ? v : '');
    const cells: any[] = [];
    notebook.widgets.forEach((cell: any, index: number) => {
      if (cell.model.type !== 'code') {
        return;
      }
      const parts: string[] = [];
      for (const out of cell.model.outputs.toJSON() as any[]) {
        if (out.output_type === 'stream') {
          parts.push(join(out.text));
        } else if (out.output_type === 'error') {
          parts.push(`${out.ename}: ${out.evalue}`, ...(out.traceback ?? []));
        } else {
          for (const mime of ['text/plain', 'text/html', 'text/markdown']) {
            parts.push(join(out.data?.[mime]));
          }
        }
      }
      const tags: string[] = cell.model.getMetadata('tags') ?? [];
      cells.push({
        index,
        source: cell.model.sharedModel.getSource(),
        text: parts.join('\n'),
        meantToFail: tags.includes('raises-exception')
      });
    });
    return cells;
  });
}

/** "cell 9 (%%distributed…): 'Warning' in: …the line…" for each cell output that has noise. */
function noise(cells: ICellText[]): string[] {
  const found: string[] = [];
  for (const cell of cells.filter(c => !c.meantToFail)) {
    for (const [name, pattern] of NOISE) {
      const line = cell.text.split('\n').find(l => pattern.test(l));
      if (line !== undefined) {
        const head = cell.source.split('\n')[0].slice(0, 40);
        found.push(`cell ${cell.index} (${head}): '${name}' in: ${line.trim().slice(0, 300)}`);
      }
    }
  }
  return found;
}

/** Rank 0's parameter bytes in the sidebar chart's newest sample (0 when none). */
async function parameterBytes(page: IJupyterLabPageFixture): Promise<number> {
  const value = await page
    .locator(`${SIDEBAR} .mpnb-rank-chart[data-rank="0"]`)
    .getAttribute('data-parameters', { timeout: 1000 })
    .catch(() => null);
  return Number(value ?? 0);
}

/** Index of the first cell whose source satisfies `test`. */
async function findCell(page: IJupyterLabPageFixture, pattern: string): Promise<number> {
  const index = await page.evaluate(pattern => {
    const notebook = (window as any).jupyterapp.shell.currentWidget.content;
    return notebook.widgets.findIndex((c: any) => new RegExp(pattern, 'm').test(c.model.sharedModel.getSource()));
  }, pattern);
  expect(index, `a cell matching /${pattern}/`).toBeGreaterThanOrEqual(0);
  return index;
}

test.describe.configure({ mode: 'serial' });
// "Stop All Ranks" is a kernel interrupt, whose empty reply galata's kernel tracking cannot parse.
test.use({ kernels: null });

test('newcomer walk: 01 quickstart, panel, ZeRO-3, stop', async ({ page, tmpPath }) => {
  test.setTimeout(540_000);
  fs.rmSync(SHOTS, { recursive: true, force: true });
  const file = `${tmpPath}/01_quickstart.ipynb`;
  const sidebar = page.locator(SIDEBAR);
  const cellNodes = page.locator(CELLS);

  await test.step('open 01_quickstart: one cluster panel (mpnb’s), not ipyparallel’s too', async () => {
    const source = fs.readFileSync(path.join(ROOT, 'notebooks', '01_quickstart.ipynb'), 'utf-8');
    await page.contents.uploadContent(source, 'text', file);
    await activateNotebook(page, file);
    await runCommand(page, 'mpnb:open-dashboard');
    await expect(sidebar).toBeVisible();
    await expect(page.locator('#ipp-cluster-launcher')).toHaveCount(0);
    await expect(page.locator('.lm-TabBar-tab[title*="IPython Parallel"]')).toHaveCount(0);
  });

  const stopIndex = await findCell(page, '^%mpnb stop\\s*$');
  const trainIndex = await findCell(page, '^%%distributed[\\s\\S]*mpnb\\.prepare\\(');
  const trainCell = cellNodes.nth(trainIndex);
  try {
    await test.step('run all (up to the closing %mpnb stop)', async () => {
      await page.evaluate(async stopIndex => {
        const app = (window as any).jupyterapp;
        app.shell.currentWidget.content.activeCellIndex = stopIndex;
        await app.commands.execute('notebook:run-all-above');
      }, stopIndex);
      await expect(sidebar.locator('.mpnb-rank-row')).toHaveCount(2);
      await expect(trainCell.locator('.mpnb-cell-ranks')).toContainText('done', { timeout: 60_000 });
      expect(await badgeOverlap(trainCell)).toBe(0);
      await trainCell.scrollIntoViewIfNeeded();
      await screenshot(page, '1-run-all', SHOTS);
    });

    await test.step('the sidebar: memory summary items stay whole', async () => {
      const summaries = sidebar.locator('.mpnb-rank-chart-summary');
      await expect(summaries).toHaveCount(2);
      for (const i of [0, 1]) {
        expect(await splitItems(summaries.nth(i))).toEqual([]);
      }
      expect(await splitItems(sidebar.locator('.mpnb-strategy-line'))).toEqual([]);
      expect(await cutLabels(sidebar, 'button')).toEqual([]);
    });

    const panel = page.locator('.mpnb-panel');
    await test.step('open the config panel from the sidebar: in view, labels whole', async () => {
      await sidebar.locator('.mpnb-config-button').click();
      await expect(panel).toBeVisible({ timeout: 90_000 });
      await expect(panel.locator('.mpnb-panel-apply')).toBeInViewport();
      expect(await cutLabels(panel, '.lm-TabBar-tabLabel', '.lm-TabBar')).toEqual([]);
      expect(await cutLabels(panel, 'button')).toEqual([]);
      await screenshot(page, '2-panel', SHOTS);
      // The Export tab's buttons ("Save ds_config.json") and the Import tab's upload.
      for (const tab of ['Export', 'Import']) {
        await panel.locator('.lm-TabBar-tab', { hasText: tab }).click();
        expect(await cutLabels(panel, 'button, .jupyter-widget-upload')).toEqual([]);
      }
      await panel.locator('.lm-TabBar-tab').first().click();
    });

    await test.step('switch to ZeRO-3 and Apply', async () => {
      await panel.locator('.mpnb-panel-strategy button', { hasText: 'ZeRO' }).click();
      await panel.locator('.mpnb-panel-zero-stage label', { hasText: /^3 ·/ }).click();
      expect(await cutLabels(panel, '.mpnb-panel-form label', '.mpnb-panel-form')).toEqual([]);
      const apply = panel.locator('.mpnb-panel-apply');
      await expect(apply).toBeEnabled();
      await apply.click();
      await expect(apply).toBeDisabled({ timeout: 60_000 }); // applied: nothing left to change
      await expect(sidebar.locator('.mpnb-strategy-line')).toContainText('ZeRO-3', { timeout: 60_000 });
      await panel.scrollIntoViewIfNeeded();
      await screenshot(page, '3-zero3-applied', SHOTS);
    });

    await test.step('run the training cell again under ZeRO-3, then stop it', async () => {
      const ddpParameters = await parameterBytes(page);
      expect(ddpParameters).toBeGreaterThan(0);
      await runCell(page, trainIndex, false);
      const badge = trainCell.locator('.mpnb-cell-ranks');
      await expect(badge).toHaveClass(/mpnb-status-(running|done)/, { timeout: 120_000 });
      // Training has begun once the rank reports its ZeRO-3 partition: fewer parameter bytes than DDP's.
      const sharded = async () => {
        const bytes = await parameterBytes(page);
        return bytes > 0 && bytes < ddpParameters;
      };
      await expect.poll(sharded, { timeout: 120_000 }).toBe(true);
      await trainCell.scrollIntoViewIfNeeded();
      expect(await badgeOverlap(trainCell)).toBe(0);
      await screenshot(page, '4-zero3-training', SHOTS);
      await page.locator('.mpnb-toolbar-button').click();
      await page.locator('.lm-Menu-item', { hasText: 'Stop All Ranks' }).click();
      await expect(trainCell.locator('.jp-InputPrompt')).toHaveText(/\[\d+\]/, { timeout: 180_000 });
      await expect(badge).toHaveClass(/mpnb-status-(stopped|done)/, { timeout: 30_000 });
      expect(await badgeOverlap(trainCell)).toBe(0);
      await screenshot(page, '5-stopped', SHOTS);
    });

    await test.step('%mpnb stop', async () => {
      await runCell(page, stopIndex);
      await expect(sidebar.locator('.mpnb-sidebar-empty')).toContainText('No cluster is running', {
        timeout: 60_000
      });
      await cellNodes.nth(stopIndex).scrollIntoViewIfNeeded();
      await screenshot(page, '6-cluster-stopped', SHOTS);
    });

    await test.step('no cell shows a traceback, an error, a linker line or a warning', async () => {
      const found = noise(await outputs(page));
      for (const line of found) {
        console.log(`newcomer noise: ${line}`);
      }
      expect(found).toEqual([]);
    });
  } finally {
    // Every cell's output next to the screenshots, for whoever reads a failure in CI.
    const cells = await outputs(page).catch(e => [{ error: String(e) }]);
    fs.mkdirSync(SHOTS, { recursive: true });
    fs.writeFileSync(path.join(SHOTS, 'cell-outputs.json'), JSON.stringify(cells, null, 1));
    await stopCluster(page, file);
  }
});
