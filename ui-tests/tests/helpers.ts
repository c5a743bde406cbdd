/** Shared steps of the mpnb browser tests. */
import type { IJupyterLabPageFixture } from '@jupyterlab/galata';
import * as fs from 'fs';
import * as path from 'path';

export const SCREENSHOTS = path.resolve(__dirname, '..', '..', 'test-results', 'screenshots');

export async function screenshot(page: IJupyterLabPageFixture, name: string): Promise<string> {
  fs.mkdirSync(SCREENSHOTS, { recursive: true });
  const file = path.join(SCREENSHOTS, `${name}.png`);
  await page.screenshot({ path: file });
  return file;
}

/** Run a JupyterLab command in the page and return its result. */
export async function runCommand(page: IJupyterLabPageFixture, id: string, args: Record<string, unknown> = {}): Promise<any> {
  return page.evaluate(({ id, args }) => (window as any).jupyterapp.commands.execute(id, args), { id, args });
}

/** Replace the current notebook's cells with code cells holding `sources` (no typing: no auto-indent). */
export async function setCells(page: IJupyterLabPageFixture, sources: string[]): Promise<void> {
  await page.evaluate(sources => {
    const panel = (window as any).jupyterapp.shell.currentWidget;
    const shared = panel.content.model.sharedModel;
    shared.transact(() => {
      shared.deleteCellRange(0, shared.cells.length);
      shared.insertCells(
        0,
        sources.map((source: string) => ({ cell_type: 'code', source, metadata: {} }))
      );
    });
  }, sources);
}

/** Stop the cluster of the current notebook's kernel, if any (tests must not leave engines behind). */
export async function stopCluster(page: IJupyterLabPageFixture): Promise<void> {
  await page.evaluate(async () => {
    const panel = (window as any).jupyterapp.shell.currentWidget;
    const kernel = panel?.sessionContext?.session?.kernel;
    if (kernel) {
      await kernel.requestExecute({ code: 'import mpnb\nmpnb.stop()', store_history: false }).done;
    }
  });
}
