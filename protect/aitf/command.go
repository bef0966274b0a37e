package aitf

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"strconv"
	"time"
)

// Errors of ScoreCommand.
var (
	// ErrNoInput is returned when the input holds no body.
	ErrNoInput = errors.New("aitf: no input")
	// ErrSessionLine is returned for a session line whose "at" is not an
	// RFC 3339 time.
	ErrSessionLine = errors.New("aitf: bad session line")
)

// sessionLine is one request of a captured session: who sent it, when, and
// its body (a JSON value, or a string holding the raw body). Path, when
// given, is the request's URL path, read for identifiers as the Guard does.
type sessionLine struct {
	Visitor *string         `json:"visitor"`
	At      string          `json:"at"`
	Body    json.RawMessage `json:"body"`
	Path    string          `json:"path"`
}

// ScoreCommand implements `faregate aitf score [FILE]`: it reads one JSON
// body, or NDJSON lines, from r and writes one line per body to w, starting
// with its score: `score=0.945 recursion=0.00 … burst=0.00`.
//
// Input that is one valid JSON document (even pretty-printed over many
// lines) is one line; otherwise every non-blank line is one, scored even
// when it is not JSON. A line of the form
// {"visitor": "...", "at": "RFC 3339", "body": {...}} is a request of a
// captured session: its body is scored and the behaviour dimensions
// (enumeration, repeats, bursts) are replayed per visitor with "at" as the
// clock, as the Guard would have seen them. Any other line is a plain body,
// whose behaviour dimensions are 0.
func ScoreCommand(r io.Reader, w io.Writer) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("aitf: read input: %w", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return ErrNoInput
	}
	rp := replay{mem: newMemory(DefaultMemoryCap), seed: maphash.MakeSeed()}
	bw := bufio.NewWriter(w)
	if json.Valid(data) {
		if err := rp.line(bw, data, 1); err != nil {
			return err
		}
	} else {
		n := 0
		for line := range bytes.Lines(data) {
			n++
			if len(bytes.TrimSpace(line)) == 0 {
				continue
			}
			if err := rp.line(bw, line, n); err != nil {
				return err
			}
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("aitf: write output: %w", err)
	}
	return nil
}

// replay is the score command's state: the behaviour memory its session
// lines go through.
type replay struct {
	mem  *memory
	seed maphash.Seed
}

// line scores one input line (number n, for errors) and writes its output.
func (rp *replay) line(w *bufio.Writer, line []byte, n int) error {
	sl, ok := asSession(line)
	if !ok {
		sr := scan(line)
		writeScore(w, sr.vec)
		return nil
	}
	at, err := time.Parse(time.RFC3339Nano, sl.At)
	if err != nil {
		return fmt.Errorf("%w %d: at %q is not an RFC 3339 time", ErrSessionLine, n, sl.At)
	}
	body := []byte(sl.Body)
	var s string
	if json.Unmarshal(body, &s) == nil {
		// A body captured as a string holds the raw bytes sent.
		body = []byte(s)
	}
	sr := scan(body)
	vec := sr.vec
	if *sl.Visitor != "" {
		rp.mem.behaviour(&vec, sr, *sl.Visitor, at, rp.seed, body, sl.Path)
	}
	writeScore(w, vec)
	return nil
}

// asSession reports whether line is a session line: a JSON object with a
// "visitor" string, an "at" and a "body".
func asSession(line []byte) (sessionLine, bool) {
	var sl sessionLine
	if err := json.Unmarshal(line, &sl); err != nil || sl.Visitor == nil || sl.Body == nil || sl.At == "" {
		return sessionLine{}, false
	}
	return sl, true
}

// writeScore writes "score=0.945 recursion=0.00 … burst=0.00".
func writeScore(w *bufio.Writer, vec Vector) {
	buf := make([]byte, 0, 200)
	buf = append(buf, "score="...)
	buf = strconv.AppendFloat(buf, combine(vec), 'f', 3, 64)
	for i, d := range vec {
		buf = append(buf, ' ')
		buf = append(buf, Dimensions[i]...)
		buf = append(buf, '=')
		buf = strconv.AppendFloat(buf, d, 'f', 2, 64)
	}
	buf = append(buf, '\n')
	// Write errors stick in the bufio.Writer and surface at Flush.
	_, _ = w.Write(buf)
}
