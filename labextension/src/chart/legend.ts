/** The colour and label of each series, and the key that explains them above the plots. */
import { CATEGORIES, Category } from './history';

export const CATEGORY_COLORS: Record<Category, string> = {
  parameters: '#4e79a7',
  gradients: '#f28e2b',
  optimizer: '#59a14f',
  other: '#bab0ac'
};
export const CATEGORY_LABELS: Record<Category, string> = {
  parameters: 'params',
  gradients: 'grads',
  optimizer: 'optim',
  other: 'other'
};
export const ESTIMATE_COLOR = '#7b3294';
export const CAPACITY_COLOR = '#d62728';
export const PEAK_COLOR = '#d62728';

/** The colour key shared by all ranks of one chart. */
export function legendKey(): HTMLDivElement {
  const key = document.createElement('div');
  key.className = 'mpnb-memory-chart-key';
  const item = (cls: string, label: string, color: string): void => {
    const span = document.createElement('span');
    span.className = 'mpnb-key-item';
    const swatch = document.createElement('span');
    swatch.className = `mpnb-key-swatch ${cls}`;
    swatch.style.setProperty('--mpnb-key-color', color);
    span.append(swatch, document.createTextNode(label));
    key.appendChild(span);
  };
  for (const c of CATEGORIES) {
    item('mpnb-key-area', c, CATEGORY_COLORS[c]);
  }
  item('mpnb-key-dashed', 'estimate', ESTIMATE_COLOR);
  item('mpnb-key-line', 'capacity', CAPACITY_COLOR);
  item('mpnb-key-peak', 'peak', PEAK_COLOR);
  return key;
}
