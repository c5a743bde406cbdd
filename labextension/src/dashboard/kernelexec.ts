/** Run a snippet in a notebook's kernel outside any cell, collecting what it printed or raised. */
import type { Kernel, KernelMessage } from '@jupyterlab/services';

export interface IExecResult {
  ok: boolean;
  /** stdout/stderr and text results, in order. */
  text: string;
  /** "ename: evalue" when the snippet raised. */
  error: string | null;
}

// %load_ext prints a note when mpnb is already loaded; the extension manager does not.
export const LOAD_MPNB = 'get_ipython().extension_manager.load_extension("mpnb")';

const ANSI = /\u001b\[[0-9;]*m/g;

export async function executeInKernel(kernel: Kernel.IKernelConnection, code: string): Promise<IExecResult> {
  const future = kernel.requestExecute({
    code,
    silent: false,
    store_history: false,
    stop_on_error: true,
    allow_stdin: false
  });
  let text = '';
  let error: string | null = null;
  future.onIOPub = (msg: KernelMessage.IIOPubMessage) => {
    const type = msg.header.msg_type;
    const content = msg.content as Record<string, any>;
    if (type === 'stream') {
      text += String(content.text ?? '');
    } else if (type === 'error') {
      error = `${content.ename}: ${content.evalue}`.replace(ANSI, '');
    } else if (type === 'execute_result' || type === 'display_data') {
      const plain = content.data?.['text/plain'];
      if (typeof plain === 'string') {
        text += plain + '\n';
      }
    }
  };
  const reply = await future.done;
  const content = reply.content as Record<string, any>;
  if (content.status === 'error' && !error) {
    error = `${content.ename}: ${content.evalue}`.replace(ANSI, '');
  } else if (content.status === 'aborted' && !error) {
    error = 'execution aborted';
  }
  return { ok: error === null, text: text.replace(ANSI, ''), error };
}
