package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"faregate/protect/aitf"
	"faregate/protect/budget"
)

// runUsage implements `faregate usage [-day YYYY-MM-DD]`: per-model token
// totals of one UTC day, read from the usage ledger stream in Redis.
func runUsage(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("usage", flag.ContinueOnError)
	fs.SetOutput(stdout)
	day := fs.String("day", time.Now().UTC().Format(time.DateOnly), "UTC day, YYYY-MM-DD")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if _, err := time.Parse(time.DateOnly, *day); err != nil {
		return fmt.Errorf("usage: -day %q: want YYYY-MM-DD", *day)
	}
	raw := getenv("FAREGATE_REDIS_URL")
	if raw == "" {
		return errors.New("usage: FAREGATE_REDIS_URL is not set; the embedded Redis lives inside the serving process and cannot be read from here")
	}
	rdb, err := newRedis(raw, getenv("FAREGATE_REDIS_CLUSTER") == "true", 3)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	defer rdb.Close()
	totals, err := budget.NewLedger(rdb, nil).Totals(ctx, *day)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	return budget.WriteTable(stdout, *day, totals)
}

// runAITF implements `faregate aitf score [FILE]`: the vector and score of
// each JSON (or NDJSON) body in FILE or standard input.
func runAITF(args []string, stdout io.Writer) error {
	if len(args) == 0 || args[0] != "score" || len(args) > 2 {
		return errors.New(`usage: faregate aitf score [FILE]   (reads standard input without FILE; a line is a JSON body, or {"visitor","at","body"} to replay a session)`)
	}
	in := io.Reader(os.Stdin)
	if len(args) == 2 && args[1] != "-" {
		f, err := os.Open(args[1])
		if err != nil {
			return fmt.Errorf("aitf score: %w", err)
		}
		defer f.Close()
		in = f
	}
	return aitf.ScoreCommand(in, stdout)
}
