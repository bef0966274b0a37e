// Package policy is faregate's keyed lane: a YAML policy file of tiers,
// API keys, prompt rules and model prices, its validation, the
// authentication of bearer keys against it, and its hot reload.
//
// A *Policy is immutable. A Store holds the current one behind an atomic
// pointer and swaps in a whole new one when the file changes, so a request
// that read Current() once sees one policy from start to end, never a mix.
//
// # The file
//
// testdata/example.yaml is a commented example, kept valid by a test.
//
//	tiers:
//	  public:  {tasks_per_day: 5, tokens_per_day: 40000, tokens_per_minute: 6000, requests_per_minute: 120}
//	  partner: {tasks_per_day: 500, tokens_per_day: 2000000, requests_per_minute: 600, max_site_share: 0.5}
//	keys:
//	  - {id: acme, sha256: "<64 hex: sha256 of the key>", tier: partner}
//	  - {id: old, sha256: "<64 hex>", tier: partner, disabled: true}
//	rules:
//	  builtin: true            # default; false turns the built-in prompt rules off
//	  prompt:
//	    - {name: no_crypto, pattern: '(?i)\bbitcoin\b'}
//	models:
//	  gpt-4o-mini: {input: 0.15, output: 0.60}
//	  claude-sonnet-4-5: {input: 3, output: 15, cache_write: 3.75, cache_read: 0.30}
//
// Every section is optional, but the file must hold a mapping: an empty
// file is an error (an editor caught between truncate and write must not
// swap in a policy without keys); to run without a policy, leave
// FAREGATE_POLICY_FILE empty. Unknown fields and duplicate names are
// errors. Every problem is reported at once, each with its line.
//
// Tiers. Names are [a-z0-9_-]{1,32}. Fields:
//   - tasks_per_day: whole number ≥ 1.
//   - tokens_per_day: whole number ≥ 1.
//   - requests_per_minute: whole number ≥ 1.
//   - tokens_per_minute: whole number ≥ 0; 0 (the default) means no
//     per-principal token bucket. It is the only limit where 0 means
//     "unlimited".
//   - max_site_share: number above 0 and at most 1, default 1: the share of
//     the site's daily token budget the tier's principals may use together.
//     0 is refused: to stop a tier, disable its keys.
//   - requests_per_second: whole number ≥ 0; a second window over the same
//     requests as requests_per_minute. 0 (the default of a tier other than
//     public) means none.
//   - tokens_per_hour: whole number ≥ 0; the tokens one principal may be
//     charged in any sliding hour. 0 (the default) means none.
//   - soft_at: number above 0 and at most 1, default 0.8 with
//     tokens_per_hour: from that share of the hour a principal is
//     throttled (soft_requests_per_minute, the fallback model first).
//   - soft_requests_per_minute: whole number ≥ 1, default 5 with
//     tokens_per_hour.
//
// A tier other than public must give tasks_per_day, tokens_per_day and
// requests_per_minute. The public tier is the anonymous lane and always
// exists: its values start as the environment's (FAREGATE_IP_DAILY_LIMIT,
// FAREGATE_IP_DAILY_TOKENS, FAREGATE_REQUESTS_PER_MINUTE,
// FAREGATE_REQUESTS_PER_SECOND, FAREGATE_IP_HOURLY_TOKENS, FAREGATE_SOFT_AT
// and FAREGATE_SOFT_REQUESTS_PER_MINUTE, handed to Load as the defaults)
// and each field the file gives replaces that one value.
// Whole numbers are at most 10^15 so sums and doubled bucket capacities
// stay far from overflow.
//
// Keys. Each entry has id ([a-z0-9_-]{1,64}, unique), sha256 (64 hex
// characters, either case, unique), tier (defined in the file, not public:
// keys are the keyed lane) and optionally disabled (default false). The
// key itself never appears in the file; `faregate keys new` prints a key
// and its line.
//
// Rules. rules.prompt is a list of {name, pattern}: names [a-z0-9_-]{1,64},
// unique and different from the built-in names; patterns are Go (RE2)
// regular expressions, matched against each field's text and all of them
// joined by line breaks, in NFKC and in NFKC case-folded (so "bitcoin"
// matches "BitCoin" and "ＢＩＴＣＯＩＮ"; see Policy.CheckPrompt), at most
// 4096 bytes, and must not match empty text (they would refuse every
// request). They apply in addition to the built-in rules unless
// rules.builtin is false.
//
// Models. models.<name> gives input and output prices per million tokens
// in the operator's currency: numbers ≥ 0 with at most 6 decimal places,
// at most 1000000. cache_write and cache_read, optional, price the prompt
// tokens a provider writes to and reads from its prompt cache (Anthropic
// bills them apart); left out they are 1.25 and 0.1 times the input price
// (a write cached for an hour is 2 times it), and 0 is refused where the
// input price is not (0 stands for the default). Price exposes them in integer millionths (0.15 →
// 150000), since money is kept in micro-units.
package policy
