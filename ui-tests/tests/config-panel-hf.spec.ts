/**
 * The config panel for a Hugging Face transformers model: the shape comes from its config, and
 * the strategies GPT-2 cannot run (tensor, pipeline) are greyed out in the browser with the
 * reason in their tooltip and on a visible line; a click on one leaves the strategy as it was.
 */
import { expect } from '@jupyterlab/galata';

import * as path from 'path';

import { openNotebook, runCell, screenshot, SCREENSHOTS, test } from './helpers';

const CELL = [
  'import mpnb',
  'from mpnb.hf_models import tiny_transformer',
  'mpnb.config_panel(tiny_transformer("gpt2"), world_size=4, device_kind="cuda", capacity_gb=80)'
].join('\n');

test('config panel greys out the strategies GPT-2 cannot run', async ({ page, tmpPath }) => {
  test.setTimeout(180_000);
  await openNotebook(page, `${tmpPath}/panel-hf.ipynb`, [CELL]);
  await runCell(page, 0);
  const panel = page.locator('.mpnb-panel');
  await expect(panel).toBeVisible({ timeout: 90_000 });
  await expect(panel.locator('.mpnb-panel-model')).toContainText('Model: GPT2LMHeadModel');

  const strategy = panel.locator('.mpnb-panel-strategy');
  const tensor = strategy.locator('button', { hasText: 'Tensor' });
  const zero = strategy.locator('button', { hasText: 'ZeRO' });
  // the CSS the panel ships reaches the button: greyed out, its reason as the tooltip
  await expect(tensor).toHaveCSS('opacity', '0.45');
  await expect(zero).toHaveCSS('opacity', '1');
  await expect(tensor).toHaveAttribute('title', /Conv1D layers cannot be split/);
  const note = panel.locator('.mpnb-panel-strategy-note');
  await expect(note.locator('[data-strategy="tensor"]')).toBeVisible();
  await expect(note.locator('[data-strategy="pipeline"]')).toContainText('has no pipeline plan');

  await zero.click();
  await expect(zero).toHaveClass(/mod-active/);
  await tensor.click(); // refused: ZeRO stays chosen and the tensor reason is highlighted
  await expect(note.locator('[data-strategy="tensor"]')).toHaveCSS('font-weight', '700');
  await expect(zero).toHaveClass(/mod-active/);
  await expect(tensor).not.toHaveClass(/mod-active/);
  await expect(panel.locator('.mpnb-panel-estimate .mpnb-panel-row').first()).toBeVisible();
  await panel.scrollIntoViewIfNeeded();
  await screenshot(page, 'config-panel-hf-gpt2');
  await panel.screenshot({ path: path.join(SCREENSHOTS, 'config-panel-hf-gpt2-panel.png') });
});
