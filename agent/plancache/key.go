package plancache

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"

	"faregate/protect/canon"
)

// DefaultLanguage is the answer language of a request that names none; every
// plan is written in English until the API accepts a language (#12).
const DefaultLanguage = "en"

// keyPrefix starts every plan key. The hash that follows is written as a
// hash tag ({…}) like every faregate key; a plan is a single key, so in a
// cluster its slot is simply that of its hash, spread evenly.
const keyPrefix = "faregate:plan:"

// canonicalVersion is written into the canonical form. Raising it when the
// normalisation rules change gives every request a new key, so plans stored
// under the old rules are never served for a request they no longer match;
// they simply expire.
// Version 2: format and control characters are no longer dropped (a text
// holding them is not cacheable at all, see Cache.Put), so a plan stored
// under version 1 for a plain "lisbon" may have been written for a request
// that carried hidden instructions; none of them is served again.
const canonicalVersion = 2

// Request is what a plan is cached for: the parts of a task request that
// shape the answer. It deliberately has no field for the visitor or the
// principal, so a key can never identify who asked.
type Request struct {
	// Destination as the visitor typed it.
	Destination string
	// Days is the length of the trip.
	Days int
	// Interests in any order, possibly repeated.
	Interests []string
	// Language is the BCP 47 tag of the answer language; empty means
	// DefaultLanguage.
	Language string
}

// canonical is the normalised request that is hashed into a key. It is
// encoded as JSON, never by joining the fields with a separator: JSON quotes
// and escapes every string, so no destination or interest text, whatever
// characters it holds, can move a field boundary, and two different
// canonical values always encode to different bytes (the strings are valid
// UTF-8 by then, so the encoder replaces nothing). Field names and order
// are fixed by the struct, so the encoding is deterministic.
// TestCanonicalInjective and FuzzNormalizeText decode it back to check.
type canonical struct {
	V           int      `json:"v"`
	Destination string   `json:"destination"`
	Days        int      `json:"days"`
	Interests   []string `json:"interests"`
	Language    string   `json:"language"`
}

// Key returns the Redis key of the plan cached for req:
// faregate:plan:{<sha256 hex of the canonical form>}. Requests that differ
// only in letter case, accents on Latin or Greek letters (ß, ł, ø and the
// like included), Unicode compatibility forms (full-width letters,
// ligatures), surrounding or repeated whitespace, the case of the language
// tag, or in the order and repetition of their interests share a key (blank
// interests are ignored); any other difference gives a different key. In
// particular an invisible format or control character is part of the text
// and changes the key: the model reads it, so a plan written for it is not
// a plan for the text without it (and Put and Get refuse such text anyway).
func Key(req Request) string {
	sum := sha256.Sum256(canonicalJSON(req))
	return keyPrefix + "{" + hex.EncodeToString(sum[:]) + "}"
}

// canonicalJSON is the byte string Key hashes.
func canonicalJSON(req Request) []byte {
	c := canonicalize(req)
	b, err := json.Marshal(c)
	if err != nil {
		// A struct of strings, ints and a string slice always encodes.
		panic("plancache: encoding the canonical request: " + err.Error())
	}
	return b
}

// canonicalize applies the normalisation rules to every field.
func canonicalize(req Request) canonical {
	interests := make([]string, 0, len(req.Interests))
	for _, in := range req.Interests {
		if n := normalizeText(in); n != "" {
			interests = append(interests, n)
		}
	}
	slices.Sort(interests)
	interests = slices.Compact(interests)
	return canonical{
		V:           canonicalVersion,
		Destination: normalizeText(req.Destination),
		Days:        req.Days,
		Interests:   interests,
		Language:    normalizeLanguage(req.Language),
	}
}

// normalizeText folds the ways a visitor may write the same words into one
// spelling. It is a coarsening of canon.Fold (NFKC, case-folded): two texts
// canon.Fold makes equal always share a key (FuzzNormalizeText).
//
//  1. canon.Fold: bytes that are not UTF-8 become U+FFFD, so what follows
//     sees text; NFKC and case folding;
//  2. NFKD splits accented letters into letter and combining marks and
//     writes compatibility forms plainly ("ＺＵＲＩＣＨ" → "ZURICH",
//     "ﬁ" → "fi", a no-break space → a space);
//  3. combining marks are dropped after a Latin or Greek letter ("Zürich",
//     "São Paulo", "Kraków", "Αθήνα" lose their accents), because visitors
//     commonly type these names without them. Marks on other scripts stay:
//     a kana's dakuten, a Thai vowel sign or Cyrillic й tell words apart,
//     and a cache that merges two destinations would serve a plan for the
//     wrong place;
//  4. every other rune is case-folded to lower(upper(r)), and the Latin
//     letters whose mark is part of the glyph rather than a combining mark,
//     or that full case folding expands, are spelled plainly (ß, ł, đ, ø,
//     ħ, ı, æ, œ; see plainLatin);
//  5. format characters (zero-width spaces, soft hyphens, joiners, tags)
//     and control characters are kept as they are: the model reads them,
//     and a key must come from the text the model saw (canon.Check refuses
//     them in requests, and the Cache refuses to store or serve them);
//  6. whitespace of any kind is trimmed and collapsed to one space;
//  7. NFC, so what stays decomposed in step 2 (Hangul, kana with dakuten)
//     is written in its composed form again.
//
// Han characters pass through unchanged: "北京" stays "北京". The result is
// a fixed point: normalizing it again changes nothing (FuzzNormalizeText).
//
// Case folding is canon.Fold's (per rune, lower(upper(r)): see there why
// not golang.org/x/text/cases), applied again after NFKD for the letters
// that decomposition exposes.
func normalizeText(s string) string {
	s = norm.NFKD.String(canon.Fold(s))

	var b strings.Builder
	b.Grow(len(s))
	// strippable is whether the last base (non-mark) rune was a Latin or
	// Greek letter, whose combining marks are accents to drop.
	strippable := false
	for _, r := range s {
		switch {
		case unicode.Is(unicode.Mn, r):
			// A kept mark is not case-folded: folding turns the Greek
			// ypogegrammeni into the letter iota, a new base.
			if !strippable {
				b.WriteRune(r)
			}
			continue
		case unicode.IsSpace(r):
			b.WriteByte(' ')
		default:
			r = unicode.ToLower(unicode.ToUpper(r))
			if plain, ok := plainLatin[r]; ok {
				b.WriteString(plain)
			} else {
				b.WriteRune(r)
			}
		}
		strippable = unicode.In(r, unicode.Latin, unicode.Greek)
	}
	return norm.NFC.String(strings.Join(strings.Fields(b.String()), " "))
}

// plainLatin spells the lower-case Latin letters that carry their diacritic
// in the glyph itself, so no decomposition removes it, as visitors who
// cannot type them do. Only letters whose plain spelling names the same
// place are listed; ð and þ are letters of their own and stay.
var plainLatin = map[rune]string{
	'ß': "ss", // Gießen; the full case folding of ß
	'ł': "l",  // Łódź, Wrocław
	'đ': "d",  // Đà Nẵng
	'ø': "o",  // Tromsø
	'ħ': "h",  // Ħamrun
	'ı': "i",  // Diyarbakır
	'æ': "ae", // Ærø
	'œ': "oe",
}

// normalizeLanguage writes a BCP 47 tag in its conventional case (RFC 5646
// §2.1.1): the language subtag lower case, a four-letter script subtag in
// title case, a two-letter or three-digit region upper case, anything else
// lower case; "_" counts as "-". Empty means DefaultLanguage. The tag is
// not otherwise validated or canonicalised (no alias mapping), so a key
// never changes with a library's registry data.
func normalizeLanguage(tag string) string {
	tag = strings.TrimSpace(strings.ToValidUTF8(tag, string(utf8.RuneError)))
	if tag == "" {
		return DefaultLanguage
	}
	parts := strings.Split(strings.ReplaceAll(tag, "_", "-"), "-")
	for i, p := range parts {
		p = strings.ToLower(p)
		switch {
		case i == 0:
		case len(p) == 4 && isASCIILetters(p):
			p = strings.ToUpper(p[:1]) + p[1:]
		case len(p) == 2 && isASCIILetters(p), len(p) == 3 && isASCIIDigits(p):
			p = strings.ToUpper(p)
		}
		parts[i] = p
		// After a singleton (an extension or private use), subtags are
		// not scripts or regions and keep lower case.
		if len(p) == 1 {
			for j := i + 1; j < len(parts); j++ {
				parts[j] = strings.ToLower(parts[j])
			}
			break
		}
	}
	return strings.Join(parts, "-")
}

func isASCIILetters(s string) bool {
	for _, r := range s {
		if (r < 'a' || r > 'z') && (r < 'A' || r > 'Z') {
			return false
		}
	}
	return true
}

func isASCIIDigits(s string) bool {
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
