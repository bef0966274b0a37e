// Package aitf fingerprints AI-agent traffic ("AI traffic fingerprinting")
// so a public demo can slow automated floods before they cost a Turnstile
// siteverify call or a model run.
//
// A single-pass scanner reads the raw JSON body without decoding it: it
// looks at key names at any nesting level (after JSON unescaping, lower-cased,
// with '_', '-', '.' and spaces removed, so "tool\u005fcall_id", "toolCallId"
// and "tool-call-id" are one key), remembers the key that opened each
// container (for "metadata.confidence"), and reads the values of the keys it
// knows. Invalid JSON is scored as far as it can be read; nothing recurses,
// so 10,000 nested brackets cost nothing but a counter. Three more dimensions
// come from per-visitor behaviour held in a size-capped LRU.
//
// # Dimensions
//
// Every dimension d_i lies in [0,1]; w_i is its weight in the score.
//
//	#  name            w     measures
//	0  recursion       0.65  recursion_depth, recursion_limit, max_hops, max_iterations, chain_depth (1.0);
//	                         max_depth, max_steps, hops (0.6); depth (0.3). Value v: (v-1)/2, so 1 → 0, 3+ → 1
//	1  noninteractive  0.50  mode/run_mode/execution_mode/agent_mode of batch*, bulk*, autonomous*, auto_chain*,
//	                         chain, agent, pipeline*, headless, unattended kinds (not a theme's "auto"); interactive: false;
//	                         human_in_the_loop: false; headless/unattended/autonomous/auto_approve: true
//	2  context         0.45  context_window, context_length, num_ctx, max_context… against the 4096 default:
//	                         log2(v/4096)/3, so 4096 → 0, 8192 → 0.33, 32768+ → 1
//	3  chunking        0.45  chunk_size, chunk_overlap, chunk_strategy, text_splitter…: any one key 1
//	4  retry           0.45  retry_strategy, retry_policy, max_retries, max_attempts, backoff…: any one key 1
//	5  toolcall        0.70  tool_call_id, tool_use_id, tool_calls, function_call (1.0); function inside
//	                         tool_calls (1.0), function object (0.6) or string (0.2); tool_choice (0.8);
//	                         tool_name (0.5); tools list (0.25)
//	6  metadata        0.50  metadata.confidence (1.0), system_fingerprint (1.0), logprobs, finish_reason,
//	                         stop_reason (0.8), prompt/completion/total_tokens (0.7), model naming an LLM
//	                         family (0.7), a bare confidence in [0,1] (0.3)
//	7  sampling        0.50  temperature in [0,2], top_p, top_k, max_tokens, max_new_tokens, penalties,
//	                         logit_bias, stop_sequences: one key 0.5, two 0.8, three 1
//	8  trace           0.50  sum, capped at 1, of agent framework traces: intermediate_steps,
//	                         agent_scratchpad (1.0); thought, observation, action_input, parent_run_id,
//	                         scratchpad, chain_of_thought (0.8); run_id, callbacks (0.5); trace_id (0.3);
//	                         span_id (0.2)
//	9  enumeration     0.50  per visitor: consecutive requests naming prefix+number identifiers
//	                         (doc_78901 → doc_78912, or numeric *_id values) that step by 1..32: hits/4
//	10 repeat          0.50  per visitor: the same non-empty body again within 60 s of its last
//	                         sighting: (n-1)/4 for the n-th sighting
//	11 burst           0.50  per visitor: requests inside one 1 s window: (n-4)/8, halved unless the
//	                         window opened after at least 5 s of quiet
//
// # Score
//
// The combined score is a weighted noisy-OR:
//
//	score = 1 − Π_i (1 − w_i · d_i)
//
// Each dimension can only raise it, one strong signal (tool_call_id, or
// recursion_depth ≥ 3) alone reaches w ≥ 0.65, any three full signals reach
// at least 1 − 0.55³ ≈ 0.83, and since every w_i < 1 the score stays below 1.
// Ordinary REST bodies and the page's own task body score below 0.2.
//
// # Enforcement
//
// Guard.Middleware scores each request and stores a Result in the context;
// Guard.Admit (or the Guard.Delay middleware) applies the delay queue in
// enforce mode: a request scoring at least the threshold waits
// 200 ms + score × 800 ms (halved with X-AITF-Opt-In: true), requests with
// the same tool_call_id never run concurrently, high scorers pass degraded
// once the backlog is long, and past the queue bound requests are refused.
package aitf
