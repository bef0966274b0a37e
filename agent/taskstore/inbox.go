package taskstore

import (
	"context"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"
)

// InboxKey is the Redis key of task id's inbox: a stream, in the task's
// slot, of what the holder of the task's key posted (progress events,
// model steps, the result), written by agent/taskkey's fenced scripts and
// read by the lease holder alone (ReadInbox).
func InboxKey(id string) string { return "faregate:task:{" + id + "}:inbox" }

// Message is one inbox entry: its stream id, its type and its data as
// posted.
type Message struct {
	ID   string
	Type string
	Data []byte
}

// inboxBatch and inboxDrain bound one read: a blocking read takes what
// came while it waited, a drain what is left once the key is revoked (the
// key's event limit bounds the whole inbox far below either).
const (
	inboxBatch = 100
	inboxDrain = 1000
)

// ReadInbox returns task id's inbox entries after the entry id after ("0":
// from the start). With a block above zero it waits up to block for one,
// on the waits pool (WithWaits); with none it reads what is there now.
func (s *Store) ReadInbox(ctx context.Context, id, after string, block time.Duration) ([]Message, error) {
	var msgs []redis.XMessage
	var err error
	if block > 0 {
		var res []redis.XStream
		res, err = s.waits.XRead(ctx, &redis.XReadArgs{Streams: []string{InboxKey(id), after}, Count: inboxBatch, Block: block}).Result()
		for _, st := range res {
			msgs = append(msgs, st.Messages...)
		}
	} else {
		start := "(" + after
		if after == "0" {
			start = "-"
		}
		msgs, err = s.rdb.XRangeN(ctx, InboxKey(id), start, "+", inboxDrain).Result()
	}
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, unavailable(err)
	}
	out := make([]Message, 0, len(msgs))
	for _, m := range msgs {
		t, _ := m.Values["type"].(string)
		d, _ := m.Values["data"].(string)
		out = append(out, Message{ID: m.ID, Type: t, Data: []byte(d)})
	}
	return out, nil
}
