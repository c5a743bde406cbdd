/**
 * CodeMirror decoration for the `%%distributed` line: a line class only, so
 * the cell keeps its Python (IPython) highlighting.
 */
import { Extension } from '@codemirror/state';
import { Decoration, DecorationSet, EditorView, ViewPlugin, ViewUpdate } from '@codemirror/view';

import { DISTRIBUTED_MAGIC } from './magicline';

const magicLine = Decoration.line({ class: 'mpnb-magic-line' });

function decorate(view: EditorView): DecorationSet {
  const doc = view.state.doc;
  for (let n = 1; n <= doc.lines; n++) {
    const line = doc.line(n);
    if (line.text.trim() === '') {
      continue;
    }
    return DISTRIBUTED_MAGIC.test(line.text) ? Decoration.set([magicLine.range(line.from)]) : Decoration.none;
  }
  return Decoration.none;
}

export const distributedMagicLine: Extension = ViewPlugin.fromClass(
  class {
    decorations: DecorationSet;
    constructor(view: EditorView) {
      this.decorations = decorate(view);
    }
    update(update: ViewUpdate): void {
      if (update.docChanged) {
        this.decorations = decorate(update.view);
      }
    }
  },
  { decorations: v => v.decorations }
);
