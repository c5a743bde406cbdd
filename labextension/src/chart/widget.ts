/**
 * ipywidgets front end of `mpnb.monitoring.chart.MemoryChart` (contract in
 * docs/internals.md): synced traits `ranks`, `estimate`, `capacity`,
 * `history_seconds`, `t0` (the time axis origin: the cell's start); custom messages {type: "samples"} and {type: "reset"}.
 * The history lives on the model so every view of one widget shows the same
 * data, including samples that arrived before the view was created.
 */
import { DOMWidgetModel, DOMWidgetView } from '@jupyter-widgets/base';
import type { Message } from '@lumino/messaging';

import { MemoryChart } from './chart';
import { IMemorySample, MemoryHistory } from './history';

export const MODULE_NAME = 'mpnb';
export const MODULE_VERSION = '0.1.0';
// Samples normally follow a new widget within a few hundred ms; only ask for history if none came.
const HISTORY_REQUEST_DELAY_MS = 1000;

export class MemoryChartModel extends DOMWidgetModel {
  // `declare`: Backbone calls initialize() from its constructor, before field initialisers would run.
  declare history: MemoryHistory;

  defaults(): Backbone.ObjectHash {
    return {
      ...super.defaults(),
      _model_name: 'MemoryChartModel',
      _model_module: MODULE_NAME,
      _model_module_version: MODULE_VERSION,
      _view_name: 'MemoryChartView',
      _view_module: MODULE_NAME,
      _view_module_version: MODULE_VERSION,
      ranks: [],
      estimate: {},
      capacity: 0,
      history_seconds: 600,
      t0: 0
    };
  }

  initialize(attributes: Backbone.ObjectHash, options: any): void {
    super.initialize(attributes, options);
    this.history = new MemoryHistory(positive(this.get('history_seconds'), 600));
    this.history.setEstimate(this.get('estimate'));
    this.history.capacity = Number(this.get('capacity')) || 0;
    this.history.origin = Number(this.get('t0')) || 0;
    this.on('change:t0', () => (this.history.origin = Number(this.get('t0')) || 0));
    this.on('change:estimate', () => this.history.setEstimate(this.get('estimate')));
    this.on('change:capacity', () => (this.history.capacity = Number(this.get('capacity')) || 0));
    this.on('change:history_seconds', () => {
      this.history.historySeconds = positive(this.get('history_seconds'), this.history.historySeconds);
    });
    this.on('msg:custom', (content: { type?: string; samples?: IMemorySample[] }) => {
      if (content?.type === 'samples' && Array.isArray(content.samples)) {
        this.history.add(content.samples);
      } else if (content?.type === 'reset') {
        this.history.reset();
      }
    });
    // A model re-created after a page reload starts empty: ask the kernel for the history
    // (mpnb.monitoring.chart.MemoryChart answers {type: "history"} with a reset and the samples).
    setTimeout(() => {
      if (this.history.ranks().length === 0 && this.comm_live) {
        this.send({ type: 'history' }, {});
      }
    }, HISTORY_REQUEST_DELAY_MS);
  }
}

export class MemoryChartView extends DOMWidgetView {
  declare chart: MemoryChart | undefined;

  render(): void {
    const model = this.model as MemoryChartModel;
    this.el.classList.add('mpnb-memory-widget');
    this.chart = new MemoryChart(model.history, { ranks: ranksOf(model.get('ranks')), plotHeight: 150 });
    this.el.appendChild(this.chart.node);
    this.listenTo(model, 'change:ranks', () => this.chart?.setRanks(ranksOf(model.get('ranks'))));
  }

  processLuminoMessage(msg: Message): void {
    super.processLuminoMessage(msg);
    if (msg.type === 'after-attach' || msg.type === 'after-show' || msg.type === 'resize') {
      this.chart?.requestDraw();
    }
  }

  remove(): any {
    this.chart?.dispose();
    this.chart = undefined;
    return super.remove();
  }
}

function positive(value: unknown, fallback: number): number {
  const n = Number(value);
  return Number.isFinite(n) && n > 0 ? n : fallback;
}

function ranksOf(value: unknown): number[] {
  return Array.isArray(value) ? value.map(Number).filter(Number.isFinite) : [];
}
