package policy

import (
	"regexp"
	"strings"
	"unicode"

	"faregate/protect/canon"
)

// rule is one named prompt rule: a compiled pattern or, where RE2 cannot
// say it (it has no backreferences), a function. builtin rules match the
// canon.Skeleton of the text, a file's rules its NFKC form and its
// canon.Fold (see CheckPrompt).
type rule struct {
	name    string
	match   func(string) bool
	builtin bool
}

// The built-in rule names; a file's rules cannot take them.
const (
	RuleInstructionOverride = "instruction_override"
	RuleRepeatForever       = "repeat_forever"
	RuleCharacterRun        = "character_run"
)

// charRunLimit is how many times in a row one non-space character may
// appear. Real place names and interests repeat a letter two or three
// times ("Llanfairpwllgwyngyll", "aaa"); 24 of one is filler or bait, and
// still fits in a 32-character interest.
const charRunLimit = 24

// instructionOverride catches attempts to make the model drop its own
// instructions, in English and Chinese (simplified and traditional). The
// built-in patterns have no (?i): they match canon.Skeleton, which is
// lower case already, and RE2 runs faster without case folding.
var instructionOverride = regexp.MustCompile(`` +
	// "ignore (all of) (the) previous instructions", "disregard your prior rules"
	`\b(?:ignore|disregard|forget|override|bypass)(?:\s+(?:all|any|every|of|the|your|my|these|those|previous|prior|earlier|preceding))*` +
	`\s+(?:previous|prior|above|earlier|preceding|former|system|original)\s+` +
	`(?:instructions?|rules?|prompts?|directions?|directives?|guidelines?|commands?|messages?|context)\b` +
	// "ignore the instructions above"
	`|\b(?:ignore|disregard|forget)(?:\s+(?:all|the|your|my|these|those))*\s+(?:instructions?|rules?|prompts?)\s+(?:above|before)\b` +
	// 忽略之前的指令, 无视以上所有规则, 忽略所有先前的提示, 忘记你之前的设定, 無視之前的規則
	`|(?:忽略|忽视|忽視|无视|無視|忘记|忘記|忘掉|不要理会|不要理會|跳过|跳過)\s*(?:掉\s*)?(?:你\s*)?(?:所有|全部|一切)?\s*(?:的\s*)?` +
	`(?:之前|以上|先前|上面|前面|此前|上述|以前|原来|原來|原先)\s*(?:的\s*)?(?:所有|全部|一切)?\s*(?:的\s*)?` +
	`(?:指令|指示|规则|規則|提示词|提示詞|提示|命令|要求|设定|設定|约束|約束)`)

// loopVerbs are the English verbs of loop bait, in their forms. Nouns
// that would read the same ("type", "list") stay out: "a type of food
// forever loved" is a fine interest.
const loopVerbs = `repeat|repeats|repeated|repeating|say|says|saying|said|print|prints|printing|` +
	`write|writes|writing|output|outputs|outputting|echo|echoes|echoing|generate|generates|generating|loop|looping`

// repeatForever catches loop bait: asking the model to produce output
// without end, which burns tokens until max_tokens.
var repeatForever = regexp.MustCompile(`` +
	// "repeat this forever", "keep saying hello infinitely", "print X ad infinitum"
	`\b(?:` + loopVerbs + `)\b[^.!?\n]{0,40}?` +
	`\b(?:forever|infinitely|indefinitely|endlessly|eternally|ad\s+infinitum|without\s+(?:end|stopping)|non-?stop)\b` +
	// "repeat the word 1000000 times"
	`|\b(?:` + loopVerbs + `)\b[^.!?\n]{0,40}?\b(?:\d{3,}|thousands?|millions?|billions?|infinite)\s+times\b` +
	// "never stop repeating", "infinite loop"
	`|\bnever\s+stop\s+(?:repeating|saying|printing|writing|outputting|generating)\b` +
	`|\binfinite\s+(?:loop|repetition)\b` +
	// 无限重复, 无限循环, 一直重复, 永远重复, 不停地重复, 重复一万次, 重复...直到永远
	`|(?:无限|無限)\s*(?:地\s*)?(?:重复|重複|循环|循環|输出|輸出|打印)` +
	`|(?:一直|永远|永遠|不停|不断|不斷|无休止|無休止|无穷|無窮)\s*(?:地\s*)?(?:重复|重複|循环|循環|输出|輸出|打印)` +
	`|(?:重复|重複|输出|輸出|打印)[^。！？\n]{0,30}?(?:[一二三四五六七八九十百千万萬亿億\d]+\s*(?:万|萬|亿|億)\s*次|直到永远|直到永遠|永不停止|不要停)`)

// builtinRules are tried first, in this order, unless the file turns them
// off with rules.builtin: false.
var builtinRules = []rule{
	{name: RuleInstructionOverride, match: instructionOverride.MatchString, builtin: true},
	{name: RuleRepeatForever, match: repeatForever.MatchString, builtin: true},
	{name: RuleCharacterRun, match: hasCharacterRun, builtin: true},
}

// isBuiltinRule reports whether name is taken by a built-in rule.
func isBuiltinRule(name string) bool {
	for _, r := range builtinRules {
		if r.name == name {
			return true
		}
	}
	return false
}

// hasCharacterRun reports whether s holds charRunLimit or more of one
// non-space character in a row ("aaaaaaaa…", "!!!!!!!!…", "哈哈哈…"). RE2
// has no backreferences, so this is a loop rather than `(.)\1{23,}`.
func hasCharacterRun(s string) bool {
	prev := rune(-1)
	n := 0
	for _, r := range s {
		if r == prev && !unicode.IsSpace(r) {
			n++
			if n >= charRunLimit {
				return true
			}
			continue
		}
		prev, n = r, 1
	}
	return false
}

// CheckPrompt runs the policy's prompt rules over the request's texts and
// returns the name of the first rule that matches. The api answers a match
// with 400 prompt_rejected naming the rule.
//
// A rule sees each text on its own (so a pattern's ^ and $ may mean one
// field's start and end) and all of them joined by line breaks (so a phrase
// split across two interests is caught: "ignore previous" + "instructions";
// repeat_forever lets no more than whitespace cross a field's end, as it
// lets nothing cross a sentence's, so "repeat visits" + "forever young"
// stay two interests). It never sees the text as typed: the built-in rules
// match its canon.Skeleton (folded, accents and look-alike letters written
// as the ASCII they imitate, tag characters as the ASCII they shadow, any
// whitespace one space or line break), so full-width letters, a no-break
// space, a Cyrillic "о" or invisible characters cannot hide a phrase from
// them; a file's rules match both its NFKC form (what the model is given,
// so a pattern that relies on letter case keeps working) and its canon.Fold
// (so a pattern in lower case needs no (?i), and "ＢＩＴＣＯＩＮ" is
// "bitcoin"). A file's patterns may be in any script: they never see a
// skeleton, which would rewrite a Cyrillic word into Latin letters.
func (p *Policy) CheckPrompt(texts ...string) (rule string, matched bool) {
	if len(p.rules) == 0 || len(texts) == 0 {
		return "", false
	}
	var fileForms, skeletons []string
	for _, r := range p.rules {
		var in []string
		if r.builtin {
			if skeletons == nil {
				skeletons = forms(texts, canon.Skeleton)
			}
			in = skeletons
		} else {
			if fileForms == nil {
				fileForms = append(forms(texts, canon.NFKC), forms(texts, canon.Fold)...)
			}
			in = fileForms
		}
		for _, t := range in {
			if r.match(t) {
				return r.name, true
			}
		}
	}
	return "", false
}

// forms returns form of each text and then of all of them joined by line
// breaks (when there is more than one).
func forms(texts []string, form func(string) string) []string {
	out := make([]string, 0, len(texts)+1)
	for _, t := range texts {
		out = append(out, form(t))
	}
	if len(texts) > 1 {
		out = append(out, form(strings.Join(texts, "\n")))
	}
	return out
}
