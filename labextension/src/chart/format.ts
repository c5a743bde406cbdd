/** Human-readable numbers shared by the chart, the sidebar and the status bar. */

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** 1536 -> "1.5 KiB"; three significant digits, binary units like nvidia-smi and torch. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '—';
  }
  let value = Math.abs(bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit++;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${bytes < 0 ? '-' : ''}${value.toFixed(digits)} ${UNITS[unit]}`;
}

/** Unix seconds -> "14:03:07" (or "14:03" without seconds) in local time. */
export function formatClock(t: number, seconds = true): string {
  const d = new Date(t * 1000);
  const pad = (n: number): string => String(n).padStart(2, '0');
  const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  return seconds ? `${hm}:${pad(d.getSeconds())}` : hm;
}

/** Seconds since the cell started -> "0 s", "45 s", "1:30", "1:02:03" (the charts' time axis). */
export function formatElapsed(seconds: number): string {
  if (!Number.isFinite(seconds)) {
    return '—';
  }
  const sign = seconds < 0 ? '-' : '';
  const whole = Math.round(Math.abs(seconds));
  if (whole < 60) {
    return `${sign}${whole} s`;
  }
  const pad = (n: number): string => String(n).padStart(2, '0');
  const h = Math.floor(whole / 3600);
  const m = Math.floor((whole % 3600) / 60);
  const rest = pad(whole % 60);
  return h > 0 ? `${sign}${h}:${pad(m)}:${rest}` : `${sign}${m}:${rest}`;
}
