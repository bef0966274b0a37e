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
	ruleDepth            // hop/depth/iteration count: 1 is ordinary, 3 or more is recursion
	ruleTrue             // a boolean flag that signals when true
	ruleFalse            // a flag that signals when false or "never" (interactive: false)
	ruleAny              // any boolean or number, false and 0 included: the key itself is the signal
	ruleAgentMode        // a mode string naming a batch/auto-chain/agent kind
	ruleContext          // a context size against the 4096 default
	rulePresent          // any non-empty value
	ruleObject           // a non-empty object or array
	ruleText             // a non-empty string or array (not an object: a bird sighting's observation)
	ruleToolID           // a tool call id string (also captured for serialisation)
	ruleCallID           // call_id: a tool call id when it looks like one ("call_…", "toolu_…")
	ruleFunction         // "function": strongest inside tool_calls
	ruleNestedID         // "id": a tool call id inside tool_calls or when it looks like one
	ruleTemperature      // a number in the LLM range [0,2] (not a thermostat)
	ruleUnit             // a number in [0,1]
	rulePositive         // a number above 0
	ruleNumber           // any number
	ruleConfidence       // a number in [0,1], strongest under metadata
	ruleModelName        // a string naming an LLM family or provider
	ruleLLM              // an LLM setting: an LLM name in full, any other value in part
	ruleChunkSize        // a text chunk size (an upload's 5 MiB chunk is not one)
	ruleType             // "type": tool-use block and event kinds
	ruleRole             // "role": a tool or function message
	ruleMethod           // "method": an MCP JSON-RPC method
	ruleObjectKind       // "object": an LLM API object kind (chat.completion, thread.run)
	ruleRunType          // "run_type": a LangChain run kind
	ruleNever            // a human-input mode of "never"
)

// keySpec describes a key the scanner knows; id 0 means an unknown key.
type keySpec struct {
	id   uint8   // distinct per key (synonyms share one): a key counts once per body
	dim  uint8   // the dimension it feeds (value rules may redirect)
	rule rule    // how its value becomes a contribution
	w    float64 // the key's strength within its dimension
}

// Key ids. The ones referenced as parents, and the ids value rules
// contribute under, are named; the rest are numbered in vocabulary order.
const (
	kNone uint8 = iota
	kMetadata
	kToolCalls
	kFunction
	kID
	kTypeTool     // type: tool_use, function_call, …
	kTypeBuiltin  // type: web_search, code_interpreter, computer_…
	kTypeAgentMsg // type: AutoGen TextMessage/HandoffMessage, LangChain human/ai
	kIDCall       // id: "call_…", "toolu_…"
	kIDLLM        // id: "chatcmpl-…", "asst_…", "resp_…"
	kTools        // tools: a list of tool definitions
	kFirstOther   // ids from here on are assigned in vocabulary order
)

// keyGroup is one line of the vocabulary: synonyms that count as one key
// (a key counts once per body), the dimension they feed, how their value
// becomes a contribution, and their strength within the dimension: 1 for
// keys only agent frameworks send, lower for keys ordinary APIs share; the
// fitted weights then scale whole dimensions.
type keyGroup struct {
	names string // normalised names (lower case, no '_', '-', '.' or spaces), space-separated
	id    uint8  // a named id (kToolCalls…) or 0: numbered in order from kFirstOther
	dim   uint8
	rule  rule
	w     float64
}

// vocabulary is every key the scanner knows. lookupKey, in keys_gen.go, is
// generated from it: a switch on the normalised key, which Go compiles to a
// search by length and content; it beat an open-addressing hash table of
// the same names by 2.5x per lookup in one benchmark run, and needs no
// table built at start. Measured again in issue 20's third round, in the
// whole scan on the benchmark bodies: a switch on length, first and last
// byte ending in a few word compares was no faster (1.00x), and a perfect
// hash on the key's words was 1.4x slower at 1 KiB (the words of a key
// just normalised byte by byte wait on those stores).
//
//go:generate go test -run ^TestKeysGenerated$ -update-keys
var vocabulary = [...]keyGroup{
	// recursion: loop, hop, iteration and turn bounds
	{"recursiondepth recursionlimit maxrecursion maxrecursiondepth chaindepth maxchaindepth", 0, dimRecursion, ruleDepth, 1},
	{"maxhops maxloops", 0, dimRecursion, ruleDepth, 1},
	{"maxiterations maxiter maxiters", 0, dimRecursion, ruleDepth, 1},
	{"maxturns maxround maxrounds maxconsecutiveautoreply", 0, dimRecursion, ruleDepth, 1},
	{"maxdiscoverydepth maxcrawldepth", 0, dimRecursion, ruleDepth, 1},
	{"maxactionsperstep maxstepsperrun maxtoolcalls", 0, dimRecursion, ruleDepth, 1},
	{"maxsteps hops", 0, dimRecursion, ruleDepth, 0.6},
	// A dive log and a tree model have a max_depth too.
	{"maxdepth", 0, dimRecursion, ruleDepth, 0.5},
	// Ordinary tree, filter and chess-engine APIs use "depth"; it only hints.
	{"depth", 0, dimRecursion, ruleDepth, 0.3},
	{"recursive", 0, dimRecursion, ruleTrue, 0.5},

	// non-interactive: batch, autonomous, crawler and headless runs
	{"mode runmode executionmode agentmode agenttype agent process strategy", 0, dimNonInteractive, ruleAgentMode, 1},
	{"interactive humanintheloop", 0, dimNonInteractive, ruleFalse, 1},
	{"noninteractive unattended autonomous autoapprove autorun autoconfirm", 0, dimNonInteractive, ruleTrue, 1},
	{"requireapproval", 0, dimNonInteractive, ruleFalse, 0.8},
	{"humaninputmode", 0, dimNonInteractive, ruleNever, 1},
	// A headless CMS and a CI browser run are headless too.
	{"headless", 0, dimNonInteractive, ruleTrue, 0.6},
	{"completionwindow", 0, dimNonInteractive, rulePresent, 1},
	{"inputfileid", 0, dimNonInteractive, rulePresent, 0.6},
	{"customid", 0, dimNonInteractive, rulePresent, 0.5},
	{"starturls", 0, dimNonInteractive, ruleObject, 1},
	{"maxcrawlpages maxrequestspercrawl maxpagespercrawl", 0, dimNonInteractive, rulePositive, 1},
	{"maxconcurrency", 0, dimNonInteractive, rulePositive, 0.6},
	{"onlymaincontent usevision enablewebsearch domsettletimeoutms", 0, dimNonInteractive, ruleAny, 0.8},
	{"scrapeoptions crawlerconfig browserconfig crawleroptions jsonoptions crawlconfig", 0, dimNonInteractive, rulePresent, 0.8},
	{"allowexternallinks allowbackwardlinks ignoresitemap ignoreinvalidurls", 0, dimNonInteractive, ruleAny, 0.6},
	{"proxyconfiguration proxylocation", 0, dimNonInteractive, rulePresent, 0.6},
	{"displaywidthpx displayheightpx displaynumber", 0, dimNonInteractive, ruleNumber, 0.6},
	{"asyncexecution", 0, dimNonInteractive, ruleAny, 0.6},

	// context inflation
	{"contextwindow contextlength contextsize maxcontext maxcontextlength maxcontexttokens numctx nctx ctxsize maxprompttokens maxinputtokens", 0, dimContext, ruleContext, 1},
	{"truncationstrategy", 0, dimContext, rulePresent, 0.8},

	// chunking and retrieval set-up
	{"chunksize chunktokens chunklength", 0, dimChunking, ruleChunkSize, 1},
	{"chunkoverlap", 0, dimChunking, ruleAny, 1},
	{"chunkstrategy chunkingstrategy chunking", 0, dimChunking, rulePresent, 1},
	{"textsplitter nodeparser splitter", 0, dimChunking, rulePresent, 1},
	{"embeddingmodel embedmodel embeddings", 0, dimChunking, rulePresent, 0.6},
	{"similaritytopk fetchk searchkwargs", 0, dimChunking, rulePresent, 0.6},
	{"similaritythreshold", 0, dimChunking, ruleNumber, 0.4},

	// retry and rate policy
	{"retrystrategy retrypolicy", 0, dimRetry, rulePresent, 1},
	{"maxretries", 0, dimRetry, rulePresent, 1},
	// CI runners, job queues and payment retries say this too.
	{"retries retry", 0, dimRetry, rulePresent, 0.5},
	{"maxattempts maxrequestretries", 0, dimRetry, rulePresent, 0.8},
	{"backoff backofffactor backoffstrategy retrybackoff exponentialbackoff", 0, dimRetry, rulePresent, 0.6},
	{"retrydelay retryon", 0, dimRetry, rulePresent, 0.6},
	{"maxfailures", 0, dimRetry, rulePositive, 0.8},

	// tool-call identity and tool definitions
	{"toolcallid tooluseid", 0, dimToolCall, ruleToolID, 1},
	{"callid", 0, dimToolCall, ruleCallID, 1},
	{"toolcalls", kToolCalls, dimToolCall, ruleObject, 1},
	{"functioncall toolcall", 0, dimToolCall, rulePresent, 1},
	{"function", kFunction, dimToolCall, ruleFunction, 1},
	{"functions", 0, dimToolCall, ruleObject, 0.5},
	{"toolchoice", 0, dimToolCall, rulePresent, 0.8},
	{"paralleltoolcalls", 0, dimToolCall, ruleAny, 0.8},
	{"toolname", 0, dimToolCall, rulePresent, 0.5},
	// A hardware shop sends "tools" too; alone it stays a hint.
	{"tools", kTools, dimToolCall, ruleObject, 0.25},
	{"tooloutputs requiredaction submittooloutputs", 0, dimToolCall, rulePresent, 1},
	{"toolresources inputschema toolinput", 0, dimToolCall, rulePresent, 0.8},
	{"arguments", 0, dimToolCall, rulePresent, 0.4},
	{"serverlabel", 0, dimToolCall, rulePresent, 0.6},
	{"protocolversion", 0, dimToolCall, rulePresent, 0.5},
	{"method", 0, dimToolCall, ruleMethod, 1},
	{"type", kTypeTool, dimToolCall, ruleType, 1},
	{"role", 0, dimToolCall, ruleRole, 1},
	{"id", kID, dimToolCall, ruleNestedID, 1},

	// model metadata and LLM settings
	{"metadata", kMetadata, dimMetadata, ruleNone, 0},
	{"confidence confidencescore", 0, dimMetadata, ruleConfidence, 1},
	{"metadataconfidence", 0, dimMetadata, ruleUnit, 1},
	{"systemfingerprint", 0, dimMetadata, rulePresent, 1},
	{"logprobs toplogprobs", 0, dimMetadata, rulePresent, 0.8},
	{"finishreason stopreason", 0, dimMetadata, rulePresent, 0.8},
	{"prompttokens completiontokens totaltokens inputtokens outputtokens", 0, dimMetadata, rulePositive, 0.7},
	{"modelsusage tokenusage usagemetadata", 0, dimMetadata, rulePresent, 1},
	// A person in an LLM playground names a model too: a weak signal.
	{"model modelname modelid", 0, dimMetadata, ruleModelName, 0.4},
	{"llm managerllm functioncallingllm chatmodel llmmodel", 0, dimMetadata, ruleLLM, 1},
	{"provider", 0, dimMetadata, ruleModelName, 0.6},
	{"modelclient llmconfig configlist modelpreferences modelsettings modelkwargs", 0, dimMetadata, rulePresent, 1},
	{"object", 0, dimMetadata, ruleObjectKind, 0.8},

	// LLM sampling parameters
	{"temperature", 0, dimSampling, ruleTemperature, 0.5},
	{"topp typicalp minp", 0, dimSampling, ruleUnit, 0.5},
	{"topk", 0, dimSampling, rulePositive, 0.4},
	{"maxtokens maxnewtokens maxcompletiontokens maxoutputtokens", 0, dimSampling, rulePositive, 0.5},
	{"frequencypenalty presencepenalty", 0, dimSampling, ruleNumber, 0.5},
	{"repetitionpenalty repeatpenalty", 0, dimSampling, ruleNumber, 0.5},
	{"logitbias stopsequences", 0, dimSampling, rulePresent, 0.5},
	{"responseformat", 0, dimSampling, rulePresent, 0.6},
	{"reasoningeffort budgettokens", 0, dimSampling, rulePresent, 0.8},
	{"reasoning thinking", 0, dimSampling, ruleObject, 0.5},
	{"streamoptions", 0, dimSampling, rulePresent, 0.6},

	// agent framework traces and agent definitions
	{"intermediatesteps agentscratchpad", 0, dimTrace, rulePresent, 1},
	// A journal entry has a thought too: alone it only hints.
	{"thought thoughts", 0, dimTrace, ruleText, 0.6},
	{"observation observations", 0, dimTrace, ruleText, 0.6},
	// GitHub's "action": "opened" is a string; an agent's action is an
	// object or a list of them.
	{"action actions", 0, dimTrace, ruleObject, 0.5},
	{"actioninput", 0, dimTrace, rulePresent, 0.8},
	{"parentrunid", 0, dimTrace, rulePresent, 0.8},
	{"scratchpad chainofthought", 0, dimTrace, rulePresent, 0.8},
	{"runid", 0, dimTrace, rulePresent, 0.5},
	{"callbacks", 0, dimTrace, rulePresent, 0.5},
	{"traceid", 0, dimTrace, rulePresent, 0.3},
	{"spanid", 0, dimTrace, rulePresent, 0.2},
	{"runname dottedorder", 0, dimTrace, rulePresent, 0.8},
	{"runtype", 0, dimTrace, ruleRunType, 1},
	{"configurable checkpointid checkpointns", 0, dimTrace, ruleAny, 0.8},
	{"streammode interruptbefore interruptafter", 0, dimTrace, rulePresent, 0.6},
	{"assistantid", 0, dimTrace, rulePresent, 0.8},
	// Forums and support desks have threads too.
	{"threadid", 0, dimTrace, rulePresent, 0.3},
	{"additionalinstructions systemprompt", 0, dimTrace, rulePresent, 0.6},
	{"stepdetails previousresponseid", 0, dimTrace, rulePresent, 1},
	// CrewAI's agent and kickoff settings.
	{"maxrpm crew", 0, dimTrace, ruleAny, 0.8},
	{"backstory allowdelegation", 0, dimTrace, ruleAny, 1},
	{"expectedoutput crewoutput tasksoutput", 0, dimTrace, rulePresent, 0.8},
	{"currentstate modeloutput", 0, dimTrace, ruleObject, 0.6},
	{"nextgoal evaluationpreviousgoal navigationgoal dataextractiongoal", 0, dimTrace, rulePresent, 1},
	{"terminationcondition speakerselectionmethod allowrepeatspeaker", 0, dimTrace, ruleAny, 0.8},
	{"finalanswer", 0, dimTrace, rulePresent, 0.6},
	{"paststeps handleparsingerrors earlystoppingmethod", 0, dimTrace, ruleAny, 0.8},
	{"returnintermediatesteps", 0, dimTrace, ruleAny, 1},
}

// agentMode reports whether a normalised mode value names a batch,
// auto-chain or agent kind ("batch_process" arrives as "batchprocess");
// "dark", "light", "auto" (a theme), "loop" (a player), "payment" and
// "setup" (a checkout), "analysis" (a chess board) and the like do not.
func agentMode(v []byte) bool {
	switch string(v) {
	case "chain", "chained", "agent", "react", "swarm", "crew", "reflexion", "hierarchical":
		return true
	}
	if len(v) == 0 {
		return false
	}
	// Prefixes, by first letter: this runs for every "mode" a body has.
	var prefixes []string
	switch v[0] {
	case 'a':
		prefixes = []string{"autochain", "autonomous", "autopilot", "autorun", "agentic"}
	case 'b':
		prefixes = []string{"batch", "bulk"}
	case 'd':
		prefixes = []string{"deep"}
	case 'h':
		prefixes = []string{"headless"}
	case 'm':
		prefixes = []string{"multiagent"}
	case 'n':
		prefixes = []string{"noninteractive"}
	case 'o':
		prefixes = []string{"openaitools", "openaifunctions"}
	case 'p':
		prefixes = []string{"pipeline", "planandexecute"}
	case 'r':
		prefixes = []string{"reactdocstore"}
	case 's':
		prefixes = []string{"structuredchat", "selfask"}
	case 't':
		prefixes = []string{"toolcalling"}
	case 'u':
		prefixes = []string{"unattended"}
	case 'z':
		prefixes = []string{"zeroshot"}
	}
	for _, p := range prefixes {
		if bytes.HasPrefix(v, []byte(p)) {
			return true
		}
	}
	return false
}

// llmModel reports whether a normalised model or provider name names an
// LLM family or LLM provider anywhere in it ("us.anthropic.claude-3…",
// "meta-llama/Llama-3…"). It looks for a family only where one could
// start, by the letter it starts with: this runs for every "model" a body
// has, so it avoids a substring search per family.
func llmModel(v []byte) bool {
	// OpenAI's reasoning models: o1, o3-mini, o4-mini…
	if len(v) >= 2 && v[0] == 'o' && (v[1] == '1' || v[1] == '3' || v[1] == '4') && (len(v) == 2 || !isDigit(v[2])) {
		return true
	}
	for i := range v {
		var families []string
		switch v[i] {
		case 'a':
			families = []string{"anthropic", "autogen"}
		case 'c':
			families = []string{"claude", "commandr"}
		case 'd':
			families = []string{"deepseek", "davinci"}
		case 'g':
			families = []string{"gpt", "gemini", "gemma", "grok"}
		case 'h':
			families = []string{"haiku"}
		case 'l':
			families = []string{"llama", "langchain"}
		case 'm':
			families = []string{"mistral", "mixtral"}
		case 'o':
			families = []string{"openai", "ollama", "opus"}
		case 'p':
			families = []string{"phi3", "phi4"}
		case 'q':
			families = []string{"qwen"}
		case 's':
			families = []string{"sonnet"}
		default:
			continue
		}
		for _, f := range families {
			if bytes.HasPrefix(v[i:], []byte(f)) {
				return true
			}
		}
	}
	return false
}

// typeKind classifies a normalised "type" value: tool-use blocks and
// events, built-in tools, agent-framework message kinds. Stripe's
// "payment_intent.succeeded" or Slack's "event_callback" are none of them.
func typeKind(v []byte) (id, dim uint8, c float64) {
	switch string(v) {
	case "tooluse", "toolresult", "functioncall", "functioncalloutput", "toolcall", "toolcalls",
		"servertooluse", "mcpcall", "mcptoolcall", "computercall", "computercalloutput",
		"toolcallrequestevent", "toolcallexecutionevent", "toolcallsummarymessage", "submittooloutputs":
		return kTypeTool, dimToolCall, 1
	case "websearch", "websearchpreview", "filesearch", "codeinterpreter", "mcp", "computerusepreview",
		"computerscreenshot":
		return kTypeBuiltin, dimToolCall, 0.6
	case "handoffmessage", "textmessage", "stopmessage", "human", "ai":
		return kTypeAgentMsg, dimTrace, 0.4
	}
	if len(v) == 0 || !isDigit(v[len(v)-1]) {
		return 0, 0, 0
	}
	// Versioned Anthropic tools: computer_20250124, bash_20250124,
	// text_editor_20250124, web_search_20250305.
	for _, p := range [...]string{"computer", "bash", "texteditor", "websearch"} {
		if len(v) > len(p) && bytes.HasPrefix(v, []byte(p)) && isDigit(v[len(p)]) {
			return kTypeBuiltin, dimToolCall, 0.6
		}
	}
	return 0, 0, 0
}

// mcpMethod rates a JSON-RPC method name: MCP's tool calls fully, its other
// methods nearly; eth_getBalance or "subtract" not at all.
func mcpMethod(v []byte) float64 {
	if bytes.HasPrefix(v, []byte("tools/")) {
		return 1
	}
	if string(v) == "initialize" {
		return 0.8
	}
	for _, p := range [...]string{"resources/", "prompts/", "notifications/", "sampling/", "completion/",
		"logging/", "roots/", "elicitation/"} {
		if bytes.HasPrefix(v, []byte(p)) {
			return 0.8
		}
	}
	return 0
}

// objectKind rates an "object" value naming an LLM API object.
func objectKind(v []byte) float64 {
	switch {
	case bytes.HasPrefix(v, []byte("chatcompletion")), bytes.HasPrefix(v, []byte("thread")),
		bytes.HasPrefix(v, []byte("assistant")), string(v) == "response", string(v) == "textcompletion":
		return 1
	}
	return 0
}

// idKind classifies an "id" value by the prefixes LLM APIs give their
// objects: call_ and toolu_ (tool calls), chatcmpl-, asst_, resp_.
func idKind(raw []byte) (id, dim uint8, c float64) {
	switch {
	case bytes.HasPrefix(raw, []byte("call_")), bytes.HasPrefix(raw, []byte("toolu_")), bytes.HasPrefix(raw, []byte("fc_")):
		return kIDCall, dimToolCall, 0.8
	case bytes.HasPrefix(raw, []byte("chatcmpl-")), bytes.HasPrefix(raw, []byte("asst_")), bytes.HasPrefix(raw, []byte("resp_")):
		return kIDLLM, dimMetadata, 0.8
	}
	return 0, 0, 0
}

// toolIDLike reports whether a raw id looks like an LLM tool call id.
func toolIDLike(raw []byte) bool {
	return bytes.HasPrefix(raw, []byte("call_")) || bytes.HasPrefix(raw, []byte("toolu_"))
}

// settled reports whether key k can add nothing more to this body: it has
// counted already, or its dimension is full, and, for the rules whose value
// picks the key id they count under or captures the tool call id, nothing
// is left to pick or capture. Keys repeated in every message of a history
// then cost a lookup and nothing else.
func (s *scanner) settled(k keySpec) bool {
	switch k.rule {
	case ruleType:
		tool := s.full(dimToolCall) || s.seenID(kTypeTool) && s.seenID(kTypeBuiltin)
		return tool && (s.full(dimTrace) || s.seenID(kTypeAgentMsg))
	case ruleNestedID:
		return s.out.toolLen > 0 && (s.full(dimToolCall) || s.seenID(kIDCall)) &&
			(s.full(dimMetadata) || s.seenID(kIDLLM))
	case ruleToolID, ruleCallID:
		return s.out.toolLen > 0 && (s.full(k.dim) || s.seenID(k.id))
	}
	return s.full(k.dim) || s.seenID(k.id)
}

// full reports whether dimension dim is already at 1, where nothing can
// raise it further (a noisy-OR with a contribution of 1 may round to just
// below 1).
func (s *scanner) full(dim uint8) bool { return s.out.vec[dim] >= 1-1e-9 }

// seenID reports whether key id has counted in this body.
func (s *scanner) seenID(id uint8) bool {
	return s.seen[id/64]&(uint64(1)<<(id%64)) != 0
}

// normValue normalises a string value as keys are (lower case, no '_',
// '-', '.' or spaces), into buf unless it already is ("assistant",
// "function": most values a rule reads).
func normValue(v value, buf *[normCap]byte) []byte {
	if plainKey(v.raw) {
		return v.raw
	}
	n, _ := normalize(v.raw, buf)
	return buf[:n]
}

// contribution computes what one key's value adds, already scaled by the
// key's strength, and under which key id and dimension it counts (value
// rules may redirect). It also captures the tool call id.
func (s *scanner) contribution(k keySpec, parent uint8, v *value) (c float64, id, dim uint8) {
	id, dim = k.id, k.dim
	switch k.rule {
	case ruleNestedID:
		// An "id" means nothing by itself; inside tool_calls, or shaped
		// like one, it is a tool call's identity, which the queue
		// serialises on.
		if v.kind != vString || len(v.raw) == 0 {
			return 0, id, dim
		}
		if parent == kToolCalls || toolIDLike(v.raw) {
			s.captureToolID(*v)
		}
		id, dim, c = idKind(v.raw)
		return c * k.w, id, dim
	case ruleType:
		if v.kind != vString {
			return 0, id, dim
		}
		switch string(v.raw) {
		case "function", "text", "object", "string", "array", "message", "number", "integer", "boolean":
			// The commonest values by far (JSON Schema types, OpenAI tool
			// definitions, text blocks) name no tool use: settle them
			// before normalising.
			return 0, id, dim
		}
		var buf [normCap]byte
		id, dim, c = typeKind(normValue(*v, &buf))
		return c * k.w, id, dim
	case ruleRole:
		// Here, not in wordRule: every message of a history has a role,
		// and most ("user", "assistant") add nothing, so the key never
		// settles and this runs once a message.
		if v.kind == vString {
			var buf [normCap]byte
			switch string(normValue(*v, &buf)) {
			case "tool", "function":
				c = 1
			}
		}
	case ruleAgentMode, ruleToolID, ruleCallID, ruleFunction, ruleModelName, ruleLLM, ruleMethod, ruleObjectKind, ruleRunType:
		c = s.wordRule(k.rule, parent, v)
	default:
		c = shapeRule(k.rule, parent, v)
	}
	return clamp01(c) * k.w, id, dim
}

// shapeRule is what a value adds under the rules that read its shape: a
// flag, a number in a range, a value present or not (unscaled).
func shapeRule(r rule, parent uint8, v *value) float64 {
	switch r {
	case ruleDepth:
		if v.isNum {
			return (v.num - 1) / 2
		} else if v.kind == vTrue {
			return 0.5
		}
	case ruleTrue:
		return b2f(v.kind == vTrue)
	case ruleFalse:
		var buf [normCap]byte
		return b2f(v.kind == vFalse || v.kind == vString && string(normValue(*v, &buf)) == "never")
	case ruleNever:
		var buf [normCap]byte
		return b2f(v.kind == vString && string(normValue(*v, &buf)) == "never")
	case ruleAny:
		return b2f(v.kind == vTrue || v.kind == vFalse || v.kind == vNumber || v.kind == vString || v.present())
	case ruleContext:
		if v.isNum && v.num > 4096 {
			return math.Log2(v.num/4096) / 3
		}
	case rulePresent:
		return b2f(v.present())
	case ruleObject:
		return b2f((v.kind == vArray || v.kind == vObject) && !v.empty)
	case ruleText:
		return b2f((v.kind == vString && len(v.raw) > 0) || (v.kind == vArray && !v.empty))
	case ruleTemperature:
		return b2f(v.isNum && v.num >= 0 && v.num <= 2)
	case ruleUnit:
		return b2f(v.isNum && v.num >= 0 && v.num <= 1)
	case rulePositive:
		return b2f(v.isNum && v.num > 0)
	case ruleNumber:
		return b2f(v.isNum)
	case ruleConfidence:
		switch {
		case v.isNum && v.num >= 0 && v.num <= 1 && parent == kMetadata:
			return 1
		case v.isNum && v.num >= 0 && v.num <= 1:
			return 0.3
		}
	case ruleChunkSize:
		switch {
		case v.isNum && v.num > 0 && v.num <= 32768:
			return 1
		case v.isNum && v.num > 0:
			// Upload APIs cut files into megabyte chunks.
			return 0.2
		case v.kind == vString && len(v.raw) > 0 && !v.isNum:
			return 1
		}
	}
	return 0
}

// wordRule is what a value adds under the rules that read its words: a
// mode, a model's name, a tool call's id (captured here), an API object's
// kind (unscaled).
func (s *scanner) wordRule(r rule, parent uint8, v *value) float64 {
	var buf [normCap]byte
	switch r {
	case ruleAgentMode:
		return b2f(v.kind == vString && agentMode(normValue(*v, &buf)))
	case ruleToolID:
		if v.kind == vString && len(v.raw) > 0 {
			s.captureToolID(*v)
			return 1
		}
	case ruleCallID:
		// A phone call's call_id is not a tool call; OpenAI's and
		// Anthropic's ids have their own prefixes.
		if v.kind == vString && len(v.raw) > 0 {
			if toolIDLike(v.raw) {
				s.captureToolID(*v)
				return 1
			}
			return 0.4
		}
	case ruleFunction:
		switch {
		case parent == kToolCalls && v.present():
			return 1
		case parent == kTools && v.present():
			// A tool definition: {"type":"function","function":{…}}.
			return 0.8
		case v.kind == vObject && !v.empty:
			// A spreadsheet's function object looks the same.
			return 0.4
		case v.kind == vString && len(v.raw) > 0:
			return 0.2
		}
	case ruleModelName:
		// A car's "model": "Corolla" must not count; only LLM names do.
		return b2f(v.kind == vString && llmModel(normValue(*v, &buf)))
	case ruleLLM:
		switch {
		case v.kind == vString && llmModel(normValue(*v, &buf)):
			return 1
		case v.present():
			return 0.6
		}
	case ruleMethod:
		if v.kind == vString && len(v.raw) < normCap {
			return mcpMethod(v.raw)
		}
	case ruleObjectKind:
		if v.kind == vString {
			return objectKind(normValue(*v, &buf))
		}
	case ruleRunType:
		if v.kind == vString {
			switch string(normValue(*v, &buf)) {
			case "chain", "llm", "tool", "retriever", "agent", "prompt", "parser", "embedding":
				return 1
			}
		}
	}
	return 0
}

// b2f is 1 for true, 0 for false.
func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
