package aitf

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// ErrNoInput is returned by ScoreCommand when the input holds no body.
var ErrNoInput = errors.New("aitf: no input")

// ScoreCommand implements `faregate aitf score [FILE]`: it reads one JSON
// body, or NDJSON bodies, from r and writes one line per body to w with its
// score and named vector. Input that is one valid JSON document (even
// pretty-printed over many lines) is one body; otherwise every non-blank
// line is a body, scored even when it is not JSON. Behaviour dimensions need
// a visitor's history and are always 0 here.
func ScoreCommand(r io.Reader, w io.Writer) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("aitf: read input: %w", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return ErrNoInput
	}
	bw := bufio.NewWriter(w)
	if json.Valid(data) {
		writeScore(bw, data)
	} else {
		for line := range bytes.Lines(data) {
			if len(bytes.TrimSpace(line)) > 0 {
				writeScore(bw, line)
			}
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("aitf: write output: %w", err)
	}
	return nil
}

// writeScore writes "score=0.700 recursion=0.00 … burst=0.00".
func writeScore(w *bufio.Writer, body []byte) {
	score, vec := Score(body)
	buf := make([]byte, 0, 200)
	buf = append(buf, "score="...)
	buf = strconv.AppendFloat(buf, score, 'f', 3, 64)
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
