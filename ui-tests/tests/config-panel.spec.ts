/**
 * The config panel widget (`mpnb.config_panel()`) renders in JupyterLab, opened
 * by the extension's "Open mpnb Config Panel" command, and its estimate bars
 * follow the ZeRO stage.
 */
import { expect } from '@jupyterlab/galata';

import * as path from 'path';

import { openNotebook, runCommand, screenshot, SCREENSHOTS, test } from './helpers';

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
  const segment = async (name: string) => {
    const seg = firstRank.locator(`.mpnb-panel-seg-${name}`);
    return (await seg.count()) ? Number(await seg.getAttribute('data-bytes')) : 0;
  };
  // model states: what ZeRO shards (the total also holds DeepSpeed's buckets and the activations)
  const states = async () =>
    (await segment('parameters')) + (await segment('gradients')) + (await segment('optimizer'));

  await stage.locator('label', { hasText: /^0 ·/ }).click();
  await expect.poll(total).toBeGreaterThan(0);
  const stage0 = { states: await states(), optimizer: await segment('optimizer') };
  await stage.locator('label', { hasText: /^3 ·/ }).click();
  await expect.poll(states).toBeLessThan(stage0.states);
  expect(await segment('optimizer')).toBeLessThan(stage0.optimizer);
  console.log(`config panel: rank 0 model states ${stage0.states} -> ${await states()} bytes (ZeRO-0 -> ZeRO-3)`);
  await panel.scrollIntoViewIfNeeded();
  await screenshot(page, 'config-panel-zero3');

  // Compare tab: model states shrink DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3; every line is in a legend
  await panel.locator('.lm-TabBar-tab', { hasText: /Compare/ }).click();
  const compare = panel.locator('.mpnb-panel-compare');
  await expect(compare.locator('.mpnb-panel-paper')).toBeVisible();
  const compared: number[] = [];
  for (const name of ['DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3']) {
    compared.push(Number(await compare.locator(`[data-states="${name}"]`).getAttribute('data-total')));
  }
  expect([...compared].sort((a, b) => b - a)).toEqual(compared);
  expect(await compare.locator('.mpnb-panel-capacity').count()).toBeGreaterThan(0);
  await expect(compare.locator('[data-category="capacity"]')).toBeVisible();
  await compare.scrollIntoViewIfNeeded();
  await screenshot(page, 'config-panel-compare');
  await compare.screenshot({ path: path.join(SCREENSHOTS, 'config-panel-compare-tab.png') });
});
