package aitf

import (
	"bytes"
	"math"
)

// rule says how the value of a known key turns into a contribution in [0,1]
// before the key's own strength is applied.
type rule uint8

const (
	ruleNone        rule = iota
	ruleDepth            // hop/depth count: 1 is ordinary, 3 or more is recursion
	ruleTrue             // a boolean flag that signals when true
	ruleFalse            // a boolean flag that signals when false (interactive: false)
	ruleAgentMode        // a mode string naming a batch/auto-chain kind
	ruleContext          // a context size against the 4096 default
	rulePresent          // any non-empty value
	ruleToolID           // a tool call id string (also captured for serialisation)
	ruleList             // a non-empty array or object
	ruleFunction         // "function": strongest inside tool_calls
	ruleNestedID         // "id": a tool call id only inside tool_calls
	ruleTemperature      // a number in the LLM range [0,2] (not a thermostat)
	ruleUnit             // a number in [0,1]
	rulePositive         // a number above 0
	ruleNumber           // any number
	ruleConfidence       // a number in [0,1], strongest under metadata
	ruleModelName        // a string naming an LLM family
)

// agg says how contributions of several keys combine into one dimension.
type agg uint8

const (
	aggMax   agg = iota // the strongest key wins
	aggCount            // distinct keys are counted, then mapped by countCurve
	aggSum              // distinct keys' contributions add up, capped at 1
)

// aggOf gives each dimension its aggregation.
func aggOf(dim uint8) agg {
	switch dim {
	case dimChunking, dimRetry, dimSampling:
		return aggCount
	case dimTrace:
		return aggSum
	}
	return aggMax
}

// countCurve maps the number of distinct keys seen to a dimension value.
// One chunking or retry key is already a whole signal (ordinary APIs do
// not send them); one sampling key is half of one, since a thermostat may
// well take a "temperature".
func countCurve(dim uint8, n uint8) float64 {
	switch {
	case n == 0:
		return 0
	case dim != dimSampling:
		return 1
	case n == 1:
		return 0.5
	case n == 2:
		return 0.8
	}
	return 1
}

// keySpec describes a key the scanner knows; id 0 means an unknown key.
type keySpec struct {
	id   uint8
	dim  uint8
	rule rule
	w    float64 // the key's strength within its dimension
}

// Key ids: distinct per key so count and sum dimensions count each key once.
// The ones referenced as parents are named.
const (
	kNone uint8 = iota
	kMetadata
	kToolCalls
	kFunction
	kID
	kFirstOther // ids from here on are assigned in lookupKey
)

// lookupKey maps a normalised key (lower-case, '_', '-', '.' and spaces
// removed) to its spec. A switch on string(b) neither allocates nor needs a
// package-level map.
func lookupKey(b []byte) keySpec {
	const o = kFirstOther
	switch string(b) {
	// recursion depth
	case "recursiondepth":
		return keySpec{o + 0, dimRecursion, ruleDepth, 1}
	case "recursionlimit":
		return keySpec{o + 1, dimRecursion, ruleDepth, 1}
	case "maxrecursion", "maxrecursiondepth":
		return keySpec{o + 2, dimRecursion, ruleDepth, 1}
	case "maxhops":
		return keySpec{o + 3, dimRecursion, ruleDepth, 1}
	case "maxiterations":
		return keySpec{o + 4, dimRecursion, ruleDepth, 1}
	case "chaindepth", "maxchaindepth", "maxloops":
		return keySpec{o + 5, dimRecursion, ruleDepth, 1}
	case "maxdepth", "maxsteps", "hops":
		return keySpec{o + 6, dimRecursion, ruleDepth, 0.6}
	case "depth":
		// Ordinary tree and filter APIs use "depth" too; it only hints.
		return keySpec{o + 7, dimRecursion, ruleDepth, 0.3}
	case "recursive":
		return keySpec{o + 8, dimRecursion, ruleTrue, 0.5}

	// non-interactive mode
	case "mode", "runmode", "executionmode", "agentmode":
		return keySpec{o + 10, dimNonInteractive, ruleAgentMode, 1}
	case "interactive", "humanintheloop":
		return keySpec{o + 11, dimNonInteractive, ruleFalse, 1}
	case "noninteractive", "headless", "unattended", "autonomous", "autoapprove", "autorun", "autoconfirm":
		return keySpec{o + 12, dimNonInteractive, ruleTrue, 1}
	case "requireapproval":
		return keySpec{o + 13, dimNonInteractive, ruleFalse, 0.8}

	// context inflation
	case "contextwindow", "contextlength", "contextsize", "maxcontext", "maxcontextlength",
		"maxcontexttokens", "numctx", "nctx", "ctxsize":
		return keySpec{o + 15, dimContext, ruleContext, 1}

	// chunking
	case "chunksize":
		return keySpec{o + 20, dimChunking, rulePresent, 1}
	case "chunkoverlap":
		return keySpec{o + 21, dimChunking, rulePresent, 1}
	case "chunkstrategy", "chunkingstrategy", "chunking":
		return keySpec{o + 22, dimChunking, rulePresent, 1}
	case "chunktokens", "chunklength":
		return keySpec{o + 23, dimChunking, rulePresent, 1}
	case "textsplitter":
		return keySpec{o + 24, dimChunking, rulePresent, 1}

	// retry policy
	case "retrystrategy", "retrypolicy":
		return keySpec{o + 30, dimRetry, rulePresent, 1}
	case "maxretries", "retries":
		return keySpec{o + 31, dimRetry, rulePresent, 1}
	case "maxattempts":
		return keySpec{o + 32, dimRetry, rulePresent, 1}
	case "backoff", "backofffactor", "backoffstrategy", "retrybackoff", "exponentialbackoff":
		return keySpec{o + 33, dimRetry, rulePresent, 1}
	case "retrydelay", "retryon":
		return keySpec{o + 34, dimRetry, rulePresent, 1}

	// tool-call identity
	case "toolcallid", "tooluseid":
		return keySpec{o + 40, dimToolCall, ruleToolID, 1}
	case "toolcalls":
		return keySpec{kToolCalls, dimToolCall, ruleList, 1}
	case "functioncall", "toolcall":
		return keySpec{o + 41, dimToolCall, rulePresent, 1}
	case "function":
		return keySpec{kFunction, dimToolCall, ruleFunction, 1}
	case "toolchoice":
		return keySpec{o + 42, dimToolCall, rulePresent, 0.8}
	case "toolname":
		return keySpec{o + 43, dimToolCall, rulePresent, 0.5}
	case "tools":
		// A hardware shop sends "tools" too; alone it stays a hint.
		return keySpec{o + 44, dimToolCall, ruleList, 0.25}
	case "id":
		return keySpec{kID, dimToolCall, ruleNestedID, 1}

	// model metadata
	case "metadata":
		return keySpec{kMetadata, dimMetadata, ruleNone, 0}
	case "confidence", "confidencescore":
		return keySpec{o + 50, dimMetadata, ruleConfidence, 1}
	case "metadataconfidence":
		return keySpec{o + 51, dimMetadata, ruleUnit, 1}
	case "systemfingerprint":
		return keySpec{o + 52, dimMetadata, rulePresent, 1}
	case "logprobs", "toplogprobs", "finishreason", "stopreason":
		return keySpec{o + 53, dimMetadata, rulePresent, 0.8}
	case "prompttokens", "completiontokens", "totaltokens":
		return keySpec{o + 54, dimMetadata, rulePositive, 0.7}
	case "model", "modelname", "modelid":
		return keySpec{o + 55, dimMetadata, ruleModelName, 0.7}

	// LLM sampling parameters
	case "temperature":
		return keySpec{o + 60, dimSampling, ruleTemperature, 1}
	case "topp", "typicalp", "minp":
		return keySpec{o + 61, dimSampling, ruleUnit, 1}
	case "topk":
		return keySpec{o + 62, dimSampling, rulePositive, 1}
	case "maxtokens", "maxnewtokens", "maxcompletiontokens", "maxoutputtokens":
		return keySpec{o + 63, dimSampling, rulePositive, 1}
	case "frequencypenalty", "presencepenalty":
		return keySpec{o + 64, dimSampling, ruleNumber, 1}
	case "repetitionpenalty", "repeatpenalty":
		return keySpec{o + 65, dimSampling, ruleNumber, 1}
	case "logitbias", "stopsequences":
		return keySpec{o + 66, dimSampling, rulePresent, 1}

	// agent framework traces
	case "intermediatesteps":
		return keySpec{o + 70, dimTrace, rulePresent, 1}
	case "agentscratchpad":
		return keySpec{o + 71, dimTrace, rulePresent, 1}
	case "thought", "thoughts":
		return keySpec{o + 72, dimTrace, rulePresent, 0.8}
	case "observation", "observations":
		return keySpec{o + 73, dimTrace, rulePresent, 0.8}
	case "actioninput":
		return keySpec{o + 74, dimTrace, rulePresent, 0.8}
	case "parentrunid":
		return keySpec{o + 75, dimTrace, rulePresent, 0.8}
	case "scratchpad", "chainofthought":
		return keySpec{o + 76, dimTrace, rulePresent, 0.8}
	case "runid":
		return keySpec{o + 77, dimTrace, rulePresent, 0.5}
	case "callbacks":
		return keySpec{o + 78, dimTrace, rulePresent, 0.5}
	case "traceid":
		return keySpec{o + 79, dimTrace, rulePresent, 0.3}
	case "spanid":
		return keySpec{o + 80, dimTrace, rulePresent, 0.2}
	}
	return keySpec{}
}

// agentMode reports whether a normalised mode value names a batch or
// auto-chain kind ("batch_process" arrives as "batchprocess"); "dark",
// "light", "auto" (a theme), "loop" (a player) and the like do not.
func agentMode(v []byte) bool {
	switch string(v) {
	case "chain", "chained", "agent", "react", "swarm", "crew":
		return true
	}
	for _, p := range [...]string{"batch", "bulk", "autochain", "autonomous", "autopilot", "autorun", "agentic",
		"multiagent", "pipeline", "headless", "noninteractive", "unattended"} {
		if bytes.HasPrefix(v, []byte(p)) {
			return true
		}
	}
	return false
}

// llmModel reports whether a normalised model name names an LLM family.
func llmModel(v []byte) bool {
	for _, f := range [...]string{"gpt", "claude", "llama", "mistral", "mixtral", "gemini", "gemma", "qwen", "deepseek", "phi3", "phi4", "command", "sonnet", "opus", "haiku"} {
		if bytes.Contains(v, []byte(f)) {
			return true
		}
	}
	return false
}

// contribution computes what one key's value adds to its dimension, already
// scaled by the key's strength. It also captures the tool call id.
func (s *scanner) contribution(k keySpec, parent uint8, v value) float64 {
	var c float64
	switch k.rule {
	case ruleDepth:
		if v.isNum {
			c = (v.num - 1) / 2
		} else if v.kind == vTrue {
			c = 0.5
		}
	case ruleTrue:
		if v.kind == vTrue {
			c = 1
		}
	case ruleFalse:
		if v.kind == vFalse {
			c = 1
		}
	case ruleAgentMode:
		if v.kind == vString {
			var buf [normCap]byte
			if n, ok := normalize(v.raw, &buf); ok && agentMode(buf[:n]) {
				c = 1
			}
		}
	case ruleContext:
		if v.isNum && v.num > 4096 {
			c = math.Log2(v.num/4096) / 3
		}
	case rulePresent:
		if v.present() {
			c = 1
		}
	case ruleToolID:
		if v.kind == vString && len(v.raw) > 0 {
			s.captureToolID(v)
			c = 1
		}
	case ruleList:
		if (v.kind == vArray || v.kind == vObject) && !v.empty {
			c = 1
		}
	case ruleFunction:
		switch {
		case parent == kToolCalls && v.present():
			c = 1
		case v.kind == vObject && !v.empty:
			c = 0.6
		case v.kind == vString && len(v.raw) > 0:
			c = 0.2
		}
	case ruleNestedID:
		// An "id" means nothing by itself; inside tool_calls it is the
		// tool call's identity, which the queue serialises on.
		if parent == kToolCalls && v.kind == vString && len(v.raw) > 0 {
			s.captureToolID(v)
		}
	case ruleTemperature:
		if v.isNum && v.num >= 0 && v.num <= 2 {
			c = 1
		}
	case ruleUnit:
		if v.isNum && v.num >= 0 && v.num <= 1 {
			c = 1
		}
	case rulePositive:
		if v.isNum && v.num > 0 {
			c = 1
		}
	case ruleNumber:
		if v.isNum {
			c = 1
		}
	case ruleConfidence:
		if v.isNum && v.num >= 0 && v.num <= 1 {
			c = 0.3
			if parent == kMetadata {
				c = 1
			}
		}
	case ruleModelName:
		if v.kind == vString {
			// A car's "model": "Corolla" must not count; only LLM names do.
			var buf [normCap]byte
			n, _ := normalize(v.raw, &buf)
			if llmModel(buf[:n]) {
				c = 1
			}
		}
	}
	return clamp01(c) * k.w
}
