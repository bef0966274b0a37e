package aitf

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"testing"
)

// corpusDir holds the labelled bodies: agent/*.json are agent traffic,
// ordinary/*.json are not. testdata/corpus/README.md names the public
// documentation each family is shaped after.
const corpusDir = "testdata/corpus"

// heldOutOf1 is the share of the corpus held out of every fit: a body is
// held out when the FNV-1a 32-bit hash of its path under corpusDir
// ("agent/mcp-tools-call.json") is 0 modulo heldOutOf1. The split depends on
// nothing but the file name, so adding a body never moves another one.
const heldOutOf1 = 4

// sample is one labelled body of the corpus.
type sample struct {
	name    string // path under corpusDir
	agent   bool
	body    []byte
	heldOut bool
}

// heldOut reports whether the body at name (a path under corpusDir) is in
// the held-out part.
func heldOut(name string) bool {
	h := fnv.New32a()
	h.Write([]byte(name))
	return h.Sum32()%heldOutOf1 == 0
}

// loadCorpus reads every labelled body, sorted by name.
func loadCorpus(t testing.TB) []sample {
	t.Helper()
	var out []sample
	for _, label := range []string{"agent", "ordinary"} {
		names, err := fs.Glob(os.DirFS(corpusDir), label+"/*.json")
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			body, err := os.ReadFile(path.Join(corpusDir, name))
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, sample{name: name, agent: label == "agent", body: body, heldOut: heldOut(name)})
		}
	}
	slices.SortFunc(out, func(a, b sample) int { return cmp.Compare(a.name, b.name) })
	return out
}

// part returns the held-out samples (true) or the training samples (false).
func part(all []sample, held bool) []sample {
	var out []sample
	for _, s := range all {
		if s.heldOut == held {
			out = append(out, s)
		}
	}
	return out
}

// confusion counts outcomes at one threshold.
type confusion struct{ tp, fp, tn, fn int }

func (c confusion) precision() float64 {
	if c.tp+c.fp == 0 {
		return 1
	}
	return float64(c.tp) / float64(c.tp+c.fp)
}

func (c confusion) recall() float64 {
	if c.tp+c.fn == 0 {
		return 1
	}
	return float64(c.tp) / float64(c.tp+c.fn)
}

// scored is a sample with its score.
type scoredSample struct {
	sample
	score float64
	vec   Vector
}

func scoreAll(samples []sample) []scoredSample {
	out := make([]scoredSample, len(samples))
	for i, s := range samples {
		sc, v := Score(s.body)
		out[i] = scoredSample{s, sc, v}
	}
	return out
}

func confusionAt(all []scoredSample, threshold float64) confusion {
	var c confusion
	for _, s := range all {
		hit := s.score >= threshold
		switch {
		case s.agent && hit:
			c.tp++
		case s.agent:
			c.fn++
		case hit:
			c.fp++
		default:
			c.tn++
		}
	}
	return c
}

// report renders the precision/recall table and the worst mistakes, as the
// package README shows them.
func report(all []scoredSample, thresholds []float64) string {
	var b strings.Builder
	b.WriteString("| threshold | precision | recall | TP | FP | FN | TN |\n|---|---|---|---|---|---|---|\n")
	for _, th := range thresholds {
		c := confusionAt(all, th)
		fmt.Fprintf(&b, "| %.1f | %.3f | %.3f | %d | %d | %d | %d |\n", th, c.precision(), c.recall(), c.tp, c.fp, c.fn, c.tn)
	}
	var worstFP, worstFN *scoredSample
	for i := range all {
		s := &all[i]
		if !s.agent && (worstFP == nil || s.score > worstFP.score) {
			worstFP = s
		}
		if s.agent && (worstFN == nil || s.score < worstFN.score) {
			worstFN = s
		}
	}
	if worstFP != nil {
		fmt.Fprintf(&b, "highest ordinary: %s %.3f [%s]\n", worstFP.name, worstFP.score, worstFP.vec)
	}
	if worstFN != nil {
		fmt.Fprintf(&b, "lowest agent:     %s %.3f [%s]\n", worstFN.name, worstFN.score, worstFN.vec)
	}
	return b.String()
}

// TestCorpusSize keeps the corpus at least as large as issue #13 asks, with
// both labels in both parts.
func TestCorpusSize(t *testing.T) {
	all := loadCorpus(t)
	count := map[string]int{}
	for _, s := range all {
		key := "ordinary"
		if s.agent {
			key = "agent"
		}
		if s.heldOut {
			key += "/held-out"
		}
		count[key]++
	}
	agents, ordinary := count["agent"]+count["agent/held-out"], count["ordinary"]+count["ordinary/held-out"]
	if agents < 100 || ordinary < 100 {
		t.Errorf("%d agent and %d ordinary bodies, want at least 100 each", agents, ordinary)
	}
	if count["agent/held-out"] < 20 || count["ordinary/held-out"] < 20 {
		t.Errorf("held out: %d agent, %d ordinary; want at least 20 each", count["agent/held-out"], count["ordinary/held-out"])
	}
	t.Logf("corpus: %v", count)
}

// TestCorpusPrecisionRecall measures the scorer on the held-out part of the
// corpus (never seen by the fit) at the default threshold, and on the whole
// corpus, and fails below precision 0.95 or recall 0.85. `go test -v -run
// TestCorpusPrecisionRecall` prints the README's table.
func TestCorpusPrecisionRecall(t *testing.T) {
	all := loadCorpus(t)
	thresholds := []float64{0.4, 0.5, 0.6, 0.7}
	for _, p := range []struct {
		name    string
		samples []sample
	}{
		{"held-out", part(all, true)},
		{"training", part(all, false)},
		{"all", all},
	} {
		t.Run(p.name, func(t *testing.T) {
			scored := scoreAll(p.samples)
			c := confusionAt(scored, DefaultThreshold)
			if c.precision() < 0.95 || c.recall() < 0.85 {
				t.Errorf("at %.1f: precision %.3f, recall %.3f; want ≥ 0.95 and ≥ 0.85", DefaultThreshold, c.precision(), c.recall())
			}
			t.Logf("%s part, %d bodies:\n%s", p.name, len(scored), report(scored, thresholds))
			for _, s := range scored {
				if (s.score >= DefaultThreshold) != s.agent {
					t.Logf("mistake: %-55s agent=%-5v score=%.3f [%s]", s.name, s.agent, s.score, s.vec)
				}
			}
		})
	}
}
