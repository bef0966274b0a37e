package repetition

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// feed streams text in chunks of size bytes (cutting words and UTF-8
// sequences anywhere, as a token stream does) and returns the byte offset
// at which the detector first fired (-1 if never) and the highest ratio seen.
func feed(d *Detector, text []byte, size int) (firedAt int, maxRatio float64) {
	firedAt = -1
	for off := 0; off < len(text); off += size {
		end := min(off+size, len(text))
		if d.Write(text[off:end]) && firedAt < 0 {
			firedAt = end
		}
		maxRatio = math.Max(maxRatio, d.Ratio())
	}
	return firedAt, maxRatio
}

func corpus(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join("testdata", dir, "*"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("no corpus in testdata/%s: %v", dir, err)
	}
	out := map[string][]byte{}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(p)] = b
	}
	return out
}

// TestLoopsFire: real looping model output (the same sentence, JSON item,
// paragraph or word again and again) fires, fed in 7-byte chunks.
func TestLoopsFire(t *testing.T) {
	for name, text := range corpus(t, "loop") {
		t.Run(name, func(t *testing.T) {
			d := New(0, 0, 0)
			at, ratio := feed(d, text, 7)
			if at < 0 {
				t.Fatalf("loop not detected; max ratio %.3f", ratio)
			}
			t.Logf("fired after %d of %d bytes; max ratio %.3f", at, len(text), ratio)
		})
	}
}

// TestNormalTextDoesNotFire: realistic multi-day itineraries, in prose, in
// Markdown and in the JSON answer format, with the same phrasing every day,
// never fire, whatever the chunk size.
func TestNormalTextDoesNotFire(t *testing.T) {
	for name, text := range corpus(t, "normal") {
		for _, size := range []int{1, 7, 64, len(text)} {
			t.Run(fmt.Sprintf("%s/chunk%d", name, size), func(t *testing.T) {
				d := New(0, 0, 0)
				at, ratio := feed(d, text, size)
				if at >= 0 {
					t.Fatalf("false positive at byte %d; ratio %.3f", at, ratio)
				}
				if size == 7 {
					t.Logf("max ratio %.3f (threshold %.1f)", ratio, DefaultThreshold)
				}
			})
		}
	}
}

// TestChunkingDoesNotMatter: the same text split differently yields the
// same ratio, so a word or a multibyte character cut between chunks is
// read as one.
func TestChunkingDoesNotMatter(t *testing.T) {
	texts := map[string]string{
		"ascii": "Morning: walk the old town. Afternoon: museum visit. Evening: dinner by the river.",
		"cjk":   "第一天：抵达北京后，先去天安门广场和故宫。下午可以去景山公园登高。",
		"mixed": "Día 2 — café crème à Montmartre, 寿司 in Tōkyō, naïve façades, ÆØÅ æøå.",
		// A truncated sequence followed by ASCII, and a stray byte: each
		// bad byte must separate words the same way at any split.
		"invalid": "ab\xe6\x88cd ef\xff gh 北京 \xe4\xba",
	}
	for name, text := range texts {
		t.Run(name, func(t *testing.T) {
			// A trailing separator closes the last word in every split.
			b := []byte(text + " ")
			want := New(2, 20, 0.8)
			feed(want, b, len(b))
			for size := 1; size <= 8; size++ {
				d := New(2, 20, 0.8)
				feed(d, b, size)
				if d.Ratio() != want.Ratio() || d.words != want.words {
					t.Fatalf("chunk %d: %d words ratio %v; whole text %d words ratio %v",
						size, d.words, d.Ratio(), want.words, want.Ratio())
				}
			}
		})
	}
}

// TestTokens: how text becomes words.
func TestTokens(t *testing.T) {
	cases := []struct {
		name  string
		text  string
		words int
	}{
		{"punctuation separates", `{"day":1,"title":"Arrival"}`, 4},
		{"case folded, same hash", "Paris paris PARIS ", 3},
		{"each Han character is a word", "北京烤鸭。", 4},
		{"kana too", "ひらがなカタカナ", 8},
		{"accented letters stay in the word", "café crème ", 2},
		{"invalid UTF-8 separates", "ab\xffcd\xe6\x88 ef ", 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := New(1, 100, 0.8)
			d.Write([]byte(c.text + " "))
			if d.words != c.words {
				t.Fatalf("%q: %d words; want %d", c.text, d.words, c.words)
			}
		})
	}
	// Case folding: three spellings of one word are one distinct 1-gram.
	d := New(1, 100, 0.8)
	d.Write([]byte("Paris paris PARIS "))
	if len(d.counts) != 1 {
		t.Fatalf("case variants gave %d distinct words; want 1", len(d.counts))
	}
}

// TestRatio: 1 − distinct/total over the window, with the window sliding.
func TestRatio(t *testing.T) {
	cases := []struct {
		name string
		n    int
		win  int
		text string
		want float64
	}{
		{"all distinct", 1, 10, "a b c d e ", 0},
		{"one word repeated", 1, 10, "a a a a a ", 0.8},
		{"bigrams of a two-word loop", 2, 9, "a b a b a b a b a ", 1 - 2.0/8},
		{"old words slide out", 1, 5, "a a a a a b c d e f ", 0},
		{"empty", 4, 200, "", 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := New(c.n, c.win, 0.99)
			d.Write([]byte(c.text))
			if got := d.Ratio(); math.Abs(got-c.want) > 1e-9 {
				t.Fatalf("ratio = %v; want %v", got, c.want)
			}
		})
	}
}

// TestMinimumWords: a loop shorter than a quarter of the window does not
// fire yet, and fires once it is long enough; the verdict then sticks.
func TestMinimumWords(t *testing.T) {
	d := New(4, 200, 0.8)
	if d.Write([]byte(strings.Repeat("go go ", 20))) { // 40 words, 37 grams < 49
		t.Fatal("fired before the minimum number of words")
	}
	if !d.Write([]byte(strings.Repeat("go go ", 10))) {
		t.Fatalf("did not fire at 60 repeated words; ratio %.3f", d.Ratio())
	}
	if !d.Write([]byte("now something entirely different and new ")) {
		t.Fatal("verdict did not stick")
	}
}

// TestDefaults: out-of-range arguments take the defaults.
func TestDefaults(t *testing.T) {
	cases := []struct {
		name      string
		n, window int
		threshold float64
	}{
		{"zeros", 0, 0, 0},
		{"negative", -1, -5, -0.5},
		{"threshold above 1", 4, 200, 1.5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := New(c.n, c.window, c.threshold)
			if d.n != DefaultN || len(d.grams) != DefaultWindow-DefaultN+1 || d.threshold != DefaultThreshold {
				t.Fatalf("n %d grams %d threshold %v", d.n, len(d.grams), d.threshold)
			}
		})
	}
}

// TestCJKWithoutSpaces: a long run of text without spaces neither panics
// nor grows memory, and a looping one is caught.
func TestCJKWithoutSpaces(t *testing.T) {
	// Thai writes no spaces either; with its vowel marks kept inside words
	// the whole run is one endless word.
	long := bytes.Repeat([]byte("ภาษาไทยไม่มีช่องว่าง"), 2000)
	d := New(0, 0, 0)
	if d.Write(long) || d.words != 0 {
		t.Fatalf("one unbroken word: fired or counted %d words", d.words)
	}
	d.Write([]byte(" "))
	if d.words != 1 {
		t.Fatalf("words = %d; want 1", d.words)
	}
}

func BenchmarkWrite(b *testing.B) {
	text, err := os.ReadFile(filepath.Join("testdata", "normal", "lisbon_prose.txt"))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		d := New(0, 0, 0)
		for off := 0; off < len(text); off += 7 {
			d.Write(text[off:min(off+7, len(text))])
		}
	}
}
