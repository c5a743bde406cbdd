/**
 * The config panel's Compare tab on a live 2-rank cluster: "Measure these" runs the notebook's
 * training cell under the ticked strategies, and the measured table appears beside the prediction.
 */
import { expect } from '@jupyterlab/galata';

import * as path from 'path';

import { openNotebook, runCell, screenshot, SCREENSHOTS, stopCluster, test } from './helpers';

const MODEL = 'tiny_gpt(0, n_layer=2, n_embd=64, seq_len=32)';
const TRAIN = [
  '%%distributed',
  'from mpnb.models import tiny_gpt, synthetic_batches',
  `net = ${MODEL}`,
  'trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))',
  'for batch in synthetic_batches(seq_len=32, batch_size=8, steps=5, seed=1):',
  '    loss = trainer.step(batch)',
  'print(f"loss {loss:.3f}")'
].join('\n');
const PANEL = ['import mpnb', 'from mpnb.models import tiny_gpt', `mpnb.config_panel(${MODEL})`].join('\n');

// An interrupt's empty (204) reply breaks galata's kernel tracking (see mpnb.spec.ts).
test.use({ kernels: null });

test('Measure these fills the Compare tab with measured memory, time and bytes', async ({ page, tmpPath }) => {
  test.setTimeout(300_000);
  const notebook = `${tmpPath}/measure.ipynb`;
  await openNotebook(page, notebook, ['%load_ext mpnb', '%mpnb start -n 2', TRAIN, PANEL]);
  try {
    for (const index of [0, 1, 2, 3]) {
      await runCell(page, index);
    }
    const panel = page.locator('.mpnb-panel');
    await expect(panel).toBeVisible({ timeout: 60_000 });
    await panel.locator('.lm-TabBar-tab', { hasText: /Compare/ }).click();
    await expect(panel.locator('.mpnb-panel-measured')).toContainText('Nothing measured yet');
    for (const name of ['ZeRO-1', 'ZeRO-3', 'FSDP']) {
      await panel.locator('.mpnb-panel-measure-pick label', { hasText: name }).click();
    }
    await expect(panel.locator('.mpnb-panel-measure-status')).toContainText('under DDP, ZeRO-2');
    await panel.locator('.mpnb-panel-measure').click();

    const rows = panel.locator('.mpnb-panel-measured-row');
    await expect(rows).toHaveCount(2, { timeout: 180_000 });
    const states = async (config: string) =>
      Number(await panel.locator(`.mpnb-panel-measured-row[data-config="${config}"]`).getAttribute('data-states'));
    const ddp = await states('ddp');
    const zero2 = await states('zero stage=2');
    expect(zero2).toBeLessThan(0.8 * ddp); // 12Ψ against 16Ψ bytes of model states on 2 ranks
    console.log(`measured model states: ddp ${ddp} B, zero stage=2 ${zero2} B`);
    await expect(panel.locator('.mpnb-panel-measure')).toBeEnabled();
    const tab = panel.locator('.mpnb-panel-measured');
    await tab.scrollIntoViewIfNeeded();
    await screenshot(page, 'config-panel-measured');
    await panel.locator('.mpnb-panel-right').screenshot({ path: path.join(SCREENSHOTS, 'config-panel-measured-tab.png') });
  } finally {
    await stopCluster(page, notebook);
  }
});
