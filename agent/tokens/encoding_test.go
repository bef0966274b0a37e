package tokens

import (
	"errors"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

// TestPublishedTokenIDs compares the encoders with token ids printed by
// OpenAI's tiktoken (Rust core) in the cookbook "How to count tokens with
// tiktoken" and tiktoken's README.
func TestPublishedTokenIDs(t *testing.T) {
	tests := []struct {
		enc  *encoding
		text string
		ids  []int
	}{
		{o200k, "tiktoken is great!", []int{83, 8251, 2488, 382, 2212, 0}},
		{cl100k, "tiktoken is great!", []int{83, 1609, 5963, 374, 2294, 0}},
		{o200k, "antidisestablishmentarianism", []int{493, 129901, 376, 160388, 21203, 2367}},
		{cl100k, "antidisestablishmentarianism", []int{519, 85342, 34500, 479, 8997, 2191}},
		{o200k, "2 + 2 = 4", []int{17, 659, 220, 17, 314, 220, 19}},
		{cl100k, "2 + 2 = 4", []int{17, 489, 220, 17, 284, 220, 19}},
		{o200k, "お誕生日おめでとう", []int{8930, 9697, 243, 128225, 8930, 17693, 4344, 48669}},
		{cl100k, "お誕生日おめでとう", []int{33334, 45918, 243, 21990, 9080, 33334, 62004, 16556, 78699}},
	}
	for _, tt := range tests {
		tk, err := tt.enc.load()
		if err != nil {
			t.Fatal(err)
		}
		if got := tk.EncodeOrdinary(tt.text); !slices.Equal(got, tt.ids) {
			t.Errorf("%s(%q) = %v, want %v", tt.enc.name, tt.text, got, tt.ids)
		}
	}
}

// TestPatternsMatchLibrary checks the patterns copied here against
// tiktoken-go's own encodings on every text in testdata. It sets
// tiktoken-go's package-level loader, which the package itself never does;
// in this test binary nothing else uses tiktoken-go.
func TestPatternsMatchLibrary(t *testing.T) {
	tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
	for _, e := range []*encoding{o200k, cl100k} {
		lib, err := tiktoken.GetEncoding(e.name)
		if err != nil {
			t.Fatal(err)
		}
		ours, err := e.load()
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range loadRecords(t) {
			for _, s := range r.texts() {
				if a, b := ours.EncodeOrdinary(s), lib.EncodeOrdinary(s); !slices.Equal(a, b) {
					t.Errorf("%s on %s: %d tokens here, %d from tiktoken-go", e.name, r.ID, len(a), len(b))
				}
			}
		}
	}
}

// failingTransport fails the test on any HTTP request.
type failingTransport struct{ t *testing.T }

func (f failingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	f.t.Errorf("unexpected HTTP request to %s", r.URL)
	return nil, errors.New("no network in this test")
}

// TestLoadsOffline builds both encoders from scratch with every HTTP request
// failing the test and no tiktoken cache directory, proving the ranks come
// from the binary.
func TestLoadsOffline(t *testing.T) {
	old := http.DefaultTransport
	http.DefaultTransport = failingTransport{t}
	t.Cleanup(func() { http.DefaultTransport = old })
	t.Setenv("TIKTOKEN_CACHE_DIR", t.TempDir())
	t.Setenv("DATA_GYM_CACHE_DIR", t.TempDir())
	for _, src := range []*encoding{o200k, cl100k} {
		fresh := &encoding{name: src.name, file: src.file, pattern: src.pattern}
		tk, err := fresh.load()
		if err != nil {
			t.Fatalf("%s: %v", src.name, err)
		}
		if n := len(tk.EncodeOrdinary("hello world")); n != 2 {
			t.Errorf("%s: hello world = %d tokens, want 2", src.name, n)
		}
	}
}

func TestLoadFailureIsReported(t *testing.T) {
	bad := &encoding{name: "nope", file: "nope.tiktoken", pattern: `\s+`}
	if _, err := bad.load(); err == nil {
		t.Fatal("loading a missing asset must fail")
	}
}

// Counting long texts at once leaves nothing of them behind. tiktoken-go's
// regexp2 pre-tokenizer caches one matcher per match ever run at the same
// time, each holding the runes of the last text it matched (4 bytes a
// character): a burst of N prompts of a MiB held N × 4 MiB for as long as
// the process ran (1,000 streams of a 32 KiB prompt through the model
// endpoint held 26 MB). Long texts are counted at most GOMAXPROCS at a
// time, and each count leaves its matcher on an empty text.
func TestConcurrentLongCountsHoldNoText(t *testing.T) {
	c := ForModel("gpt-4o")
	const n, size = 64, 64 << 10
	texts := make([]string, n)
	for i := range texts {
		texts[i] = strings.Repeat(prompt4K[:4000]+" ", size/4001) + strings.Repeat("z", i) // each new: the memo cannot answer
	}
	runtime.GC()
	var m0 runtime.MemStats
	runtime.ReadMemStats(&m0)
	var wg sync.WaitGroup
	for _, text := range texts {
		wg.Go(func() { c.Count(text) })
	}
	wg.Wait()
	runtime.GC()
	var m1 runtime.MemStats
	runtime.ReadMemStats(&m1)
	if held := int64(m1.HeapInuse) - int64(m0.HeapInuse); held > 2*size*4 {
		t.Fatalf("%d concurrent counts of %d-byte texts left %d bytes held", n, size, held)
	}
}
