// Client-side checks that mirror the server's, so most mistakes are caught
// without spending a Turnstile token. The server stays the authority: these
// rules only spare a round trip.

/** DEFAULT_LIMITS are the documented limits, used until /api/config says otherwise. */
export const DEFAULT_LIMITS = Object.freeze({
  destination_max: 80,
  days_min: 1,
  days_max: 7,
  interests_max: 5,
  interest_max: 32,
  prompt_max_chars: 2000,
});

/** limitsFrom merges the "limits" object of /api/config over the defaults, keeping only sane integers. */
export function limitsFrom(limits) {
  const out = { ...DEFAULT_LIMITS };
  if (!limits || typeof limits !== 'object') return out;
  for (const name of Object.keys(DEFAULT_LIMITS)) {
    const v = limits[name];
    if (Number.isInteger(v) && v >= 0 && v <= 100000) out[name] = v;
  }
  if (out.days_min > out.days_max) {
    out.days_min = DEFAULT_LIMITS.days_min;
    out.days_max = DEFAULT_LIMITS.days_max;
  }
  return out;
}

/**
 * codePoints counts Unicode code points of the NFKC form, as the server does
 * (String.length counts UTF-16 units, and "ﷺ" is 18 characters in NFKC).
 */
export function codePoints(s) {
  return [...s.normalize('NFKC')].length;
}

/**
 * CONTROL matches what the server refuses in any text field: control
 * characters, format characters (zero-width spaces, bidi controls) and the
 * tag block. Tabs and line breaks are control characters too: a trip's
 * fields are one line each.
 */
const CONTROL = /[\p{Cc}\p{Cf}\u{E0000}-\u{E007F}\uFFFD]/u;
/** INVISIBLE is CONTROL without tab and line breaks, which a prompt may hold. */
const INVISIBLE = /[\0-\x08\x0B\x0C\x0E-\x1F\x7F-\x9F\p{Cf}\u{E0000}-\u{E007F}\uFFFD]/u;

/** interestError returns the field error for one interest, or null when it is acceptable. */
export function interestError(text, limits) {
  const s = String(text).trim();
  const n = codePoints(s);
  if (n < 1 || n > limits.interest_max) {
    return { key: 'field.interest_length', params: { len: limits.interest_max } };
  }
  if (CONTROL.test(s)) return { key: 'field.control', params: {} };
  return null;
}

/**
 * validateTask checks raw form values. It returns the cleaned request body
 * (trimmed strings, a number of days) and a map field → {key, params} of
 * message-table entries, empty when the request may be sent.
 */
export function validateTask(raw, limits) {
  const errors = {};
  const destination = String(raw.destination ?? '').trim();
  const dn = codePoints(destination);
  if (dn < 1 || dn > limits.destination_max) {
    errors.destination = { key: 'field.destination', params: { max: limits.destination_max } };
  } else if (CONTROL.test(destination)) {
    errors.destination = { key: 'field.control', params: {} };
  }

  // type="number" inputs hand over "" for anything unparsable, so the
  // pattern also rejects "2.5", "1e1" and blanks.
  const daysText = String(raw.days ?? '').trim();
  const days = /^\d{1,3}$/.test(daysText) ? Number(daysText) : NaN;
  if (!Number.isInteger(days) || days < limits.days_min || days > limits.days_max) {
    errors.days = { key: 'field.days', params: { min: limits.days_min, max: limits.days_max } };
  }

  const interests = (raw.interests || []).map((s) => String(s).trim());
  const badOne = interests.some((s) => interestError(s, limits) !== null);
  if (interests.length > limits.interests_max || badOne) {
    errors.interests = { key: 'field.interests', params: { max: limits.interests_max, len: limits.interest_max } };
  }
  return { value: { destination, days, interests }, errors };
}

/**
 * validatePrompt checks the prompt form's text. It returns the request body
 * (the trimmed prompt) and a map field → {key, params}, empty when the
 * request may be sent.
 */
export function validatePrompt(raw, limits) {
  const errors = {};
  const prompt = String(raw.prompt ?? '').trim();
  const n = codePoints(prompt);
  if (n < 1 || n > limits.prompt_max_chars) {
    errors.prompt = { key: 'field.prompt', params: { max: limits.prompt_max_chars } };
  } else if (INVISIBLE.test(prompt)) {
    errors.prompt = { key: 'field.prompt_control', params: {} };
  }
  return { value: { prompt }, errors };
}

/**
 * serverFieldErrors maps the "fields" object of a 400 answer onto our own
 * translated messages: the server's sentences are English only. Sub-keys
 * such as "interests[2]" count as the interests field.
 */
export function serverFieldErrors(fields, limits) {
  const errors = {};
  if (!fields || typeof fields !== 'object') return errors;
  for (const name of Object.keys(fields)) {
    const control = String(fields[name]).includes('control characters');
    if (name === 'destination') {
      errors.destination = control
        ? { key: 'field.control', params: {} }
        : { key: 'field.destination', params: { max: limits.destination_max } };
    } else if (name === 'days') {
      errors.days = { key: 'field.days', params: { min: limits.days_min, max: limits.days_max } };
    } else if (name === 'prompt') {
      errors.prompt = control
        ? { key: 'field.prompt_control', params: {} }
        : { key: 'field.prompt', params: { max: limits.prompt_max_chars } };
    } else if (name.startsWith('interest')) {
      errors.interests = { key: 'field.interests', params: { max: limits.interests_max, len: limits.interest_max } };
    }
  }
  return errors;
}
