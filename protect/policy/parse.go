package policy

import (
	"bytes"
	"cmp"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"go.yaml.in/yaml/v3"

	"faregate/protect/principal"
)

// Problem is one thing wrong in a policy file.
type Problem struct {
	// Line is 1-based; 0 when the problem belongs to no line (an empty
	// file).
	Line int
	// Path says where in the document: "tiers.partner.tasks_per_day",
	// "keys[acme].tier", "keys[#3].id" (the third entry, when its id is
	// unusable), "rules.prompt[no_crypto].pattern".
	Path string
	// Msg says what is wrong; it never quotes a sha256 field's value, in
	// case an operator pasted a key there.
	Msg string
}

// String is "line N: path: message", leaving out what is unknown.
func (p Problem) String() string {
	var b strings.Builder
	if p.Line > 0 {
		fmt.Fprintf(&b, "line %d: ", p.Line)
	}
	if p.Path != "" {
		b.WriteString(p.Path + ": ")
	}
	b.WriteString(p.Msg)
	return b.String()
}

// MaxReported is how many problems a ValidationError keeps: the first
// ones by line. A file can hold any number of problems (a generated one
// with 200,000 bad keys made a 16 MB log line and alert); the operator
// fixes the first few, and the count says how far there is to go.
const MaxReported = 20

// ValidationError lists the first problems found in one policy file (at
// most MaxReported, in line order) and how many there were in all. It
// unwraps to ErrInvalidPolicy.
type ValidationError struct {
	Source   string
	Problems []Problem
	// Total counts every problem found, kept or not.
	Total int
}

// Error puts the problems kept and the count of the rest on one line, so
// that a failed reload logs exactly one line of bounded length.
func (e *ValidationError) Error() string {
	total := max(e.Total, len(e.Problems))
	var b strings.Builder
	noun := "problems"
	if total == 1 {
		noun = "problem"
	}
	fmt.Fprintf(&b, "policy: %s: %d %s: ", e.Source, total, noun)
	for i, p := range e.Problems {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(p.String())
	}
	if more := total - len(e.Problems); more > 0 {
		fmt.Fprintf(&b, "; and %d more", more)
	}
	return b.String()
}

// Unwrap makes every ValidationError an ErrInvalidPolicy.
func (e *ValidationError) Unwrap() error { return ErrInvalidPolicy }

const (
	// maxWhole bounds every whole-number limit (10^15): far above any
	// real limit, far below where doubling or summing overflows int64.
	maxWhole = 1_000_000_000_000_000
	// maxPrice bounds a price per million tokens, in currency units.
	maxPrice = 1_000_000
	// maxPattern bounds a prompt rule's pattern in bytes.
	maxPattern = 4096
	// maxModelName bounds a model name in bytes.
	maxModelName = 200
)

var (
	sha256Shape = regexp.MustCompile(`^[0-9a-fA-F]{64}$`)
	yamlLine    = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)
	wholeDigits = regexp.MustCompile(`^[-+]?[0-9_]+$`)
)

// The fields each mapping of the file may hold.
var (
	topFields  = []string{"tiers", "keys", "rules", "models"}
	tierFields = []string{"tasks_per_day", "tokens_per_day", "tokens_per_minute", "requests_per_minute", "max_site_share",
		"requests_per_second", "tokens_per_hour", "soft_at", "soft_requests_per_minute"}
	keyFields  = []string{"id", "sha256", "tier", "disabled"}
	ruleFields = []string{"builtin", "prompt"}
	patFields  = []string{"name", "pattern"}
	priceField = []string{"input", "output", "cache_write", "cache_read"}
)

// Parse validates a policy file's content; source names it in errors and
// in Source. defaults are the public tier's values from the environment,
// as in Load. The error is a *ValidationError naming every problem.
func Parse(data []byte, source string, defaults principal.Tier) (*Policy, error) {
	ps := &parser{}
	p := &Policy{
		source: source,
		tiers:  map[string]principal.Tier{principal.PublicTier: publicDefaults(defaults)},
		prices: map[string]Price{},
	}
	if root := ps.document(data); root != nil {
		var sections [4]*yaml.Node
		ps.mapping(root, "", topFields, func(name string, _, v *yaml.Node) {
			sections[slices.Index(topFields, name)] = v
		})
		declared := ps.tiers(p, sections[0])
		ps.keys(p, sections[1], declared)
		ps.rules(p, sections[2])
		ps.models(p, sections[3])
	}
	if ps.total > 0 {
		return nil, &ValidationError{Source: source, Problems: ps.problems, Total: ps.total}
	}
	return p, nil
}

// parser collects problems instead of stopping at the first, so that an
// operator fixes a file in one round. It keeps the first MaxReported by
// line (sections are checked one after the other, not in file order) and
// counts the rest without formatting them.
type parser struct {
	problems []Problem // sorted by line, stable; at most MaxReported
	total    int
}

// keeps reports whether a problem on line would be kept (the count
// includes it either way).
func (ps *parser) keeps(line int) bool {
	return len(ps.problems) < MaxReported || line < ps.problems[len(ps.problems)-1].Line
}

// add counts p and keeps it if it is among the first by line.
func (ps *parser) add(p Problem) {
	ps.total++
	if !ps.keeps(p.Line) {
		return
	}
	// After every kept problem of the same line or before: stable.
	i, _ := slices.BinarySearchFunc(ps.problems, p.Line+1, func(q Problem, line int) int { return cmp.Compare(q.Line, line) })
	ps.problems = slices.Insert(ps.problems, i, p)
	if len(ps.problems) > MaxReported {
		ps.problems = ps.problems[:MaxReported]
	}
}

func (ps *parser) bad(n *yaml.Node, path, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	if !ps.keeps(line) {
		ps.total++ // not kept: not worth its message
		return
	}
	ps.add(Problem{Line: line, Path: path, Msg: fmt.Sprintf(format, args...)})
}

// document returns the file's root mapping, or nil after recording why
// there is none.
func (ps *parser) document(data []byte) *yaml.Node {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	err := dec.Decode(&doc)
	if errors.Is(err, io.EOF) {
		ps.bad(nil, "", "the file holds no policy (to run without one, leave FAREGATE_POLICY_FILE empty)")
		return nil
	}
	if err != nil {
		ps.syntax(err)
		return nil
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case err == nil:
		ps.bad(&next, "", "a second YAML document: a policy is one document")
	case !errors.Is(err, io.EOF):
		ps.syntax(err)
	}
	if len(doc.Content) == 0 {
		ps.bad(nil, "", "the file holds no policy")
		return nil
	}
	root := deref(doc.Content[0])
	if root.ShortTag() == "!!null" {
		ps.bad(root, "", "the file holds no policy (to run without one, leave FAREGATE_POLICY_FILE empty)")
		return nil
	}
	return root
}

// syntax records a YAML syntax error with the line yaml reports.
func (ps *parser) syntax(err error) {
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1])
		ps.add(Problem{Line: line, Msg: "YAML: " + m[2]})
		return
	}
	ps.add(Problem{Msg: "YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")})
}

// deref follows YAML aliases (*name) to the node they stand for.
func deref(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

// join appends a field to a path.
func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

// describe names what a node is, for "must be X, not Y" messages.
func describe(n *yaml.Node) string {
	switch n.ShortTag() {
	case "!!map":
		return "a mapping"
	case "!!seq":
		return "a list"
	case "!!str":
		return "text"
	case "!!bool":
		return "true/false"
	case "!!null":
		return "empty"
	case "!!int", "!!float":
		return "a number"
	}
	return n.ShortTag()
}

// mapping calls each for every pair of the mapping n in order, after
// reporting a node that is not a mapping, a name given twice, and (when
// known is not nil) a name not in known. A null n is an empty mapping.
func (ps *parser) mapping(n *yaml.Node, path string, known []string, each func(name string, k, v *yaml.Node)) {
	n = deref(n)
	if n == nil || n.ShortTag() == "!!null" {
		return
	}
	if n.Kind != yaml.MappingNode {
		ps.bad(n, path, "must be a mapping, not %s", describe(n))
		return
	}
	seen := make(map[string]int)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := deref(n.Content[i]), deref(n.Content[i+1])
		if k.Kind != yaml.ScalarNode {
			ps.bad(k, path, "a name must be plain text, not %s", describe(k))
			continue
		}
		name := k.Value
		if first, dup := seen[name]; dup {
			ps.bad(k, join(path, name), "given twice (first at line %d)", first)
			continue
		}
		seen[name] = k.Line
		if known != nil && !slices.Contains(known, name) {
			ps.bad(k, path, "unknown field %q (want one of %s)", name, strings.Join(known, ", "))
			continue
		}
		each(name, k, v)
	}
}

// sequence calls each for every item of the list n. A null n is empty.
func (ps *parser) sequence(n *yaml.Node, path string, each func(i int, item *yaml.Node)) {
	n = deref(n)
	if n == nil || n.ShortTag() == "!!null" {
		return
	}
	if n.Kind != yaml.SequenceNode {
		ps.bad(n, path, "must be a list, not %s", describe(n))
		return
	}
	for i, item := range n.Content {
		each(i, deref(item))
	}
}

// entry returns the fields of one list item, or false after reporting an
// item that is not a mapping.
func (ps *parser) entry(item *yaml.Node, path string, known []string) (map[string]*yaml.Node, bool) {
	if item.Kind != yaml.MappingNode {
		ps.bad(item, path, "must be a mapping, not %s", describe(item))
		return nil, false
	}
	fields := make(map[string]*yaml.Node)
	ps.mapping(item, path, known, func(name string, _, v *yaml.Node) { fields[name] = v })
	return fields, true
}

// mapOrNull reports whether n is a mapping or empty; mapping reports
// anything else.
func mapOrNull(n *yaml.Node) bool {
	n = deref(n)
	return n == nil || n.Kind == yaml.MappingNode || n.ShortTag() == "!!null"
}

// text returns a scalar's text as written (so an id typed 007 stays
// "007").
func (ps *parser) text(v *yaml.Node, path string) (string, bool) {
	if v.Kind != yaml.ScalarNode || v.ShortTag() == "!!null" {
		ps.bad(v, path, "must be text, not %s", describe(v))
		return "", false
	}
	return v.Value, true
}

// whole returns a whole number in [low, maxWhole].
func (ps *parser) whole(v *yaml.Node, path string, low int64) (int64, bool) {
	if v.Kind == yaml.ScalarNode && v.ShortTag() == "!!float" && wholeDigits.MatchString(v.Value) {
		// YAML reads digits too many for int64 as a float.
		ps.bad(v, path, "must be at most %d", int64(maxWhole))
		return 0, false
	}
	if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!int" {
		ps.bad(v, path, "must be a whole number, not %s", describe(v))
		return 0, false
	}
	var x int64
	if err := v.Decode(&x); err != nil || x > maxWhole {
		ps.bad(v, path, "must be at most %d", int64(maxWhole))
		return 0, false
	}
	if x < low {
		ps.bad(v, path, "must be at least %d", low)
		return 0, false
	}
	return x, true
}

// boolean returns true or false, and nothing YAML 1.1 would have guessed
// ("yes", "on").
func (ps *parser) boolean(v *yaml.Node, path string) (bool, bool) {
	if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!bool" {
		ps.bad(v, path, "must be true or false, not %s", describe(v))
		return false, false
	}
	var b bool
	if err := v.Decode(&b); err != nil {
		ps.bad(v, path, "must be true or false")
		return false, false
	}
	return b, true
}

// tiers reads the tiers section into p and returns every tier name the
// file declares with a valid name, valid fields or not, so that keys
// naming a tier with a bad limit are not reported a second time.
func (ps *parser) tiers(p *Policy, n *yaml.Node) map[string]bool {
	declared := make(map[string]bool)
	ps.mapping(n, "tiers", nil, func(name string, k, v *yaml.Node) {
		path := join("tiers", name)
		if !ValidTierName(name) {
			ps.bad(k, path, "a tier name must match [a-z0-9_-]{1,32}")
			return
		}
		declared[name] = true
		t := principal.Tier{Name: name, MaxSiteShare: 1}
		if name == principal.PublicTier {
			t = p.tiers[principal.PublicTier]
		}
		given := make(map[string]bool)
		ok := true
		ps.mapping(v, path, tierFields, func(field string, _, fv *yaml.Node) {
			given[field] = true
			fpath := join(path, field)
			var good bool
			switch field {
			case "tasks_per_day":
				t.TasksPerDay, good = ps.whole(fv, fpath, 1)
			case "tokens_per_day":
				t.TokensPerDay, good = ps.whole(fv, fpath, 1)
			case "requests_per_minute":
				t.RequestsPerMinute, good = ps.whole(fv, fpath, 1)
			case "tokens_per_minute":
				t.TokensPerMinute, good = ps.whole(fv, fpath, 0)
			case "max_site_share":
				t.MaxSiteShare, good = ps.share(fv, fpath)
			case "requests_per_second":
				t.RequestsPerSecond, good = ps.whole(fv, fpath, 0)
			case "tokens_per_hour":
				t.TokensPerHour, good = ps.whole(fv, fpath, 0)
			case "soft_at":
				t.SoftAt, good = ps.softAt(fv, fpath)
			case "soft_requests_per_minute":
				t.SoftRequestsPerMinute, good = ps.whole(fv, fpath, 1)
			}
			ok = ok && good
		})
		if !mapOrNull(v) {
			ok = false // mapping reported it
		} else if name != principal.PublicTier {
			// Other tiers have no environment values to fall back on, and
			// silently inheriting the public lane's would surprise.
			var missing []string
			for _, f := range []string{"tasks_per_day", "tokens_per_day", "requests_per_minute"} {
				if !given[f] {
					missing = append(missing, f)
				}
			}
			if len(missing) > 0 {
				ps.bad(k, path, "%s required", strings.Join(missing, ", "))
				ok = false
			}
		}
		if t.TokensPerHour > 0 {
			// The soft throttle comes with an hourly quota.
			if t.SoftAt == 0 {
				t.SoftAt = principal.DefaultSoftAt
			}
			if t.SoftRequestsPerMinute == 0 {
				t.SoftRequestsPerMinute = principal.DefaultSoftRequestsPerMinute
			}
		}
		if ok {
			p.tiers[name] = t
		}
	})
	return declared
}

// share returns a max_site_share in (0, 1].
func (ps *parser) share(v *yaml.Node, path string) (float64, bool) {
	tag := v.ShortTag()
	var f float64
	if v.Kind != yaml.ScalarNode || (tag != "!!int" && tag != "!!float") || v.Decode(&f) != nil {
		ps.bad(v, path, "must be a number above 0 and at most 1, not %s", describe(v))
		return 0, false
	}
	if math.IsNaN(f) || f <= 0 || f > 1 {
		ps.bad(v, path, "must be above 0 and at most 1 (to stop a tier, disable its keys)")
		return 0, false
	}
	return f, true
}

// softAt returns a soft_at share in (0, 1].
func (ps *parser) softAt(v *yaml.Node, path string) (float64, bool) {
	tag := v.ShortTag()
	var f float64
	if v.Kind != yaml.ScalarNode || (tag != "!!int" && tag != "!!float") || v.Decode(&f) != nil {
		ps.bad(v, path, "must be a number above 0 and at most 1, not %s", describe(v))
		return 0, false
	}
	if math.IsNaN(f) || f <= 0 || f > 1 {
		ps.bad(v, path, "must be above 0 and at most 1 (the share of tokens_per_hour from which the principal is held back)")
		return 0, false
	}
	return f, true
}

// keys reads the keys section into p; declared are the file's tier names.
func (ps *parser) keys(p *Policy, n *yaml.Node, declared map[string]bool) {
	ids := make(map[string]int)
	sums := make(map[[32]byte]int)
	ps.sequence(n, "keys", func(i int, item *yaml.Node) {
		path := fmt.Sprintf("keys[#%d]", i+1)
		fields, isMap := ps.entry(item, path, keyFields)
		if !isMap {
			return
		}
		var e keyEntry
		ok := true
		// The id comes first: once it is known, it names the entry.
		if v := fields["id"]; v == nil {
			ps.bad(item, path, "id required")
			ok = false
		} else if id, good := ps.text(v, join(path, "id")); !good {
			ok = false
		} else if !ValidKeyID(id) {
			ps.bad(v, join(path, "id"), "%q: a key id must match [a-z0-9_-]{1,64}", id)
			ok = false
		} else if first, dup := ids[id]; dup {
			path = fmt.Sprintf("keys[%s]", id)
			ps.bad(v, join(path, "id"), "id used twice (first at line %d)", first)
			ok = false
		} else {
			path = fmt.Sprintf("keys[%s]", id)
			ids[id] = v.Line
			e.ID = id
		}

		if v := fields["sha256"]; v == nil {
			ps.bad(item, path, "sha256 required")
			ok = false
		} else if s, good := ps.text(v, join(path, "sha256")); !good {
			ok = false
		} else if strings.HasPrefix(s, KeyPrefix) {
			ps.bad(v, join(path, "sha256"), "holds a key itself: put only its sha256 in the policy (and make a new key: this one is exposed)")
			ok = false
		} else if !sha256Shape.MatchString(s) {
			ps.bad(v, join(path, "sha256"), "must be 64 hex characters: the SHA-256 of the key")
			ok = false
		} else {
			raw, _ := hex.DecodeString(s)
			sum := [32]byte(raw)
			if first, dup := sums[sum]; dup {
				ps.bad(v, join(path, "sha256"), "same sha256 as the key on line %d: one key cannot have two entries", first)
				ok = false
			} else {
				sums[sum] = v.Line
				e.sum = sum
			}
		}

		if v := fields["tier"]; v == nil {
			ps.bad(item, path, "tier required")
			ok = false
		} else if tier, good := ps.text(v, join(path, "tier")); !good {
			ok = false
		} else if tier == principal.PublicTier {
			ps.bad(v, join(path, "tier"), "keys cannot use the public tier, the anonymous lane: define a tier of their own")
			ok = false
		} else if !declared[tier] {
			ps.bad(v, join(path, "tier"), "tier %q is not defined under tiers", tier)
			ok = false
		} else {
			e.Tier = tier
		}

		if v := fields["disabled"]; v != nil {
			var good bool
			e.Disabled, good = ps.boolean(v, join(path, "disabled"))
			ok = ok && good
		}
		if ok {
			p.keys = append(p.keys, e)
		}
	})
}

// rules reads the rules section into p: the built-in rules first unless
// turned off, then the file's in order.
func (ps *parser) rules(p *Policy, n *yaml.Node) {
	builtin := true
	var prompt *yaml.Node
	ps.mapping(n, "rules", ruleFields, func(name string, _, v *yaml.Node) {
		switch name {
		case "builtin":
			if b, ok := ps.boolean(v, "rules.builtin"); ok {
				builtin = b
			}
		case "prompt":
			prompt = v
		}
	})
	if builtin {
		p.rules = slices.Clone(builtinRules)
	}
	names := make(map[string]int)
	ps.sequence(prompt, "rules.prompt", func(i int, item *yaml.Node) {
		path := fmt.Sprintf("rules.prompt[#%d]", i+1)
		fields, isMap := ps.entry(item, path, patFields)
		if !isMap {
			return
		}
		ok := true
		var name string
		if v := fields["name"]; v == nil {
			ps.bad(item, path, "name required")
			ok = false
		} else if s, good := ps.text(v, join(path, "name")); !good {
			ok = false
		} else if !ValidKeyID(s) {
			ps.bad(v, join(path, "name"), "%q: a rule name must match [a-z0-9_-]{1,64}", s)
			ok = false
		} else if isBuiltinRule(s) {
			path = fmt.Sprintf("rules.prompt[%s]", s)
			ps.bad(v, join(path, "name"), "is a built-in rule's name")
			ok = false
		} else if first, dup := names[s]; dup {
			path = fmt.Sprintf("rules.prompt[%s]", s)
			ps.bad(v, join(path, "name"), "name used twice (first at line %d)", first)
			ok = false
		} else {
			path = fmt.Sprintf("rules.prompt[%s]", s)
			names[s] = v.Line
			name = s
		}

		var re *regexp.Regexp
		if v := fields["pattern"]; v == nil {
			ps.bad(item, path, "pattern required")
			ok = false
		} else if s, good := ps.text(v, join(path, "pattern")); !good {
			ok = false
		} else if len(s) > maxPattern {
			ps.bad(v, join(path, "pattern"), "longer than %d bytes", maxPattern)
			ok = false
		} else if compiled, err := regexp.Compile(s); err != nil {
			ps.bad(v, join(path, "pattern"), "%v", err)
			ok = false
		} else if compiled.MatchString("") {
			ps.bad(v, join(path, "pattern"), "matches empty text, so it would refuse every request")
			ok = false
		} else {
			re = compiled
		}
		if ok {
			p.rules = append(p.rules, rule{name: name, match: re.MatchString})
		}
	})
}

// models reads the models section (prices) into p.
func (ps *parser) models(p *Policy, n *yaml.Node) {
	ps.mapping(n, "models", nil, func(model string, k, v *yaml.Node) {
		path := join("models", model)
		if model == "" || len(model) > maxModelName || strings.ContainsFunc(model, func(r rune) bool {
			return unicode.IsSpace(r) || unicode.IsControl(r)
		}) {
			ps.bad(k, path, "a model name must be 1 to %d bytes without spaces", maxModelName)
			return
		}
		var price Price
		given := 0
		ok := true
		var zeroCache []string // cache prices given as 0
		ps.mapping(v, path, priceField, func(field string, _, fv *yaml.Node) {
			micro, good := ps.price(fv, join(path, field))
			ok = ok && good
			switch field {
			case "input":
				price.InputMicroPerMTok, given = micro, given+1
			case "output":
				price.OutputMicroPerMTok, given = micro, given+1
			case "cache_write":
				price.CacheWriteMicroPerMTok = micro
			case "cache_read":
				price.CacheReadMicroPerMTok = micro
			}
			if good && micro == 0 && strings.HasPrefix(field, "cache_") {
				zeroCache = append(zeroCache, field)
			}
		})
		if !mapOrNull(v) {
			ok = false // mapping reported it
		} else if given < 2 {
			ps.bad(k, path, "input and output prices are both required")
			ok = false
		}
		if price.InputMicroPerMTok > 0 {
			// 0 stands for the default (Price), so it cannot also say
			// "free": the operator would be charged otherwise than written.
			for _, f := range zeroCache {
				ps.bad(k, join(path, f), "0 stands for its default (a share of the input price); give the real price or leave it out")
				ok = false
			}
		}
		if ok {
			p.prices[model] = price
		}
	})
}

// price converts a price per million tokens to integer millionths,
// exactly: decimal text is read as a fraction, never through a float, so
// 0.15 is 150000 and not 149999.
func (ps *parser) price(v *yaml.Node, path string) (int64, bool) {
	tag := v.ShortTag()
	if v.Kind != yaml.ScalarNode || (tag != "!!int" && tag != "!!float") {
		ps.bad(v, path, "must be a number, not %s", describe(v))
		return 0, false
	}
	r, ok := new(big.Rat).SetString(strings.ReplaceAll(v.Value, "_", ""))
	if !ok {
		ps.bad(v, path, "must be a plain decimal number like 0.15")
		return 0, false
	}
	if r.Sign() < 0 {
		ps.bad(v, path, "must not be negative")
		return 0, false
	}
	if r.Cmp(big.NewRat(maxPrice, 1)) > 0 {
		ps.bad(v, path, "must be at most %d per million tokens", maxPrice)
		return 0, false
	}
	r.Mul(r, big.NewRat(1_000_000, 1))
	if !r.IsInt() {
		ps.bad(v, path, "has more than 6 decimal places")
		return 0, false
	}
	return r.Num().Int64(), true
}
