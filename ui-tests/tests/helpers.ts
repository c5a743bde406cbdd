/** Shared steps of the mpnb browser tests. */
import { IJupyterLabPageFixture, test as galataTest } from '@jupyterlab/galata';
import type { Page } from '@playwright/test';
import * as fs from 'fs';
import * as path from 'path';

/**
 * Wait until JupyterLab has started and restored its layout. galata's own waits give up after
 * 15 s, which a busy 2-core machine can exceed; these wait up to 2 minutes.
 */
async function waitForLab(raw: Page): Promise<void> {
  await raw.waitForFunction(() => typeof (window as any).jupyterapp === 'object', undefined, {
    timeout: 120_000
  });
  await raw.evaluate(async () => {
    await (window as any).jupyterapp.started;
    await (window as any).jupyterapp.restored;
  });
  await raw.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 120_000 });
}

/** Load (or reload) JupyterLab in the page with the slow-machine waits above. */
export async function gotoLab(page: IJupyterLabPageFixture, path = '', reload = false): Promise<void> {
  const lab = page as any; // galata's JupyterLabPage: `.page` is the Playwright page
  const raw = lab.page as Page;
  if (reload) {
    await raw.reload({ waitUntil: 'domcontentloaded' });
  } else {
    await raw.goto(`${lab.baseURL}/lab/${path}`, { waitUntil: 'domcontentloaded' });
  }
  await waitForLab(raw);
  await lab.hookHelpersUp();
}

/** galata's test with those waits: opens JupyterLab in the test's folder, on a reset workspace. */
export const test = galataTest.extend({
  autoGoto: false,
  page: async ({ page, tmpPath }, use) => {
    await gotoLab(page, `tree/${tmpPath}?reset`);
    await use(page);
  }
});

export const SCREENSHOTS = path.resolve(__dirname, '..', '..', 'test-results', 'screenshots');

/** Save a screenshot of the page as `<dir>/<name>.png` (by default under test-results/screenshots). */
export async function screenshot(page: IJupyterLabPageFixture, name: string, dir = SCREENSHOTS): Promise<string> {
  fs.mkdirSync(dir, { recursive: true });
  const file = path.join(dir, `${name}.png`);
  await page.screenshot({ path: file });
  return file;
}

/** Run a JupyterLab command in the page and return its result. */
export async function runCommand(page: IJupyterLabPageFixture, id: string, args: Record<string, unknown> = {}): Promise<any> {
  return page.evaluate(({ id, args }) => (window as any).jupyterapp.commands.execute(id, args), { id, args });
}

/**
 * Write a notebook with `sources` as code cells and open it on a python3 kernel; waits until the
 * kernel is idle. (Through the contents API and the docmanager command: no menus or file browser
 * clicks to go wrong on a slow machine.)
 */
export async function openNotebook(page: IJupyterLabPageFixture, path: string, sources: string[]): Promise<void> {
  const notebook = {
    cells: sources.map(source => ({ cell_type: 'code', execution_count: null, metadata: {}, outputs: [], source })),
    metadata: { kernelspec: { display_name: 'Python 3 (ipykernel)', language: 'python', name: 'python3' } },
    nbformat: 4,
    nbformat_minor: 5
  };
  await page.contents.uploadContent(JSON.stringify(notebook), 'text', path);
  await activateNotebook(page, path);
}

/** Open (or bring to front) the notebook at `path`; waits until its kernel is idle. */
export async function activateNotebook(page: IJupyterLabPageFixture, path: string): Promise<void> {
  await runCommand(page, 'docmanager:open', { path, factory: 'Notebook', kernel: { name: 'python3' } });
  await page.waitForFunction(
    name => {
      const widget = (window as any).jupyterapp.shell.currentWidget;
      const kernel = widget?.sessionContext?.session?.kernel;
      return widget?.context?.path?.endsWith(name) && kernel?.status === 'idle';
    },
    path.split('/').pop(),
    { timeout: 120_000 }
  );
}

/**
 * Stop the cluster of the notebook at `path` (interrupting a running cell first): tests must
 * not leave engines behind, whatever step failed.
 */
export async function stopCluster(page: IJupyterLabPageFixture, path: string): Promise<void> {
  // Not runCommand: the opened widget is not serialisable back to the test.
  await page.evaluate(async path => {
    await (window as any).jupyterapp.commands.execute('docmanager:open', { path, factory: 'Notebook' });
  }, path);
  await page.evaluate(async () => {
    const kernel = (window as any).jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;
    if (!kernel) {
      return;
    }
    if (kernel.status === 'busy') {
      await kernel.interrupt();
    }
    const stop = kernel.requestExecute({ code: 'import mpnb\nmpnb.stop()', store_history: false }).done;
    await Promise.race([stop, new Promise(resolve => setTimeout(resolve, 90_000))]);
  });
}

/**
 * Run cell `index` of the current notebook (it stays selected). With `wait`, resolves when the
 * kernel replied; without, as soon as the execution is sent.
 */
export async function runCell(page: IJupyterLabPageFixture, index: number, wait = true): Promise<void> {
  await page.evaluate(
    async ({ index, wait }) => {
      const app = (window as any).jupyterapp;
      const notebook = app.shell.currentWidget.content;
      notebook.activeCellIndex = index;
      notebook.deselectAll();
      const done = app.commands.execute('notebook:run-cell');
      if (wait) {
        await done;
      }
    },
    { index, wait }
  );
}
