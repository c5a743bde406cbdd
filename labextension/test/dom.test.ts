import { describe, expect, it } from 'vitest';

import { wholeItems } from '../src/dashboard/dom';

describe('wholeItems', () => {
  it('keeps each " · " item on one line and breaks only between items', () => {
    const line = wholeItems('ZeRO-2 · fp32 · mb 8 × accum 1');
    expect(line).toBe('ZeRO-2 · fp32 · mb\u00a08\u00a0×\u00a0accum\u00a01');
    expect(line.split(' · ')).toHaveLength(3);
  });

  it('leaves an empty line empty', () => {
    expect(wholeItems('')).toBe('');
  });
});
