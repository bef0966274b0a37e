package budget

import (
	"context"
	"fmt"
	"strconv"
	"sync"
)

// Group commit. Every operation of the principals' layout goes to the
// committer of its cluster slot (on a single Redis, the one committer of
// the server), which sends what has gathered as one script (batchScript)
// as soon as the script before it has answered: one script in flight per
// slot and replica. A lone call waits for nothing; concurrent calls share
// a script, its Lua setup and its reads of their scopes, where each used
// to pay for its own. Nothing is charged later than it is sent: each
// settle, with its ledger entry, is in the script that answers it.

// maxBatch bounds the operations of one script, and so how long one
// script holds Redis.
const maxBatch = 128

// The operations' kinds (batchScript's ops) and how many integers each
// answers.
const (
	opReserve     = 'R'
	opSettle      = 'S'
	opWithdraw    = 'W'
	opRelease     = 'T'
	opUsage       = 'U'
	opAfford      = 'A'
	opLayout      = 'Y'
	opLease       = 'L'
	opDirect      = 'D'
	opDirectEnd   = 'E'
	opDirectUndo  = 'X'
	opDirectFree  = 'Z'
	opDayUsage    = 'V'
	opDayAfford   = 'F'
	leaseScopeAns = 4 // each scope of a lease operation, after its 2
)

var answerLen = map[byte]int{opReserve: 6, opSettle: 11, opWithdraw: 2, opRelease: 2, opUsage: 13, opAfford: 4,
	opLayout: 1, opDirect: 10, opDirectEnd: 12, opDirectUndo: 2, opDirectFree: 1, opDayUsage: 14, opDayAfford: 6}

// header builds an operation's header: fields joined by "|", appended
// to one buffer, so an operation costs one string however many fields.
type header struct{ buf []byte }

func (h *header) str(s string) {
	h.buf = append(h.buf, '|')
	h.buf = append(h.buf, s...)
}

func (h *header) num(n int64) {
	h.buf = append(h.buf, '|')
	h.buf = strconv.AppendInt(h.buf, n, 10)
}

// op is one operation on its way: what to send, and its answer.
type op struct {
	kind byte
	slot string // the committer: the hash tag (a single Redis: "")
	key  string // a key of the slot, which routes the script on a cluster
	day  string // the day of an operation on the day's scopes
	hdr  header
	args []string // free-text arguments after the header
	n    int      // integers in the answer

	res  []int64
	err  error
	then func(o *op) // run by the sender once res or err is set, before done
	done chan struct{}
	sent bool // handed to a committer
}

// newOp starts an operation of kind in the slot of tag, routed by key.
func (b *Budget) newOp(kind byte, key, tag string) *op {
	o := &op{kind: kind, key: key, n: answerLen[kind], done: make(chan struct{})}
	if b.cluster {
		o.slot = tag
	}
	o.hdr.buf = append(make([]byte, 0, 96), kind)
	return o
}

// end closes the header with the count of free-text arguments.
func (o *op) end(args ...string) *op {
	o.args = args
	o.hdr.num(int64(len(args)))
	return o
}

// wait is the operation's answer, or the context's end.
func (o *op) wait(ctx context.Context) ([]int64, error) {
	select {
	case <-o.done:
		return o.res, o.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// committer sends one slot's operations, one script at a time.
type committer struct {
	b       *Budget
	mu      sync.Mutex
	pending []*op
	flying  bool
}

// send hands ops to their slots' committers; wait reads each answer. The
// operations a caller needs at once go in one call: those of one slot
// then go in the same script, never one after another.
func (b *Budget) send(ops ...*op) {
	for i, o := range ops {
		if o == nil || o.sent {
			continue
		}
		if b.rdb == nil {
			o.err = errNoRedis
			if o.then != nil {
				o.then(o)
			}
			close(o.done)
			continue
		}
		b.commitMu.Lock()
		c := b.committers[o.slot]
		if c == nil {
			c = &committer{b: b}
			b.committers[o.slot] = c
		}
		b.commitMu.Unlock()
		c.mu.Lock()
		// The rest of this call's operations for the same slot join it.
		for _, p := range ops[i:] {
			if p != nil && !p.sent && p.slot == o.slot {
				p.sent = true
				c.pending = append(c.pending, p)
			}
		}
		start := !c.flying
		c.flying = true
		c.mu.Unlock()
		if start {
			go c.run()
		}
	}
}

// run sends batches until none is pending.
func (c *committer) run() {
	for {
		c.mu.Lock()
		n := min(len(c.pending), maxBatch)
		if n == 0 {
			c.flying = false
			c.mu.Unlock()
			return
		}
		batch := c.pending[:n:n]
		c.pending = c.pending[n:]
		if len(c.pending) == 0 {
			c.pending = nil
		}
		c.mu.Unlock()
		c.b.flush(batch)
	}
}

// flush sends one batch and hands each operation its answer. A batch
// that fails fails every operation in it: each caller treats that as
// Redis not answering (its operation may or may not have run, and every
// operation is safe to send again).
func (b *Budget) flush(batch []*op) {
	groups := *b.ledger.groups.Load()
	args := make([]any, 0, 6+len(groups)+2*len(batch))
	args = append(args, ms(b.now()), dayKeyTTL, int64(ledgerTTL.Seconds()), b.ledger.o.Keep, b.ledger.o.MaxEntries, len(groups))
	for _, g := range groups {
		args = append(args, g)
	}
	// The last three answers are what the batch's records did to the
	// day's stream (backlog, lost, unexported).
	want := 3
	for _, o := range batch {
		args = append(args, string(o.hdr.buf))
		for _, a := range o.args {
			args = append(args, a)
		}
		want += o.n
	}
	// The script runs past any caller's cancellation: it carries other
	// callers' operations too (the client's timeouts bound it).
	v, err := batchScript.Run(context.Background(), b.rdb, []string{batch[0].key}, args...).Int64Slice()
	if err == nil && len(v) != want {
		err = fmt.Errorf("batch script answered %d values for %d", len(v), want)
	}
	b.m.batches.Observe(float64(len(batch)))
	if err == nil {
		b.ledger.observe(batchDay(batch), v[len(v)-3:])
	}
	off := 0
	for _, o := range batch {
		if err != nil {
			o.err = err
		} else {
			o.res = v[off : off+o.n : off+o.n]
			off += o.n
		}
		if o.then != nil {
			o.then(o)
		}
		close(o.done)
	}
}

// batchDay is the day a batch's records went to: that of its first
// operation on the day's scopes (on a single Redis a batch may carry
// several days' operations only across midnight, and then the alert names
// one of them).
func batchDay(batch []*op) string {
	for _, o := range batch {
		if o.day != "" {
			return o.day
		}
	}
	return ""
}
