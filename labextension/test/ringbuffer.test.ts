import { describe, expect, it } from 'vitest';

import { RingBuffer } from '../src/chart/ringbuffer';

describe('RingBuffer', () => {
  it('keeps rows in order until full, then overwrites the oldest', () => {
    const b = new RingBuffer(3, 2);
    b.push([1, 10]);
    b.push([2, 20]);
    expect(b.length).toBe(2);
    expect(Array.from(b.column(0))).toEqual([1, 2]);
    b.push([3, 30]);
    b.push([4, 40]);
    b.push([5, 50]);
    expect(b.length).toBe(3);
    expect(Array.from(b.column(0))).toEqual([3, 4, 5]);
    expect(Array.from(b.column(1))).toEqual([30, 40, 50]);
    expect(b.get(1, 0)).toBe(30);
    expect(b.last(0)).toBe(5);
  });

  it('fills missing columns with NaN and rejects bad rows and sizes', () => {
    const b = new RingBuffer(2, 3);
    b.push([7]);
    expect(b.get(0, 0)).toBe(7);
    expect(Number.isNaN(b.get(2, 0))).toBe(true);
    expect(() => b.get(0, 1)).toThrow(RangeError);
    expect(() => new RingBuffer(0, 1)).toThrow(/capacity/);
  });

  it('finds and drops rows older than a time, across the wrap point', () => {
    const b = new RingBuffer(5, 1);
    for (let t = 0; t < 8; t++) {
      b.push([t]);
    }
    // holds 3..7, wrapped
    expect(b.lowerBound(0, 5)).toBe(2);
    expect(b.lowerBound(0, 100)).toBe(5);
    expect(b.lowerBound(0, -1)).toBe(0);
    expect(b.dropBelow(0, 5)).toBe(2);
    expect(Array.from(b.column(0))).toEqual([5, 6, 7]);
    b.push([8]);
    expect(Array.from(b.column(0))).toEqual([5, 6, 7, 8]);
  });

  it('resizes keeping the newest rows', () => {
    const b = new RingBuffer(4, 1);
    for (let t = 0; t < 6; t++) {
      b.push([t]);
    }
    const small = b.resized(2);
    expect(Array.from(small.column(0))).toEqual([4, 5]);
    const big = b.resized(10);
    expect(Array.from(big.column(0))).toEqual([2, 3, 4, 5]);
    expect(big.capacity).toBe(10);
  });
});
