/** The colour and label of each series, and the key above the plots that explains and toggles them. */
import { CATEGORIES, Category } from './history';

export const CATEGORY_COLORS: Record<Category, string> = {
  parameters: '#4e79a7',
  gradients: '#f28e2b',
  optimizer: '#59a14f',
  activations: '#b07aa1',
  other: '#bab0ac'
};
/** Short names for the hover readout. */
export const CATEGORY_LABELS: Record<Category, string> = {
  parameters: 'params',
  gradients: 'grads',
  optimizer: 'optim',
  activations: 'activ',
  other: 'other'
};
/** Names in the key; activations are counted by saved-tensor hooks, a lower bound. */
export const CATEGORY_KEY_LABELS: Record<Category, string> = {
  parameters: 'parameters',
  gradients: 'gradients',
  optimizer: 'optimizer',
  activations: 'activations (tracked)',
  other: 'other (allocated)'
};
export const ESTIMATE_COLOR = '#7b3294';
export const CAPACITY_COLOR = '#d62728';
export const PEAK_COLOR = '#d62728';
export const RSS_COLOR = '#555555';
/** Bytes sent per second (the lower panel): a teal no category uses. */
export const SENT_COLOR = '#2a9d8f';
export const SENT_FILL = 'rgba(42, 157, 143, 0.35)';
export const SENT_KEY_LABEL = 'sent/s (lower panel)';

/** The key's toggle for the communication panels: `hidden()` is read after each click. */
export interface ICommToggle {
  hidden: () => boolean;
  onToggle: () => void;
}

/**
 * The key shared by all ranks of one chart. Each category is a toggle button: a click hides
 * or shows it in every rank (and the axis zooms to what is left shown). With `comm`, a last
 * button hides or shows the bytes-sent panels (data-comm="sent"; the chart hides it until a
 * rank reports comm_sent).
 */
export function legendKey(
  hidden: ReadonlySet<Category>,
  onToggle: (c: Category) => void,
  comm?: ICommToggle
): HTMLDivElement {
  const key = document.createElement('div');
  key.className = 'mpnb-memory-chart-key';
  const item = (tag: 'span' | 'button', cls: string, label: string, color: string): HTMLElement => {
    const node = document.createElement(tag);
    node.className = 'mpnb-key-item';
    const swatch = document.createElement('span');
    swatch.className = `mpnb-key-swatch ${cls}`;
    swatch.style.setProperty('--mpnb-key-color', color);
    node.append(swatch, document.createTextNode(label));
    key.appendChild(node);
    return node;
  };
  const toggle = (label: string, color: string, isHidden: () => boolean, onClick: () => void): HTMLButtonElement => {
    const button = item('button', 'mpnb-key-area', label, color) as HTMLButtonElement;
    button.type = 'button';
    button.title = `Show or hide ${label}`;
    const sync = (): void => {
      button.setAttribute('aria-pressed', String(!isHidden()));
      button.classList.toggle('mpnb-mod-hidden', isHidden());
    };
    sync();
    button.addEventListener('click', () => {
      onClick();
      sync();
    });
    return button;
  };
  for (const c of CATEGORIES) {
    const button = toggle(CATEGORY_KEY_LABELS[c], CATEGORY_COLORS[c], () => hidden.has(c), () => onToggle(c));
    button.dataset.category = c;
  }
  item('span', 'mpnb-key-line', 'process RSS (CPU, right axis)', RSS_COLOR);
  item('span', 'mpnb-key-dashed', 'estimate', ESTIMATE_COLOR);
  item('span', 'mpnb-key-line', 'capacity', CAPACITY_COLOR);
  item('span', 'mpnb-key-peak', 'peak', PEAK_COLOR);
  if (comm) {
    toggle(SENT_KEY_LABEL, SENT_COLOR, comm.hidden, comm.onToggle).dataset.comm = 'sent';
  }
  return key;
}
