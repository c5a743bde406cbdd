import { describe, expect, it } from 'vitest';

import { formatBytes } from '../src/chart/format';
import { isDistributedSource } from '../src/editor/magicline';

describe('formatBytes', () => {
  it('uses binary units with three significant digits', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(1536)).toBe('1.50 KiB');
    expect(formatBytes(31.4 * 1024 ** 3)).toBe('31.4 GiB');
    expect(formatBytes(120 * 1024 ** 3)).toBe('120 GiB');
    expect(formatBytes(null)).toBe('—');
    expect(formatBytes(NaN)).toBe('—');
  });
});

describe('isDistributedSource', () => {
  it('recognises the cell magic on the first non-blank line only', () => {
    expect(isDistributedSource('%%distributed\nx = 1')).toBe(true);
    expect(isDistributedSource('\n\n%%distributed --ranks 0\nx = 1')).toBe(true);
    expect(isDistributedSource('%%distributed')).toBe(true);
    expect(isDistributedSource('x = 1\n%%distributed')).toBe(false);
    expect(isDistributedSource('  %%distributed')).toBe(false);
    expect(isDistributedSource('%%distributedx')).toBe(false);
    expect(isDistributedSource('')).toBe(false);
  });
});
