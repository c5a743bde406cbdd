/**
 * The config panel widget (`mpnb.config_panel()`) renders in JupyterLab, opened
 * by the extension's "Open mpnb Config Panel" command, and its estimate bars
 * follow the ZeRO stage.
 */
import { expect } from '@jupyterlab/galata';

import { openNotebook, runCommand, screenshot, test } from './helpers';

test('config panel renders and the ZeRO stage changes the bars', async ({ page, tmpPath }) => {
  test.setTimeout(180_000);
  await openNotebook(page, `${tmpPath}/panel.ipynb`, ['']);
  await runCommand(page, 'mpnb:open-config-panel');
  const panel = page.locator('.mpnb-panel');
  await expect(panel).toBeVisible({ timeout: 90_000 });
  // The command inserted `mpnb.config_panel()` in a new cell and ran it.
  await expect(page.locator('.jp-Cell').nth(1)).toContainText('mpnb.config_panel()');

  await panel.locator('.mpnb-panel-strategy button', { hasText: 'ZeRO' }).click();
  const stage = panel.locator('.mpnb-panel-zero-stage');
  await expect(stage).toBeVisible();
  const firstRank = panel.locator('.mpnb-panel-estimate .mpnb-panel-row').first();
  await expect(firstRank).toBeVisible();
  const total = async () => Number(await firstRank.getAttribute('data-total'));
  const optimizer = async () =>
    Number(await firstRank.locator('.mpnb-panel-seg-optimizer').getAttribute('data-bytes'));

  await stage.locator('label', { hasText: /^0 ·/ }).click();
  await expect.poll(total).toBeGreaterThan(0);
  const stage0 = { total: await total(), optimizer: await optimizer() };
  await stage.locator('label', { hasText: /^3 ·/ }).click();
  await expect.poll(total).toBeLessThan(stage0.total);
  expect(await optimizer()).toBeLessThan(stage0.optimizer);
  console.log(`config panel: rank 0 total ${stage0.total} -> ${await total()} bytes (ZeRO-0 -> ZeRO-3)`);
  await panel.scrollIntoViewIfNeeded();
  await screenshot(page, 'config-panel-zero3');
});
