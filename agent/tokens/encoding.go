package tokens

import (
	"fmt"
	"hash/maphash"
	"runtime"
	"strings"
	"sync"

	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

// Encoding names, as tiktoken spells them; Bound names the conservative
// estimate used when a model's tokenizer is not known.
const (
	O200kBase  = "o200k_base"
	Cl100kBase = "cl100k_base"
	Bound      = "bound"
)

// encoding is one BPE vocabulary, built from the ranks that
// tiktoken-go-loader embeds in the binary. It is loaded on first use and
// then shared: the tables take tens of megabytes and a fraction of a second
// to build, so one copy per process serves every Counter.
//
// The encoders are built here from tiktoken-go's exported constructors
// rather than through tiktoken.GetEncoding. GetEncoding reads ranks through
// a package-level loader whose default downloads them over HTTP (and caches
// them in a temporary directory); replacing it with tiktoken.SetBpeLoader
// would change that behaviour for every other user of tiktoken-go in the
// process, and is an unsynchronised write that races with any of them. This
// way nothing here can reach the network, and no global of another package
// is touched. The patterns are tiktoken's own (tiktoken-go v0.1.8
// encoding.go, from openai/tiktoken's openai_public.py); a test checks that
// they give the token ids tiktoken publishes.
type encoding struct {
	name    string
	file    string // asset name inside tiktoken-go-loader
	pattern string

	once sync.Once
	tk   *tiktoken.Tiktoken
	err  error

	// memo remembers the counts of long texts, short those of short ones
	// (under memoLongBytes), each bounded on its own so that a flood of
	// short texts cannot push the long ones out. An agent run re-sends
	// every earlier message with each model call, and counting costs about
	// a millisecond of CPU per 4 KiB (tiktoken-go's regexp2 pre-tokenizer)
	// and some 8 µs even for a word (the runner's set-up: a role, a
	// one-line question), against tens of nanoseconds to hash and look up;
	// so each text is counted once. Keys are 64-bit hashes, not the texts,
	// so the memo holds no prompt text; a full one is emptied.
	mu    sync.Mutex
	seed  maphash.Seed
	memo  map[uint64]int64
	short map[uint64]int64
	// slots bounds the long texts counted at once (countLong).
	slots chan struct{}
}

// Memo limits: texts of memoLongBytes or more go to the long memo; each
// memo holds at most memoEntries counts.
const (
	memoLongBytes = 256
	memoEntries   = 4096
)

var (
	o200k = &encoding{
		name: O200kBase,
		file: "o200k_base.tiktoken",
		pattern: strings.Join([]string{
			`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
			`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
			`\p{N}{1,3}`,
			` ?[^\s\p{L}\p{N}]+[\r\n/]*`,
			`\s*[\r\n]+`,
			`\s+(?!\S)`,
			`\s+`,
		}, "|"),
	}
	cl100k = &encoding{
		name:    Cl100kBase,
		file:    "cl100k_base.tiktoken",
		pattern: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
	}
)

// load returns the encoder, building it on the first call.
func (e *encoding) load() (*tiktoken.Tiktoken, error) {
	e.once.Do(func() {
		ranks, err := tiktoken_loader.NewOfflineLoader().LoadTiktokenBpe(e.file)
		if err != nil {
			e.err = fmt.Errorf("tokens: load %s: %w", e.name, err)
			return
		}
		// Special tokens are left out: counting uses EncodeOrdinary, which
		// treats text such as "<|endoftext|>" in a prompt as plain text, as
		// the provider does with message content.
		bpe, err := tiktoken.NewCoreBPE(ranks, map[string]int{}, e.pattern)
		if err != nil {
			e.err = fmt.Errorf("tokens: build %s: %w", e.name, err)
			return
		}
		enc := &tiktoken.Encoding{Name: e.name, PatStr: e.pattern, MergeableRanks: ranks, SpecialTokens: map[string]int{}}
		e.tk = tiktoken.NewTiktoken(bpe, enc, map[string]any{})
		e.seed = maphash.MakeSeed()
		e.memo = make(map[uint64]int64)
		e.short = make(map[uint64]int64)
		e.slots = make(chan struct{}, runtime.GOMAXPROCS(0))
	})
	return e.tk, e.err
}

// countLong counts a long text the memo did not know. tiktoken-go's
// regexp2 pre-tokenizer caches a matcher for every match ever run at the
// same time and never empties one: each keeps the runes of the last text
// it matched (4 bytes a character), so a burst of N long prompts counted at
// once would hold N × 4 × their size for the process's life. Long texts
// are counted at most GOMAXPROCS at a time (counting is CPU work: more at
// once is not faster), and each count leaves the matcher it used, the last
// one put back and the next one taken, on an empty text.
//
// A text that waited for a slot is looked up again: the same conversation
// sent by parallel calls is counted once, not once per call.
func (e *encoding) countLong(key uint64, text string) int64 {
	e.slots <- struct{}{}
	defer func() { <-e.slots }()
	e.mu.Lock()
	n, ok := e.memo[key]
	e.mu.Unlock()
	if ok {
		return n
	}
	n = int64(len(e.tk.EncodeOrdinary(text)))
	e.tk.EncodeOrdinary("")
	return n
}

// count returns the tokens of text; the encoding must be loaded.
func (e *encoding) count(text string) int64 {
	key := maphash.String(e.seed, text)
	e.mu.Lock()
	memo := e.memo
	if len(text) < memoLongBytes {
		memo = e.short
	}
	n, ok := memo[key]
	e.mu.Unlock()
	if ok {
		return n
	}
	if len(text) < memoLongBytes {
		n = int64(len(e.tk.EncodeOrdinary(text)))
	} else {
		n = e.countLong(key, text)
	}
	e.mu.Lock()
	if len(memo) >= memoEntries {
		clear(memo)
	}
	memo[key] = n
	e.mu.Unlock()
	return n
}
