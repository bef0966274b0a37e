// The page's only link to the server: small fetch wrappers that turn every
// answer into plain data, and watchTask, which follows a task live over
// Server-Sent Events and falls back to polling when the stream fails.

/** NetworkError marks a request that got no HTTP answer at all. */
export class NetworkError extends Error {}

const FINAL = new Set(['succeeded', 'failed']);

/** isFinal reports whether a task status can no longer change. */
export function isFinal(status) {
  return FINAL.has(status);
}

async function request(path, init = {}) {
  let res;
  try {
    res = await fetch(path, {
      ...init,
      credentials: 'same-origin',
      cache: 'no-store',
      headers: { Accept: 'application/json', ...(init.headers || {}) },
    });
  } catch (e) {
    throw new NetworkError(String(e));
  }
  let body = null;
  try {
    body = await res.json();
  } catch {
    // A proxy's HTML error page or an empty body: the status still tells
    // the caller something, so this is not a network failure.
    body = null;
  }
  return {
    status: res.status,
    ok: res.ok,
    body,
    retryAfter: res.headers.get('Retry-After'),
    requestId: res.headers.get('X-Request-Id'),
  };
}

/** getConfig fetches /api/config. */
export function getConfig() {
  return request('/api/config');
}

/** createTask posts a task; payload is the JSON body of POST /api/tasks. */
export function createTask(payload) {
  return request('/api/tasks', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(payload),
  });
}

function taskPath(id) {
  return '/api/tasks/' + encodeURIComponent(id);
}

/** getTask fetches one task snapshot. */
export function getTask(id) {
  return request(taskPath(id));
}

/**
 * toError reads the error envelope of a failed answer into
 * {code, requestId, fields, retryAfter(header text), status}. Answers
 * without an envelope get code "unknown", except a 404 on a task.
 */
export function toError(res, fallbackCode = 'unknown') {
  const e = res.body && typeof res.body === 'object' ? res.body.error : null;
  const ok = e && typeof e === 'object';
  return {
    code: ok && typeof e.code === 'string' ? e.code : fallbackCode,
    requestId: ok && typeof e.request_id === 'string' ? e.request_id : res.requestId || '',
    fields: ok && e.fields && typeof e.fields === 'object' ? e.fields : null,
    retryAfter: res.retryAfter,
    status: res.status,
  };
}

function parse(ev) {
  try {
    return JSON.parse(ev.data);
  } catch {
    return null;
  }
}

/**
 * watchTask follows task id until it reaches a final status. Handlers:
 * onStep(step), onStatus(status), onTask(task) for whole snapshots (the
 * last one final), onFallback() when it switches to polling, and
 * onError(err, fatal). It returns {stop}.
 *
 * EventSource reconnects by itself and sends Last-Event-ID, so one dropped
 * connection resumes where it stopped. A second error without a message in
 * between, or a refused stream (readyState CLOSED), means the stream is not
 * coming back soon: then the task is polled every pollMs.
 */
export function watchTask(id, h, { pollMs = 2000 } = {}) {
  let stopped = false;
  let es = null;
  let timer = 0;
  let errorsInRow = 0;
  let pollFailures = 0;

  function stop() {
    stopped = true;
    if (es) es.close();
    es = null;
    clearTimeout(timer);
  }

  function schedule() {
    if (stopped) return;
    // Back off while the server is unreachable, up to 30 s between tries.
    const delay = Math.min(pollMs * 2 ** pollFailures, 30000);
    timer = setTimeout(poll, delay);
  }

  async function poll() {
    if (stopped) return;
    let res;
    try {
      res = await getTask(id);
    } catch {
      if (stopped) return;
      pollFailures++;
      h.onError({ code: 'network', requestId: '', retryAfter: null }, false);
      schedule();
      return;
    }
    if (stopped) return;
    if (res.status === 404) {
      stop();
      h.onError(toError(res, 'task_not_found'), true);
      return;
    }
    if (!res.ok || !res.body || typeof res.body !== 'object') {
      pollFailures++;
      h.onError(toError(res), false);
      schedule();
      return;
    }
    pollFailures = 0;
    if (isFinal(res.body.status)) stop();
    h.onTask(res.body);
    schedule();
  }

  function fallBack() {
    if (es) es.close();
    es = null;
    if (h.onFallback) h.onFallback();
    poll();
  }

  if (typeof EventSource !== 'function') {
    poll();
    return { stop };
  }
  es = new EventSource(taskPath(id) + '/events');
  es.addEventListener('step', (ev) => {
    errorsInRow = 0;
    const step = parse(ev);
    if (!stopped && step && typeof step === 'object') h.onStep(step);
  });
  es.addEventListener('status', (ev) => {
    errorsInRow = 0;
    const data = parse(ev);
    if (!stopped && data && typeof data.status === 'string') h.onStatus(data.status);
  });
  es.addEventListener('done', (ev) => {
    // Close first: an EventSource left open would reconnect forever after
    // the server ends the stream.
    es.close();
    const task = parse(ev);
    if (stopped) return;
    if (task && typeof task === 'object' && isFinal(task.status)) {
      stop();
      h.onTask(task);
      return;
    }
    // A done event without a usable task: fetch the task instead.
    fallBack();
  });
  es.addEventListener('error', () => {
    if (stopped || !es) return;
    errorsInRow++;
    if (es.readyState === EventSource.CLOSED || errorsInRow >= 2) fallBack();
  });
  return { stop };
}
