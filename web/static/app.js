// The page: reads /api/config, drives the form and the human check, then
// follows a task to its itinerary. It talks to the server only through the
// typed client (client.js, the module other frontends load from
// /api/client.js). All visible text comes from the message tables via
// setText, and all server or model data enters the DOM as text nodes
// (textContent, append of strings), never as markup.
import { LANGS, translate, hasKey, pickLanguage, errorKey, taskErrorKey, warningKey, retryText, durationKey } from './messages.js';
import { DEFAULT_LIMITS, limitsFrom, validateTask, validatePrompt, interestError, serverFieldErrors } from './validate.js';
import { renderMarkdown } from './markdown.js';
import { createClient, FaregateError, isFinal } from './client.js';
import { startHumanCheck } from './turnstile.js';

const LANG_STORAGE = 'faregate.lang';
const PRESETS = ['food', 'history', 'art', 'nature', 'architecture', 'museums', 'nightlife', 'shopping'];
const FIELDS = ['prompt', 'destination', 'days', 'interests'];
const FIELD_INPUT = { prompt: 'prompt', destination: 'destination', days: 'days', interests: 'interest-custom' };
const FIELD_HINT = { prompt: 'prompt-hint', destination: 'destination-hint', days: 'days-hint', interests: 'interests-hint' };
const TASK_ID = /^t_[A-Za-z0-9_-]{1,200}$/;
const TASK_STATUSES = ['queued', 'running', 'succeeded', 'failed'];
const STEP_KINDS = ['model', 'tool', 'agent'];
const STEP_STATUSES = ['started', 'ok', 'failed', 'cached', 'degraded'];
const SAFE_CODE = /^[a-z0-9_]{1,64}$/;
// A plan's language as a lang attribute; anything else is not trusted.
const LANG_TAG = /^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,2}$/;
// Refusals of a stream after which the page polls, said as a notice.
const STREAM_REFUSALS = ['too_many_streams', 'server_busy', 'rate_limited'];

const api = createClient();

// All page state lives here; render functions read it, so a language switch
// or a late server answer can redraw any part without extra bookkeeping.
const state = {
  lang: 'en',
  config: null,
  limits: DEFAULT_LIMITS,
  input: 'trip', // the form /api/config names: 'trip' or 'prompt'
  check: null, // the human check, once the config is known
  inFlight: false,
  selected: [], // chosen interests in order: {preset: name} or {custom: text}
  fieldErrors: {}, // field → {key, params}
  message: null, // what the live region shows, kept so a language switch can re-render it
  task: null, // the task on screen
  watcher: null, // the AbortController of the follow in progress
};

const $ = (id) => document.getElementById(id);
const t = (key, params) => translate(state.lang, key, params);

// el builds an element; string children become text nodes, never markup.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === 'class') node.className = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

// setText shows a table entry and records key and slots on the element, so
// translateAll can redo it in another language without knowing its origin.
function setText(node, key, params) {
  node.dataset.i18n = key;
  if (params) node.dataset.i18nArgs = JSON.stringify(params);
  else delete node.dataset.i18nArgs;
  node.textContent = t(key, params);
}

// clearText empties a node and forgets its key, so translateAll leaves it empty.
function clearText(node) {
  delete node.dataset.i18n;
  delete node.dataset.i18nArgs;
  node.textContent = '';
}

// translateAll redoes every node that setText filled: one walk over the DOM
// instead of a render function per region.
function translateAll() {
  for (const node of document.querySelectorAll('[data-i18n]')) {
    let params;
    try {
      params = node.dataset.i18nArgs ? JSON.parse(node.dataset.i18nArgs) : undefined;
    } catch {
      params = undefined;
    }
    node.textContent = t(node.dataset.i18n, params);
  }
  document.title = t(inputKey('page.title'));
  document.documentElement.lang = state.lang;
}

// setLanguage switches every visible text and the lang attribute (screen
// readers pick their voice from it); remember stores an explicit choice.
function setLanguage(lang, remember) {
  state.lang = LANGS.includes(lang) ? lang : 'en';
  if (remember) {
    try {
      localStorage.setItem(LANG_STORAGE, state.lang);
    } catch {
      // Private modes may refuse storage; the switch still works for this visit.
    }
  }
  $('lang').value = state.lang;
  translateAll();
  // The retry line holds formatted times, not a plain table entry, and the
  // plan's labels carry the page's lang attribute.
  renderMessage();
  if (state.task) renderTask();
}

// ---- messages (the aria-live region) ----

// setMessage replaces what the live region says. The arrival time is kept
// because Retry-After counts from the answer, not from a later redraw.
// Kinds: "info" (a table key), "error" (a code), "notice" (a code that did
// not stop anything: the page carries on, e.g. by polling).
function setMessage(m) {
  state.message = m ? { ...m, at: Date.now() } : null;
  renderMessage();
}

// errorMessage turns whatever a client call threw into a message: a
// FaregateError keeps its code, Retry-After, request id and fields.
function errorMessage(err, kind = 'error') {
  if (!(err instanceof FaregateError)) return { kind, code: 'unknown' };
  return { kind, code: err.code, retryAfter: err.retryAfter, requestId: err.requestId, fields: err.fields };
}

// renderMessage fills the single aria-live region: an error gets its text,
// its next step, a human waiting time and the reference for support.
function renderMessage() {
  const m = state.message;
  const box = $('messages');
  const parts = ['message-text', 'message-next', 'message-retry', 'message-ref'].map($);
  parts.forEach(clearText);
  box.className = 'messages';
  delete box.dataset.kind;
  delete box.dataset.code;
  if (!m) return;
  const [text, next, retry, ref] = parts;
  box.dataset.kind = m.kind;
  box.classList.add('messages-' + m.kind);
  if (m.kind === 'info') {
    setText(text, inputKey(m.key), m.params);
    return;
  }
  // A failed task has its own words: the attempt was counted.
  const key = inputKey(m.task ? taskErrorKey(m.code) : errorKey(m.code));
  box.dataset.code = SAFE_CODE.test(String(m.code)) ? m.code : 'unknown';
  setText(text, key);
  setText(next, key + '.next');
  // Measured from when the answer arrived, so re-rendering after a language
  // switch keeps the same wall-clock time.
  if (Number.isFinite(m.retryAfter)) retry.textContent = retryText(state.lang, m.retryAfter, m.at);
  if (m.requestId) setText(ref, 'ref', { id: String(m.requestId) });
}

// ---- the form ----

// renderLimits shows the server's input limits in the hints and the days
// input, so the visitor reads the same numbers the checks use.
function renderLimits() {
  const l = state.limits;
  setText($('destination-hint'), 'form.destination.hint', { max: l.destination_max });
  setText($('days-hint'), 'form.days.hint', { min: l.days_min, max: l.days_max });
  setText($('interests-hint'), 'form.interests.hint', { max: l.interests_max, len: l.interest_max });
  $('days').min = String(l.days_min);
  $('days').max = String(l.days_max);
  setText($('prompt-hint'), 'form.prompt.hint', { max: l.prompt_max_chars });
}

// inputKey is key in the form on screen: the prompt form has its own words
// (key + '.prompt', and for an error its '.prompt.next') where the trip
// form's speak of trips and plans; other keys fit both forms.
function inputKey(key) {
  return state.input === 'prompt' && hasKey(key + '.prompt') ? key + '.prompt' : key;
}

// renderInput shows the form /api/config names: a text box for an
// external agent's prompt, or the trip form.
function renderInput() {
  const prompt = state.input === 'prompt';
  $('prompt-field').hidden = !prompt;
  $('trip-fields').hidden = prompt;
  setText($('app-heading'), inputKey('app.heading'));
  setText($('app-tagline'), inputKey('app.tagline'));
  setText($('form-heading'), inputKey('form.heading'));
  document.title = t(inputKey('page.title'));
  renderSubmit();
}

// renderBanners makes development shortcuts impossible to miss: a page that
// only simulates the human check or the model must say so.
function renderBanners() {
  const c = state.config;
  $('dev-banner-defaults').hidden = !c.dev_mode;
  $('dev-banner-turnstile').hidden = !c.turnstile_test;
  $('dev-banner').hidden = !c.dev_mode && !c.turnstile_test;
  $('offline-note').hidden = c.offline_model !== true;
  setText($('offline-note'), inputKey('banner.offline'));
  const status = $('model-status');
  if (c.model_status === 'degraded' || c.model_status === 'unavailable') {
    setText(status, inputKey('banner.model_' + c.model_status));
    status.dataset.status = c.model_status;
    status.hidden = false;
  } else {
    status.hidden = true;
  }
}

// buildPresetChips creates the preset chips once; later renders only flip
// aria-pressed, so a chip keeps keyboard focus while it is toggled.
function buildPresetChips() {
  const box = $('interest-chips');
  for (const name of PRESETS) {
    const chip = el('button', {
      type: 'button',
      class: 'chip',
      id: 'chip-' + name,
      'data-testid': 'chip-' + name,
      'data-interest': name,
      'aria-pressed': 'false',
    });
    setText(chip, 'interest.' + name);
    chip.addEventListener('click', () => togglePreset(name));
    box.append(chip);
  }
}

// renderChips syncs chips with state.selected; custom chips are rebuilt
// because they come and go.
function renderChips() {
  const box = $('interest-chips');
  for (const chip of box.querySelectorAll('button[data-interest]')) {
    const on = state.selected.some((s) => s.preset === chip.dataset.interest);
    chip.setAttribute('aria-pressed', String(on));
  }
  for (const chip of box.querySelectorAll('.chip-custom')) chip.remove();
  state.selected.forEach((s, i) => {
    if (s.custom === undefined) return;
    // A pressed toggle: pressing it again deselects, which for a custom
    // interest means removing it.
    const chip = el('button', { type: 'button', class: 'chip chip-custom', 'data-testid': 'chip-custom', 'aria-pressed': 'true' }, s.custom);
    chip.addEventListener('click', () => {
      state.selected.splice(i, 1);
      clearFieldError('interests');
      renderChips();
      $('interest-custom').focus();
    });
    box.append(chip);
  });
  setText($('interest-count'), 'form.interests.count', { n: state.selected.length, max: state.limits.interests_max });
}

// togglePreset selects or deselects a preset, refusing past the limit with
// a message instead of silently ignoring the press.
function togglePreset(name) {
  const i = state.selected.findIndex((s) => s.preset === name);
  if (i >= 0) {
    state.selected.splice(i, 1);
  } else if (state.selected.length >= state.limits.interests_max) {
    setFieldError('interests', { key: 'field.interests_max', params: { max: state.limits.interests_max } });
    return;
  } else {
    state.selected.push({ preset: name });
  }
  clearFieldError('interests');
  renderChips();
}

// addCustomInterest turns the text box into a chip after the same length
// check the server applies.
function addCustomInterest() {
  const input = $('interest-custom');
  const text = input.value.trim();
  const bad = interestError(text, state.limits);
  if (bad) {
    setFieldError('interests', bad);
    input.focus();
    return;
  }
  // Typing the name of a preset selects that chip rather than duplicating it.
  const low = text.toLocaleLowerCase();
  const preset = PRESETS.find((p) => t('interest.' + p).toLocaleLowerCase() === low);
  const taken = state.selected.some((s) => (s.preset ? s.preset === preset : s.custom.toLocaleLowerCase() === low));
  if (taken) {
    input.value = '';
    return;
  }
  if (state.selected.length >= state.limits.interests_max) {
    setFieldError('interests', { key: 'field.interests_max', params: { max: state.limits.interests_max } });
    return;
  }
  state.selected.push(preset ? { preset } : { custom: text });
  input.value = '';
  clearFieldError('interests');
  renderChips();
}

function selectedInterests() {
  // Presets are sent in the visitor's language so the plan can use it too.
  return state.selected.map((s) => (s.preset ? t('interest.' + s.preset) : s.custom));
}

// setFieldError and clearFieldError change one field's message; the
// aria attributes follow in renderFieldErrors.
function setFieldError(field, err) {
  state.fieldErrors = { ...state.fieldErrors, [field]: err };
  renderFieldErrors();
}

function clearFieldError(field) {
  if (!state.fieldErrors[field]) return;
  const next = { ...state.fieldErrors };
  delete next[field];
  state.fieldErrors = next;
  renderFieldErrors();
}

// renderFieldErrors shows each field's message next to it and links it with
// aria-describedby, so a screen reader announces it on focus.
function renderFieldErrors() {
  for (const field of FIELDS) {
    const err = state.fieldErrors[field];
    const box = $(field + '-error');
    const input = $(FIELD_INPUT[field]);
    const described = FIELD_HINT[field] + (err ? ' ' + field + '-error' : '');
    if (err) {
      setText(box, err.key, err.params);
      input.setAttribute('aria-invalid', 'true');
    } else {
      clearText(box);
      input.removeAttribute('aria-invalid');
    }
    box.hidden = !err;
    input.setAttribute('aria-describedby', described);
  }
  const interestsErr = state.fieldErrors.interests ? ' interests-error' : '';
  $('interests-fieldset').setAttribute('aria-describedby', 'interests-hint interest-count' + interestsErr);
}

// focusFirstInvalid takes keyboard and screen reader users to the problem.
function focusFirstInvalid() {
  const field = FIELDS.find((f) => state.fieldErrors[f]);
  if (!field) return;
  if (field === 'interests') {
    const chip = $('interest-chips').querySelector('button');
    (chip || $('interest-custom')).focus();
    return;
  }
  $(FIELD_INPUT[field]).focus();
}

// renderSubmit enables the button only with config, a token and no request
// in flight, and says in words what the button is waiting for.
function renderSubmit() {
  const hasToken = !!(state.check && state.check.token());
  const button = $('submit');
  button.disabled = state.inFlight || !state.config || !hasToken;
  setText(button, state.inFlight ? 'form.submitting' : inputKey('form.submit'));
  $('task-form').setAttribute('aria-busy', String(state.inFlight));
  const status = $('check-status');
  if (!state.check) clearText(status);
  else if (state.check.mode === 'test') setText(status, 'form.check.test');
  else setText(status, hasToken ? 'form.check.passed' : 'form.check.needed');
}

// onSubmit checks the form locally, then spends one token on one POST.
// Every outcome ends in the live region; a 202 opens the task view.
async function onSubmit(ev) {
  ev.preventDefault();
  if (state.inFlight || !state.config || !state.check) return;
  const { value, errors } =
    state.input === 'prompt'
      ? validatePrompt({ prompt: $('prompt').value }, state.limits)
      : validateTask({ destination: $('destination').value, days: $('days').value, interests: selectedInterests() }, state.limits);
  state.fieldErrors = errors;
  renderFieldErrors();
  if (Object.keys(errors).length > 0) {
    setMessage({ kind: 'error', code: 'invalid_request' });
    focusFirstInvalid();
    return;
  }
  const token = state.check.token();
  if (!token) {
    setMessage({ kind: 'info', key: 'form.check.needed' });
    return;
  }
  state.inFlight = true;
  renderSubmit();
  setMessage({ kind: 'info', key: 'status.sending' });
  let accepted;
  try {
    // The plan is written in the page's language.
    accepted = await api.createTask({ turnstile_token: token, ...value, language: state.lang });
  } catch (err) {
    const m = errorMessage(err);
    if (m.code === 'invalid_request' && m.fields) {
      state.fieldErrors = serverFieldErrors(m.fields, state.limits);
      renderFieldErrors();
      focusFirstInvalid();
    }
    setMessage(m);
    return;
  } finally {
    // Whatever happened, the token may have been spent.
    state.inFlight = false;
    state.check.reset();
    renderSubmit();
  }
  if (typeof accepted.id !== 'string') {
    setMessage({ kind: 'error', code: 'unknown' });
    return;
  }
  startTask(accepted, value);
}

// ---- the task ----

// newTask is the page's copy of a task; steps are keyed by seq so replayed
// or repeated events update rows instead of adding them.
function newTask(id, status, request) {
  return { id, status, request: request || null, steps: new Map(), result: null, error: null, quota: null, usage: null };
}

// addStep files a step under its seq. A replayed "started" never overwrites
// a step that has already finished.
function addStep(step) {
  const seq = Number(step && step.seq);
  if (!Number.isSafeInteger(seq)) return null;
  const prev = state.task.steps.get(seq);
  if (prev && prev.status !== 'started' && step.status === 'started') return seq;
  state.task.steps.set(seq, step);
  return seq;
}

// absorb merges a whole task snapshot (poll answer or done event).
function absorb(task) {
  const s = state.task;
  if (typeof task.status === 'string') s.status = task.status;
  if (task.request && typeof task.request === 'object') s.request = task.request;
  if (Array.isArray(task.steps)) task.steps.forEach(addStep);
  if (task.result && typeof task.result === 'object') s.result = task.result;
  if (task.error && typeof task.error === 'object') s.error = task.error;
  if (task.usage && typeof task.usage === 'object') s.usage = task.usage;
}

// renderTask redraws the task section from state.task.
function renderTask() {
  const task = state.task;
  const section = $('task');
  section.hidden = !task;
  if (!task) return;
  const dest = task.request && typeof task.request.destination === 'string' ? task.request.destination : '';
  const prompted = (task.request && typeof task.request.prompt === 'string') || state.input === 'prompt';
  if (dest) setText($('task-heading'), 'task.heading_for', { destination: dest });
  else setText($('task-heading'), prompted ? 'task.heading.prompt' : 'task.heading');
  const status = TASK_STATUSES.includes(task.status) ? task.status : 'unknown';
  setText($('task-status'), 'task.status.' + status);
  section.dataset.status = status;
  $('task-status').dataset.status = status;

  const quota = $('quota');
  const q = task.quota;
  quota.hidden = !(q && Number.isFinite(q.ip_remaining) && Number.isFinite(q.global_remaining));
  if (!quota.hidden) setText(quota, inputKey('task.quota'), { ip: q.ip_remaining, global: q.global_remaining });

  [...task.steps.keys()].sort((a, b) => a - b).forEach((seq) => renderStep(task.steps.get(seq)));
  $('steps-empty').hidden = task.steps.size > 0;
  renderOutcome();
}

// renderStep updates the row of step.seq in place, or inserts it in order.
function renderStep(step) {
  const seq = Number(step.seq);
  const list = $('steps');
  let row = $('step-' + seq);
  if (!row) {
    row = el('li', { id: 'step-' + seq, class: 'step', 'data-testid': 'step', 'data-seq': String(seq) });
    const after = [...list.children].find((c) => Number(c.dataset.seq) > seq);
    list.insertBefore(row, after || null);
  }
  const kind = STEP_KINDS.includes(step.kind) ? step.kind : 'unknown';
  const status = STEP_STATUSES.includes(step.status) ? step.status : 'unknown';
  row.dataset.status = status;
  row.dataset.kind = kind;
  const kindEl = el('span', { class: 'step-kind' });
  setText(kindEl, 'step.kind.' + kind);
  const statusEl = el('span', { class: 'step-status', 'data-testid': 'step-status' });
  setText(statusEl, 'step.status.' + status);
  const parts = [kindEl, el('span', { class: 'step-name' }, typeof step.name === 'string' ? step.name : ''), statusEl];
  if (status !== 'started' && Number.isFinite(step.duration_ms)) {
    const [key, params] = durationKey(step.duration_ms);
    const dur = el('span', { class: 'step-duration', 'data-testid': 'step-duration' });
    setText(dur, key, params);
    parts.push(dur);
  }
  if (typeof step.detail === 'string' && step.detail !== '') {
    parts.push(el('span', { class: 'step-detail' }, step.detail));
  }
  row.replaceChildren(...parts);
  $('steps-empty').hidden = true;
}

// renderOutcome shows the failure or the itinerary. Every server string
// goes through textContent or a text node.
function renderOutcome() {
  const task = state.task;
  const errBox = $('task-error');
  errBox.hidden = task.status !== 'failed';
  if (task.status === 'failed') {
    const code = failureCode(task);
    const key = inputKey(taskErrorKey(code));
    errBox.dataset.code = code;
    setText($('task-error-text'), key);
    setText($('task-error-next'), key + '.next');
  }

  const r = task.result;
  const box = $('result');
  box.hidden = !r;
  if (!r) return;
  // The plan keeps its own language, whatever the page's: a screen reader
  // then reads an English plan on the Chinese page with an English voice.
  // Plans from before the language field were always English.
  const planLang = typeof r.language === 'string' && LANG_TAG.test(r.language) ? r.language : 'en';
  // An external agent's answer is Markdown text: the safe subset, built
  // as elements and text nodes, never parsed as HTML.
  const isText = typeof r.text === 'string';
  setText($('result-heading'), isText ? 'task.result.heading.prompt' : 'task.result.heading');
  const answer = $('answer');
  answer.hidden = !isText;
  answer.lang = planLang;
  answer.replaceChildren(isText ? renderMarkdown(r.text) : '');
  const title = $('answer-title');
  title.hidden = !(isText && typeof r.title === 'string' && r.title !== '');
  title.lang = planLang;
  title.textContent = title.hidden ? '' : r.title;
  $('summary').hidden = isText;
  $('summary').lang = planLang;
  $('days-list').lang = planLang;
  $('summary').textContent = typeof r.summary === 'string' ? r.summary : '';
  $('cached-note').hidden = r.cached !== true;
  const warnings = Array.isArray(r.warnings) ? r.warnings : [];
  $('warnings').replaceChildren(
    ...warnings.map((code) => {
      const li = el('li', { 'data-code': String(code) });
      setText(li, inputKey(warningKey(code)));
      return li;
    }),
  );
  $('warnings-box').hidden = warnings.length === 0;
  const days = Array.isArray(r.days) ? r.days : [];
  $('days-list').replaceChildren(...days.map(renderDay));

  const model = $('model-info');
  if (typeof r.model === 'string' && r.model !== '') setText(model, r.offline ? 'task.model_offline' : 'task.model', { model: r.model });
  else clearText(model);
  const u = task.usage;
  const usage = $('usage');
  usage.hidden = !(u && Number.isFinite(u.prompt_tokens) && Number.isFinite(u.completion_tokens));
  if (!usage.hidden) setText(usage, 'task.usage', { prompt: u.prompt_tokens, completion: u.completion_tokens });
}

// renderDay builds one day card: an article with a heading and a list. The
// card is in the plan's language (from #days-list); the "Day n" label is
// the page's, so it carries the page's lang.
function renderDay(day, i) {
  const d = day && typeof day === 'object' ? day : {};
  const n = Number.isSafeInteger(d.day) ? d.day : i + 1;
  const title = el('h4', { class: 'day-title' });
  if (typeof d.title === 'string' && d.title !== '') {
    const label = el('span', { class: 'day-label', lang: state.lang });
    setText(label, 'task.day_prefix', { n });
    title.append(label, d.title);
  } else {
    title.lang = state.lang;
    setText(title, 'task.day', { n });
  }
  const items = Array.isArray(d.items) ? d.items : [];
  const list = el('ul', {}, ...items.map((item) => el('li', {}, String(item))));
  return el('article', { class: 'day', 'data-testid': 'day-card', 'data-day': String(n) }, title, list);
}

// failureCode names why a task failed; a failure without a code is the
// agent's.
function failureCode(task) {
  const code = task.error && task.error.code;
  return typeof code === 'string' && SAFE_CODE.test(code) ? code : 'agent_failed';
}

function stopWatching() {
  if (state.watcher) state.watcher.abort();
  state.watcher = null;
}

// showTask replaces the task on screen and stops following the old one.
function showTask(task) {
  stopWatching();
  state.task = task;
  $('steps').replaceChildren();
  renderTask();
}

// finish announces the final state of the task in the live region.
function finish() {
  state.watcher = null;
  const text = state.task.result && typeof state.task.result.text === 'string';
  if (state.task.status === 'succeeded') setMessage({ kind: 'info', key: text ? 'status.done.prompt' : 'status.done' });
  else setMessage({ kind: 'error', code: failureCode(state.task), task: true });
}

// follow streams task id's progress into the view through the client,
// which resumes dropped streams by itself and polls when no stream can be
// had. Handlers ignore a task that is no longer on screen (the visitor
// started another); stopWatching aborts the follow.
function follow(id) {
  const current = () => state.task !== null && state.task.id === id;
  const watcher = new AbortController();
  state.watcher = watcher;
  let mode = 'stream';
  // After a passing problem (shown as a notice) the next progress puts the
  // progress message back.
  const recovered = () => {
    if (state.message && state.message.kind === 'notice' && state.message.transient) {
      setMessage({ kind: 'info', key: mode === 'poll' ? 'status.polling' : 'status.following' });
    }
  };
  api.follow(id, {
    signal: watcher.signal,
    onStep(step) {
      if (!current()) return;
      recovered();
      const seq = addStep(step);
      if (seq !== null) renderStep(state.task.steps.get(seq));
    },
    onStatus(status) {
      if (!current()) return;
      recovered();
      state.task.status = status;
      renderTask();
    },
    onTask(task) {
      if (!current()) return;
      recovered();
      absorb(task);
      renderTask();
    },
    onMode(m, reason) {
      mode = m;
      if (m !== 'poll' || !current()) return;
      // A refusal the visitor can act on is named; a lost connection is not.
      if (reason && STREAM_REFUSALS.includes(reason.code)) setMessage(errorMessage(reason, 'notice'));
      else setMessage({ kind: 'info', key: 'status.polling' });
    },
    onRetry(err) {
      if (current()) setMessage({ ...errorMessage(err, 'notice'), transient: true });
    },
  }).then(
    (task) => {
      if (watcher.signal.aborted || !current()) return;
      absorb(task);
      renderTask();
      finish();
    },
    (err) => {
      if (watcher.signal.aborted || !current()) return;
      state.watcher = null;
      setMessage(errorMessage(err));
    },
  );
}

// startTask shows an accepted task (remaining quota first) and follows it.
function startTask(accepted, request) {
  const task = newTask(accepted.id, typeof accepted.status === 'string' ? accepted.status : 'queued', request);
  if (accepted.quota && typeof accepted.quota === 'object') task.quota = accepted.quota;
  showTask(task);
  // replaceState, not location.hash: no hashchange, no extra history entry,
  // yet a reload comes back to this task.
  if (TASK_ID.test(accepted.id)) history.replaceState(null, '', '#' + accepted.id);
  setMessage({ kind: 'info', key: 'status.accepted' });
  $('task-heading').focus();
  follow(accepted.id);
}

// openFromHash shows the task named by #t_<id>: after a reload, from a
// shared link, or when the hash changes. Finished tasks need no stream.
async function openFromHash() {
  const hash = location.hash.slice(1);
  if (!hash.startsWith('t_')) return;
  if (state.task && state.task.id === hash) return;
  stopWatching();
  state.task = null;
  renderTask();
  if (!TASK_ID.test(hash)) {
    setMessage({ kind: 'error', code: 'task_not_found' });
    return;
  }
  setMessage({ kind: 'info', key: 'status.loading_task' });
  let task;
  try {
    task = await api.getTask(hash);
  } catch (err) {
    if (location.hash.slice(1) === hash && !state.task) setMessage(errorMessage(err));
    return;
  }
  // The visitor may have moved on while the answer was on its way.
  if (location.hash.slice(1) !== hash || state.task) return;
  showTask(newTask(hash, 'queued', null));
  absorb(task);
  renderTask();
  if (isFinal(state.task.status)) {
    finish();
    return;
  }
  setMessage({ kind: 'info', key: 'status.following' });
  follow(hash);
}

// ---- start ----

// loadConfig reads /api/config and only then enables the form: limits,
// banners and the human check all depend on it.
async function loadConfig() {
  setMessage({ kind: 'info', key: 'status.loading_config' });
  let config;
  try {
    config = await api.config();
  } catch (err) {
    const m = errorMessage(err);
    // An answer without a usable body is the settings' own failure.
    setMessage(m.code === 'unknown' ? { ...m, code: 'config' } : m);
    return;
  }
  state.config = config;
  state.limits = limitsFrom(config.limits);
  state.input = config.input === 'prompt' ? 'prompt' : 'trip';
  renderLimits();
  renderInput();
  renderBanners();
  setMessage(null);
  state.check = startHumanCheck({
    config,
    container: $('turnstile'),
    lang: state.lang,
    onChange: renderSubmit,
    onError: (code) => setMessage({ kind: 'error', code }),
  });
  renderSubmit();
}

// init wires the page. Modules run after parsing, so the DOM is complete.
function init() {
  let stored = null;
  try {
    stored = localStorage.getItem(LANG_STORAGE);
  } catch {
    stored = null;
  }
  buildPresetChips();
  renderLimits();
  renderChips();
  renderFieldErrors();
  renderSubmit();
  setLanguage(pickLanguage(stored, navigator.languages || [navigator.language]), false);

  $('lang').addEventListener('change', (ev) => setLanguage(ev.target.value, true));
  $('task-form').addEventListener('submit', onSubmit);
  $('interest-add').addEventListener('click', addCustomInterest);
  $('interest-custom').addEventListener('keydown', (ev) => {
    // Enter adds the interest instead of submitting the whole form.
    if (ev.key === 'Enter') {
      ev.preventDefault();
      addCustomInterest();
    }
  });
  $('destination').addEventListener('input', () => clearFieldError('destination'));
  $('prompt').addEventListener('input', () => clearFieldError('prompt'));
  $('days').addEventListener('input', () => clearFieldError('days'));
  window.addEventListener('hashchange', openFromHash);

  loadConfig().then(openFromHash);
}

init();
