// Command faregate serves the faregate demo: a public trip-planning agent
// behind Turnstile, daily quotas, token budgets and AI-traffic slowing.
//
//	faregate                      serve (see .env.example for configuration)
//	faregate usage [-day DAY]     per-model token totals of a UTC day
//	faregate ledger export        the usage ledger as JSON Lines, for billing
//	faregate aitf score [FILE]    score captured request bodies (JSON or NDJSON)
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args, os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "faregate:", err)
		os.Exit(1)
	}
}
