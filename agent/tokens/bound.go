package tokens

import "unicode/utf8"

// bound estimates the tokens of text for a tokenizer it does not know, and
// errs high. BPE tokenizers split text into pieces before merging bytes
// (GPT-style pre-tokenizers; SentencePiece models behave much alike), and a
// piece never shares a token with its neighbours, so the estimate is a sum
// over pieces:
//
//   - a run of ASCII letters: one token per four letters, rounded up. Common
//     English words are one token in every modern vocabulary; long or rare
//     words split into pieces of three to five letters.
//   - a run of digits: one token per digit. Llama 3 and tiktoken group up to
//     three digits, but Qwen, DeepSeek, Mistral and Llama 2 split every digit.
//   - a run of ASCII punctuation: one token per two characters (JSON's `{"`,
//     `":`, `",` are single tokens, longer runs split).
//   - white space: a single space joins the next word for free; any other run
//     (new lines, indentation) is one token, plus one per eight characters.
//   - other characters: one token per two UTF-8 bytes. A Chinese character
//     (three bytes) thus costs 1.5 tokens: cl100k_base, the least efficient
//     of the common vocabularies for Chinese, needed 1.28–1.43 per character
//     on this package's Chinese test texts, o200k_base 0.7–0.96, and Llama 3,
//     Qwen and Mistral's Tekken vocabularies fall between or below. Two-byte
//     scripts (accented Latin, Cyrillic, Greek) cost one token a character.
//
// The sum is then raised by a quarter: Mistral's and Llama 2's smaller
// vocabularies need up to about a fifth more tokens for English than
// cl100k_base. The plain "bytes / 3" rule is weaker on both sides: a Chinese
// character is three bytes but up to 1.4 cl100k tokens, and compact JSON
// ({"a":1,"b":2}) runs at under two bytes a token.
//
// A test checks the bound against cl100k_base and o200k_base on every text
// in testdata (English, Chinese, mixed, JSON): it must cover both. Random
// identifiers and base64 (one token per one or two characters) can still
// exceed it; a reservation that falls short is settled as overage.
func bound(text string) int64 {
	var n, nonASCII int64
	for i := 0; i < len(text); {
		c := text[i]
		j := i + 1
		switch {
		case c >= utf8.RuneSelf:
			_, size := utf8.DecodeRuneInString(text[i:])
			nonASCII += int64(size)
			j = i + size
		case isLetter(c):
			for j < len(text) && isLetter(text[j]) {
				j++
			}
			n += int64(j-i+3) / 4
		case isDigit(c):
			for j < len(text) && isDigit(text[j]) {
				j++
			}
			n += int64(j - i)
		case isSpace(c):
			for j < len(text) && isSpace(text[j]) {
				j++
			}
			if j-i > 1 || c != ' ' {
				n += 1 + int64(j-i)/8
			}
		default:
			for j < len(text) && isPunct(text[j]) {
				j++
			}
			n += int64(j-i+1) / 2
		}
		i = j
	}
	n += (nonASCII + 1) / 2
	return n + (n+3)/4
}

func isLetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }
func isDigit(c byte) bool  { return c >= '0' && c <= '9' }
func isSpace(c byte) bool {
	return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v'
}
func isPunct(c byte) bool { return c < utf8.RuneSelf && !isLetter(c) && !isDigit(c) && !isSpace(c) }
