package gateway

import (
	"bytes"
	"errors"
	"io"
)

// errLineTooLong: an SSE line or event over the bound, which makes the
// stream malformed.
var errLineTooLong = errors.New("gateway: SSE line or event over the bound")

// lineReader reads lines of at most max bytes from a provider stream. Its
// buffer starts small and grows only as far as the longest line needs, so
// an ordinary stream holds a few KiB and a hostile one at most max.
type lineReader struct {
	r          io.Reader
	buf        []byte
	start, end int
	max        int
	err        error
	// beforeBlock runs before a read that may wait on the network: the
	// relay flushes what it wrote then, so events leave as they arrive
	// without one flush per event of a burst.
	beforeBlock func()
}

// lineBufStart is where the buffer starts: a chat chunk of a few words is
// 150–400 bytes, so an ordinary stream never grows it. It is held for the
// stream's life (1,000 open streams, 1,000 buffers), so it starts at what
// most events need, not at the 4 KiB a Responses event with a whole
// response object may take once; that one grows it by doubling.
const lineBufStart = 512

func newLineReader(r io.Reader, max int) *lineReader {
	return &lineReader{r: r, buf: make([]byte, min(lineBufStart, max+1)), max: max}
}

// next returns the next line without its "\n" or "\r\n", valid until the
// next call. At the end of the stream it returns the last unterminated
// line, then the reader's error (io.EOF).
func (l *lineReader) next() ([]byte, error) {
	for {
		if i := bytes.IndexByte(l.buf[l.start:l.end], '\n'); i >= 0 {
			line := l.buf[l.start : l.start+i]
			l.start += i + 1
			return bytes.TrimSuffix(line, []byte{'\r'}), nil
		}
		if l.end-l.start > l.max {
			return nil, errLineTooLong
		}
		if l.err != nil {
			// Only a clean end gives up its unterminated last line; a
			// failed read (the call cancelled mid-line) does not.
			if l.start < l.end && l.err == io.EOF {
				line := l.buf[l.start:l.end]
				l.start = l.end
				return bytes.TrimSuffix(line, []byte{'\r'}), nil
			}
			return nil, l.err
		}
		if l.start > 0 {
			n := copy(l.buf, l.buf[l.start:l.end])
			l.start, l.end = 0, n
		}
		if l.end == len(l.buf) {
			size := min(2*len(l.buf), l.max+1)
			if size <= len(l.buf) {
				return nil, errLineTooLong
			}
			nb := make([]byte, size)
			copy(nb, l.buf[:l.end])
			l.buf = nb
		}
		if l.beforeBlock != nil {
			l.beforeBlock()
		}
		n, err := l.r.Read(l.buf[l.end:])
		l.end += n
		if err != nil {
			l.err = err
		}
	}
}

// sseEvent is one dispatched event.
type sseEvent struct {
	name string
	data []byte // valid until the next call of next
}

// sseReader splits a provider's SSE stream into events: data lines
// joined with "\n", the event name, comments and ids ignored. The data of
// one event is bounded like a line.
type sseReader struct {
	lr   *lineReader
	data []byte
	name []byte
	has  bool
}

func newSSEReader(r io.Reader, max int) *sseReader {
	return &sseReader{lr: newLineReader(r, max)}
}

// next returns the next event. At the end of the stream an event without
// its closing blank line is still dispatched (some servers end so), then
// the reader's error.
func (s *sseReader) next() (sseEvent, error) {
	s.data, s.name, s.has = s.data[:0], s.name[:0], false
	for {
		line, err := s.lr.next()
		if err != nil {
			if s.has && err == io.EOF {
				return sseEvent{string(s.name), s.data}, nil
			}
			return sseEvent{}, err
		}
		if len(line) == 0 {
			if s.has {
				return sseEvent{string(s.name), s.data}, nil
			}
			continue
		}
		if line[0] == ':' {
			continue
		}
		k, v, _ := bytes.Cut(line, []byte{':'})
		v = bytes.TrimPrefix(v, []byte{' '})
		switch string(k) {
		case "data":
			if s.has {
				s.data = append(s.data, '\n')
			}
			if len(s.data)+len(v) > s.lr.max {
				return sseEvent{}, errLineTooLong
			}
			s.data = append(s.data, v...)
			s.has = true
		case "event":
			if len(v) <= 128 {
				s.name = append(s.name[:0], v...)
			}
		}
	}
}
