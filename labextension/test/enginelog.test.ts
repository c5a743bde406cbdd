import { describe, expect, it } from 'vitest';

import { logBody, logTitle, parseLogReply } from '../src/dashboard/enginelog';

describe('engine log replies', () => {
  it('parses the kernel’s log reply and ignores other messages', () => {
    const reply = parseLogReply({ type: 'log', id: 'a', rank: 1, path: '/run/mpnb/engine-7.log', text: 'x\ny', error: '' });
    expect(reply).toEqual({ id: 'a', rank: 1, path: '/run/mpnb/engine-7.log', text: 'x\ny', error: '' });
    expect(parseLogReply({ type: 'state', id: 'a' })).toBeNull();
    expect(parseLogReply({ type: 'log' })).toBeNull(); // no request id: nothing to answer
    expect(parseLogReply(null)).toBeNull();
    expect(parseLogReply({ type: 'log', id: 'b', rank: 0, text: 3 })?.text).toBe('');
  });

  it('shows the text, the kernel’s error, or why the log is empty', () => {
    const base = { id: 'a', rank: 2, path: '/p', text: '', error: '' };
    expect(logBody({ ...base, text: 'ninja: build stopped' })).toBe('ninja: build stopped');
    expect(logBody({ ...base, error: 'No cluster is running in this kernel.' })).toBe(
      'No cluster is running in this kernel.'
    );
    expect(logBody(base)).toContain('Nothing logged yet');
    expect(logTitle(2)).toBe('mpnb log · rank 2');
  });
});
